"""``convert(model, fuse=True)`` and its inverse: BN→ReLU and BN→add→ReLU in a model's
forward rewritten into fused calls, and back.

Mechanism: ``torch.fx`` symbolic tracing. The pairs to fuse are mostly written in forward
code (``torch.relu(self.bn2(self.conv2(x)) + identity)``, ``out += identity``,
``self.relu(out)``), which only a trace of that code sees; a pattern over modules alone
(``nn.Sequential`` [BN, ReLU] pairs) cannot find a residual add. fx records the ops as a
graph in which "is the batch norm's output used anywhere else" is a question about a node's
users, so the safety rules below are exact for the traced code. Augmented assignments are
recorded as the in-place ops they are (:class:`_Proxy`).

One module at a time: each module that owns a batch norm (its child, or in a ModuleList or
ModuleDict of its own, and reachable by no other path) has its own forward traced with every
submodule a leaf (one call), so only the code of the module that calls the batch norm is
rewritten, and every other module, called alone or hooked later, does what it did. Where
tracing fails (or would bake in train/eval-dependent Python control flow), the module is left
as it is.

The rewritten graph calls :func:`bn_relu` / :func:`bn_add_relu` with the batch norm and ReLU
*modules*, which stay in the tree as they were (same paths, classes, state): the call fuses
where they are still bngrad's batch norm and an unhooked ReLU, and runs them one by one where
something changed them since (``SyncBatchNorm.convert_sync_batchnorm``, hooks), or where a side
input has another dtype or shape (autocast, broadcasting). The module is replaced, in its
parent, by a :class:`torch.fx.GraphModule` with the original's children, parameters, buffers,
hooks and plain attributes; the original module object keeps running as written. An exact
``nn.Sequential``'s forward is the chain of its children: one with adjacent [BatchNorm, ReLU]
children becomes a :class:`_FusedSequential` with the same children (indexing, slicing and
iteration unchanged), whose forward fuses those pairs.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import inspect
import itertools
import operator
import re
import warnings
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, Type, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import ArgumentTypeError, ArgumentValueError
from .fused import (BatchNormAddReLU1d, BatchNormAddReLU2d, BatchNormAddReLU3d, BatchNormReLU1d,
                    BatchNormReLU2d, BatchNormReLU3d, _fused)
from .modules import BatchNorm1d, BatchNorm2d, BatchNorm3d, _has_call_hooks, _take_hooks

__all__ = ["FusionReport", "FusionWarning", "fuse_model", "unfuse_model"]

# bngrad's batch norms, which fuse; the fused modules, which revert cannot put back when built
# into a model's code by hand
_FUSED = (BatchNorm1d, BatchNorm2d, BatchNorm3d)
_FUSED_MODULES = (BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d, BatchNormAddReLU1d,
                  BatchNormAddReLU2d, BatchNormAddReLU3d)

_RELU_FUNCTIONS = (torch.relu, torch.relu_, F.relu, F.relu_)
_ADD_FUNCTIONS = (operator.add, operator.iadd, torch.add)
_OPERATORS = {operator.add: "+", operator.iadd: "+=", operator.mul: "*", operator.sub: "-"}


class FusionWarning(UserWarning):
    """``convert(model, fuse=True)`` left a BN→ReLU or BN→add→ReLU unfused, or could not trace
    a module; the message is the :class:`FusionReport`."""


@dataclasses.dataclass
class FusionReport:
    """What ``convert(model, fuse=True)`` did, attached to the result as
    ``model.bngrad_fusion_report``.

    Attributes
    ----------
    fused : list of (str, str)
        Batch norm path and what it was fused with ("ReLU" or "add + ReLU", and the ops).
    unfused : list of (str, str, bool)
        Batch norm path, why it was not fused, and whether a ReLU or an add did follow it (a
        pattern that was refused, which is warned about) or not (nothing to fuse).
    untraced : list of (str, str)
        Module path ("" for the model) whose forward torch.fx could not trace, and why; the
        batch norms called directly in that forward are converted but not fused.
    """

    fused: List[Tuple[str, str]] = dataclasses.field(default_factory=list)
    unfused: List[Tuple[str, str, bool]] = dataclasses.field(default_factory=list)
    untraced: List[Tuple[str, str]] = dataclasses.field(default_factory=list)

    @property
    def needs_attention(self) -> bool:
        """True when a pattern was refused or a module could not be traced."""
        return bool(self.untraced) or any(refused for _, _, refused in self.unfused)

    def __str__(self) -> str:
        lines = [f"bngrad.torch.convert(fuse=True): {len(self.fused)} batch norm(s) fused, "
                 f"{len(self.unfused)} not" + (f", {len(self.untraced)} module(s) not traced"
                                               if self.untraced else "")]
        lines += [f"  fused     {name or '<model>'}: {how}" for name, how in self.fused]
        lines += [f"  not fused {name or '<model>'}: {why}" for name, why, _ in self.unfused]
        lines += [f"  not traced {name or '<model>'} (the batch norms its own forward calls "
                  f"are not fused): {why}" for name, why in self.untraced]
        return "\n".join(lines)


# --- what a rewritten forward calls -----------------------------------------------------------
# The graph ops of a fused pattern take the modules as they are when called: a batch norm that
# is no longer bngrad's (convert_sync_batchnorm, revert's swap), or that has hooks by then, and
# a ReLU module with hooks, run as the original ops, so that nothing done to the model after
# convert makes it compute something else.

_GLOBAL_HOOKS = tuple(getattr(nn.modules.module, name, {}) for name in (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
    "_global_backward_hooks"))


def _fusable(bn: nn.Module, relu: Any) -> bool:
    """Whether the modules may run as one fused op: a bngrad batch norm, and no hook, of
    theirs or global (``register_module_forward_hook``), that expects them one by one."""
    return (type(bn) in _FUSED and not _has_call_hooks(bn)
            and not (isinstance(relu, nn.Module) and _has_call_hooks(relu))
            and not any(_GLOBAL_HOOKS))


def _fused_call(bn: Any, input: torch.Tensor, side: Optional[torch.Tensor]) -> torch.Tensor:
    """``bn``'s forward (its bookkeeping and checks) with the fused ReLU (and add)."""
    running_mean, running_var, bn_training, factor = bn._step(input)
    try:
        return _fused(input, side, running_mean, running_var, bn.weight, bn.bias, bn_training,
                      factor, bn.eps, "relu")
    except (ArgumentValueError, ArgumentTypeError) as exc:
        raise bn._in_module_terms(exc, input) from None


def _relu(out: torch.Tensor, relu: Any) -> torch.Tensor:
    """The ReLU as the code applied it: its module, or ``torch.relu_`` (``relu`` True: in
    place, as ``F.relu(inplace=True)`` and ``.relu_()``) or ``torch.relu``."""
    if isinstance(relu, nn.Module):
        return relu(out)
    return torch.relu_(out) if relu else torch.relu(out)


def bn_relu(bn: nn.Module, relu: Any, input: torch.Tensor) -> torch.Tensor:
    """``relu(bn(input))`` as one fused pass: a rewritten forward's op for BN→ReLU (``relu``:
    the ``nn.ReLU`` module the code called, or whether the function it called worked in
    place)."""
    if isinstance(input, fx.Proxy):  # under fx tracing (a GraphModule unpickled): one op
        return input.tracer.create_proxy("call_function", bn_relu, (bn, relu, input), {})
    if _fusable(bn, relu):
        return _fused_call(bn, input, None)
    return _relu(bn(input), relu)


def bn_add_relu(bn: nn.Module, relu: Any, input: torch.Tensor, side: torch.Tensor,
                add: str) -> torch.Tensor:
    """``relu(bn(input) + side)`` as one fused pass: a rewritten forward's op for BN→add→ReLU
    (``add``: ``"+"``, ``"side +"`` with the side input first, whose layout the sum then
    takes, or ``"+="`` for an add in place, which keeps batch norm's dtype). A
    side input of another dtype or shape (autocast's bfloat16 beside a float32 shortcut, a
    broadcast) runs the three ops unfused, as the code did."""
    if isinstance(input, fx.Proxy):  # under fx tracing (a GraphModule unpickled): one op
        return input.tracer.create_proxy("call_function", bn_add_relu,
                                         (bn, relu, input, side, add), {})
    if _fusable(bn, relu) and isinstance(side, torch.Tensor) and _same_kind(side, input):
        return _fused_call(bn, input, side)
    out = bn(input)
    out = out.add_(side) if add == "+=" else side + out if add == "side +" else out + side
    return _relu(out, relu)


def _same_kind(side: torch.Tensor, input: torch.Tensor) -> bool:
    # (the same strides too: the sum's memory layout is then the batch norm's, whichever
    # operand the code put first)
    if side.dtype != input.dtype or side.stride() != input.stride():
        return False
    if not torch.jit.is_tracing():
        return side.shape == input.shape
    with warnings.catch_warnings():  # (jit.trace records the sizes; the check runs once)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return bool(side.shape == input.shape)


_GRAPH_OPS = (bn_relu, bn_add_relu)


class _FusedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose adjacent [bngrad BatchNorm, ``nn.ReLU``] children named in
    ``fused_pairs`` run as one fused pass (:func:`bn_relu`); its children, indexing, slicing
    (a plain chain) and iteration are the original's. What ``convert(model, fuse=True)`` puts
    in an exact ``nn.Sequential``'s place (``bngrad.torch.FusedSequential``); ``revert`` makes
    it an ``nn.Sequential`` again (:func:`unfuse_model`)."""

    fused_pairs: Tuple[Tuple[str, str], ...] = ()  # (batch norm, ReLU) child names

    def forward(self, input: Any) -> Any:
        items = list(self._modules.items())
        fused = dict(self.fused_pairs)
        i = 0
        while i < len(items):
            name, module = items[i]
            after = items[i + 1] if i + 1 < len(items) else None
            if (after is not None and fused.get(name) == after[0]
                    and type(after[1]) is nn.ReLU and module is not None):
                input = bn_relu(module, after[1], input)
                i += 2
            else:
                assert module is not None
                input = module(input)
                i += 1
        return input

    def _get_name(self) -> str:
        return "bngrad.torch.FusedSequential"


def _as_sequential(module: nn.Sequential, cls: Type[nn.Sequential]) -> nn.Sequential:
    """A ``cls`` with ``module``'s children (the same objects, in order), hooks and mode."""
    new = cls(collections.OrderedDict(module._modules))
    new.training = module.training
    _take_hooks(new, module)
    return new


class _Proxy(fx.Proxy):
    """fx's Proxy, recording an augmented assignment as the in-place op it is on a tensor
    (fx's own records ``out += x`` as ``out = out + x``: a write into a view lost, and under
    autocast a float32 sum where the original keeps bfloat16)."""


_IN_PLACE = {f"__i{name}__": getattr(operator, f"i{name}") for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor",
    "lshift", "rshift")}
for _name, _op in _IN_PLACE.items():
    def _in_place(self: fx.Proxy, other: Any, _op: Any = _op) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", _op, (self, other), {})
    setattr(_Proxy, _name, _in_place)


class _Tracer(fx.Tracer):
    """Every submodule a leaf: the graph of the traced module's own forward, each submodule
    it calls one node (whose code, hooks and attributes then run as they are). Buffers read
    by the forward (``self.bn.running_mean``) are graph inputs, read when it runs, not
    values computed once at conversion."""

    proxy_buffer_attributes = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _Proxy(node, self)


# forward code that an fx graph does not record: grad mode and autocast switched inside it
_UNRECORDED = re.compile(r"\b(no_grad|enable_grad|set_grad_enabled|inference_mode|autocast)\b")
# ... an attribute assigned on self (a cached feature, a counter: the trace assigns it once);
# {} is the name of the function's first argument
_SELF_ASSIGNED = r"(?<![\w.])({}(?:\.\w+)+)\s*(?:[-+*/%&|^@]|//|\*\*|<<|>>)?=(?!=)"
# ... random numbers drawn outside PyTorch (Python's random, NumPy's: the trace draws once)
_UNTRACED_RANDOM = re.compile(r"(?<![\w.])((?:np\.|numpy\.)?random)\.\w+\(")


def _untraceable(module: nn.Module, child: bool) -> Optional[str]:
    """Why an fx graph of ``module``'s forward would not do what the forward does (None: it
    would): an fx graph keeps the ops only, and replaces the module (``child``: under a
    parent whose own forward calls it, which may use its other methods)."""
    params = list(inspect.signature(module.forward).parameters.values())
    if any(p.default is not inspect.Parameter.empty for p in params):
        return ("its forward has arguments with default values, which tracing takes as "
                "given (an `is None` test would be frozen)")
    if child:
        own = [name for klass in type(module).__mro__[:-1] if issubclass(klass, nn.Module)
               and klass.__module__.split(".")[0] != "torch"
               for name, value in vars(klass).items()
               if (callable(value) or inspect.isdatadescriptor(value))
               and not name.startswith("_") and name != "forward"]
        if own:
            return (f"its class has methods or properties besides forward "
                    f"({', '.join(sorted(set(own)))}), which a traced module would lose")
    # forward, and the functions it calls by name, methods of its class or of its module
    # (fx traces through them; one level deep)
    forward = type(module).forward
    functions = [forward]
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return None
    names = sorted(set(re.findall(r"(?<![\w.])(self\.)?(\w+)\(", source)))
    for is_method, name in names:
        found: Any = (inspect.getattr_static(type(module), name, None) if is_method
                      else getattr(forward, "__globals__", {}).get(name))
        if isinstance(found, (staticmethod, classmethod)):
            found = found.__func__
        if inspect.isfunction(found) and (found.__module__ or "").split(".")[0] not in (
                "torch", "bngrad"):
            functions.append(found)
    for function in functions:
        try:
            text = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        where = "its forward" if function is forward else f"its {function.__name__}"
        found = _UNRECORDED.search(text)
        if found:
            return f"{where} uses {found.group(1)}, which an fx graph does not record"
        first = next(iter(inspect.signature(function).parameters), None)
        found = first and re.search(_SELF_ASSIGNED.format(re.escape(first)), text)
        if found:
            return (f"{where} assigns {found.group(1)}, which an fx graph would assign once, "
                    "while tracing, not at every call")
        found = _UNTRACED_RANDOM.search(text)
        if found:
            return (f"{where} draws numbers from {found.group(1)}, which an fx graph would "
                    "draw once, while tracing (torch's own random ops are recorded)")
        if re.search(r"\.training\b", text):
            return (f"{where} reads a training flag, whose value an fx graph would freeze "
                    "(train and eval mode, of any module, would run the same ops)")
    return None


@contextlib.contextmanager
def _watching_grad_mode() -> Iterator[List[str]]:
    """The names of the grad-mode and autocast switches and reads the code run inside makes
    (an fx graph records neither: ``no_grad`` in a helper, ``torch.is_grad_enabled()``),
    wherever the code is; PyTorch's classes and functions are patched meanwhile."""
    seen: List[str] = []
    undo: List[Tuple[Any, str, Any]] = []

    def watch(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def watched(*args: Any, **kwargs: Any) -> Any:
            seen.append(label)
            return original(*args, **kwargs)
        undo.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, watched)
    for cls in (torch.no_grad, torch.enable_grad, torch.set_grad_enabled, torch.inference_mode,
                torch.amp.autocast):
        watch(cls, "__enter__", cls.__name__)
    for name in ("is_grad_enabled", "is_inference_mode_enabled", "is_autocast_enabled"):
        watch(torch, name, name)
    try:
        yield seen
    finally:
        for owner, name, original in reversed(undo):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _trace(module: nn.Module, child: bool = False) -> Tuple[fx.Graph, nn.Module]:
    """(the fx graph of ``module``'s forward, the shallow copy traced); raises when tracing
    fails, when the graph depends on the training flag (fx would freeze the current mode's
    branch into the code), or when it would not do what the forward does
    (:func:`_untraceable`). A copy is traced, so that the tensor constants fx makes stay off
    ``module``."""
    why = _untraceable(module, child)
    if why is not None:
        raise RuntimeError(why)
    traced = copy.copy(module)  # (its children, parameters and buffers are module's)
    modes = {m: m.training for m in traced.modules()}
    with _watching_grad_mode() as seen:
        graph = _Tracer().trace(traced)
    if seen:
        raise RuntimeError(f"its forward uses {seen[0]}, which an fx graph does not record")
    try:
        for m in modes:
            m.training = not modes[m]
        flipped = _Tracer().trace(copy.copy(traced))
    finally:
        for m, mode in modes.items():
            m.training = mode

    def code(g: fx.Graph) -> str:  # (the constants of each trace are numbered apart)
        return re.sub(r"_tensor_constant\d+", "_tensor_constant", g.python_code("self").src)
    if code(graph) != code(flipped):
        raise RuntimeError("its traced ops differ between two traces, in train and eval mode "
                           "(control flow on self.training, on a value read from a module "
                           "that changes with the mode, or on anything else that changes from "
                           "call to call), which an fx graph would freeze")
    return graph, traced


def _uses(node: fx.Node) -> int:
    """How many times ``node`` is an argument (a user taking it twice counts twice)."""
    count = 0

    def see(arg: fx.Node) -> fx.Node:
        nonlocal count
        count += arg is node
        return arg
    for user in node.users:
        fx.node.map_arg(user.args, see)
        fx.node.map_arg(user.kwargs, see)
    return count


def _from_inputs(node: fx.Node) -> bool:
    """Whether ``node`` depends on a placeholder (an argument of forward): an activation,
    not a parameter, buffer or constant that would broadcast against batch norm's output."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "placeholder":
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _describe(node: fx.Node) -> str:
    if node.op == "call_module":
        return f"module {node.target}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_function":
        target: Any = node.target
        if target in _OPERATORS:
            return _OPERATORS[target]
        module = {"torch._C._VariableFunctions": "torch",
                  "torch.nn.functional": "F"}.get(getattr(target, "__module__", None) or "",
                                                  getattr(target, "__module__", None) or "")
        return f"{module}.{getattr(target, '__name__', target)}".lstrip(".")
    return node.op


def _relu_kind(node: fx.Node, modules: Dict[str, nn.Module]) -> Optional[str]:
    """How ``node`` applies ReLU to its one tensor argument (a description), or None."""
    if node.op == "call_module":
        mod = modules.get(str(node.target))
        if (type(mod) is nn.ReLU and len(node.args) == 1 and not node.kwargs
                and not _has_call_hooks(mod)):
            return f"nn.ReLU(inplace={mod.inplace}) ({node.target})"
        return None
    if node.op == "call_function" and node.target in _RELU_FUNCTIONS:
        extra = node.args[1:] + tuple(v for k, v in node.kwargs.items() if k == "inplace")
        if (len(node.args) >= 1 and all(isinstance(v, bool) for v in extra)
                and set(node.kwargs) <= {"inplace"} and len(node.args) <= 2):
            return _describe(node)
        return None
    if node.op == "call_method" and node.target in ("relu", "relu_"):
        return _describe(node) if len(node.args) == 1 and not node.kwargs else None
    return None


def _as_add(node: fx.Node) -> Optional[Tuple[Any, Any, bool]]:
    """(left, right, in place) when ``node`` is a plain two-operand addition, else None."""
    if node.op == "call_function" and node.target in _ADD_FUNCTIONS:
        is_add = len(node.args) == 2 and not node.kwargs
        inplace = node.target is operator.iadd
    elif node.op == "call_method" and node.target in ("add", "add_"):
        is_add = len(node.args) == 2 and not node.kwargs
        inplace = node.target == "add_"
    else:
        return None
    return (node.args[0], node.args[1], inplace) if is_add else None


def _mutates(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether ``node`` is an in-place op (by PyTorch's trailing-underscore convention, an
    augmented assignment, an item assignment, ``inplace=True``, ``out=`` or an in-place
    module)."""
    if node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    schema = getattr(node.target, "_schema", None)  # an aten op (torch.ops.aten.mul_.Tensor)
    if schema is not None and getattr(schema, "is_mutable", False):
        return True
    if node.op == "call_function" and node.target is operator.setitem:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return ((name.endswith("_") and not name.endswith("__"))
                or node.target in _IN_PLACE.values())
    if node.op == "call_module":
        return getattr(modules.get(str(node.target)), "inplace", False) is True
    return False


@dataclasses.dataclass
class _Match:
    kind: str  # "relu" or "add_relu"
    relu: fx.Node
    add: Optional[fx.Node] = None
    side: Optional[fx.Node] = None
    how: str = ""


def _match(bn: fx.Node, modules: Dict[str, nn.Module]) -> Tuple[Optional[_Match], str, bool]:
    """The pattern that follows the batch-norm call ``bn``, or (None, why not, refused)."""
    users = list(bn.users)
    follows = [u for u in users if _relu_kind(u, modules) or _as_add(u)]
    if len(users) != 1 or _uses(bn) != 1:
        if follows:
            return None, (f"its output is used {_uses(bn)} times (by "
                          f"{', '.join(_describe(u) for u in users)}), not by the ReLU or the "
                          "add alone"), True
        return None, "no ReLU or add follows it", False
    user = users[0]
    if user.op == "output":
        return None, ("its output is what the forward returns (a ReLU applied by the caller is "
                      "not fused: this module, called alone, would apply it)"), False
    relu_how = _relu_kind(user, modules)
    if relu_how:
        return _Match("relu", user, how=f"ReLU ({relu_how})"), "", False
    add = _as_add(user)
    if add is None:
        return None, f"followed by {_describe(user)}, not a ReLU or an add", False
    left, right, inplace = add
    side = right if left is bn else left
    if inplace and right is bn:
        return None, (f"the in-place add ({_describe(user)}) writes the sum into the other "
                      "operand, which a fused module would leave unchanged"), True
    if not isinstance(side, fx.Node) or not _from_inputs(side):
        return None, ("the other operand is a constant or computed from parameters, buffers "
                      "or attributes only, and may broadcast; the fused module takes a side "
                      "input of the batch norm's shape"), True
    sum_users = list(user.users)
    relus = [u for u in sum_users if _relu_kind(u, modules)]
    if len(sum_users) != 1 or _uses(user) != 1:
        if relus:
            return None, (f"the sum is used {_uses(user)} times, not by the ReLU "
                          "alone"), True
        return None, "its sum with another tensor is not followed by a ReLU", False
    relu_how = _relu_kind(sum_users[0], modules)
    if not relu_how:
        return None, (f"its sum with another tensor is followed by "
                      f"{_describe(sum_users[0])}, not a ReLU"), False
    return (_Match("add_relu", sum_users[0], user, side,
                   f"add ({_describe(user)}) + ReLU ({relu_how})"), "", False)


# Modules without a forward of their own: a batch norm in one belongs to the module that
# holds the container (its forward calls ``self.bns[i](x)``).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _own_batch_norms(module: nn.Module, prefix: str, paths: Dict[int, List[str]],
                     report: FusionReport) -> Tuple[Dict[str, nn.Module], bool]:
    """(bngrad's batch norms that only ``module``'s forward can call, by path: its children,
    and those in its ModuleList / ModuleDict containers; whether it has others, reachable by
    another path too (``paths``): those are left out, reported, as they may be called from
    elsewhere)."""
    found: Dict[str, nn.Module] = {}
    shared = False
    todo = [("", module)]
    while todo:
        at, parent = todo.pop()
        for name, child in parent._modules.items():
            if child is None:
                continue
            if type(child) in _FUSED:
                where = paths[id(child)]
                if len(where) > 1:
                    shared = True
                    if f"{prefix}{at}{name}" == where[0]:  # (said once)
                        report.unfused.append((where[0], "the same module is also "
                                               f"{', '.join(where[1:])}: one module cannot be "
                                               "fused for one caller and not another", False))
                    continue
                found[at + name] = child
            elif type(child) in _CONTAINERS:
                todo.append((f"{at}{name}.", child))
    return found, shared


def _pure(module: Optional[nn.Module]) -> bool:
    """Whether calling ``module`` writes into nothing it is given: PyTorch's own modules but
    in-place ones (containers of such), and batch norms (their own statistics only)."""
    if module is None or type(module) in _FUSED:
        return True
    if not type(module).__module__.startswith("torch.nn.modules"):
        return False  # (a subclass of PyTorch's batch norm too: its forward is the user's)
    if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return all(_pure(child) for child in module.children())
    return getattr(module, "inplace", False) is not True


def _allocates(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether ``node``'s result is a new tensor, never a view of an argument: a call of one
    of PyTorch's modules that computes (not Identity, Flatten, Dropout, in place, ...)."""
    if node.op != "call_module":
        return False
    module = modules.get(str(node.target))
    return (_pure(module) and not isinstance(module, _VIEWING) and not isinstance(
        module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


_VIEWING = (nn.Identity, nn.Flatten, nn.Unflatten, nn.modules.dropout._DropoutNd)


def _may_share(x: fx.Node, modules: Dict[str, nn.Module]) -> set:
    """The nodes whose tensors may share memory with ``x``'s: ``x``, what it may be a view
    of, their views, and so on (every op but a computing module's call may return a view)."""
    share, todo = {x}, [x]
    while todo:
        n = todo.pop()
        near = [u for u in n.users if not _allocates(u, modules)]
        if not _allocates(n, modules):
            near += n.all_input_nodes
        for m in near:
            if m not in share:
                share.add(m)
                todo.append(m)
    return share


_KNOWN_MODULES = ("torch", "_operator", "operator", "math", "builtins")


def _stateful(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether ``node`` calls a module holding parameters or buffers (which may be the batch
    norm's own, tied), whatever it is given."""
    module = modules.get(str(node.target)) if node.op == "call_module" else None
    return module is not None and next(
        itertools.chain(module.parameters(), module.buffers()), None) is not None


def _opaque(node: fx.Node, modules: Dict[str, nn.Module]) -> bool:
    """Whether ``node`` runs code that may write into its arguments unseen: a module that is
    not one of PyTorch's own (or an in-place one), or a function of the user's (fx.wrap)."""
    if node.op == "call_module":
        return not _pure(modules.get(str(node.target)))
    if node.op == "call_function":
        home = getattr(node.target, "__module__", None) or ""
        return (not isinstance(node.target, torch._ops.OpOverload)
                and home.split(".")[0] not in _KNOWN_MODULES)
    return False


def _followed(calls: List[fx.Node], modules: Dict[str, nn.Module]) -> bool:
    """Whether a ReLU, or an add then a ReLU, follows any of these batch-norm calls (a
    pattern, refused for what the module is, not for its use)."""
    for call in calls:
        match, _, refused = _match(call, modules)
        if match is not None or refused:
            return True
    return False


def _fuse_graph(root: nn.Module, graph: fx.Graph, prefix: str, owned: Dict[str, nn.Module],
                report: FusionReport, followed: Set[int]) -> bool:
    """Rewrite the patterns of ``graph`` (traced from ``root``) of the batch norms ``root``
    owns, in place, into calls of :func:`bn_relu` / :func:`bn_add_relu`; returns whether
    anything was fused. Adds to ``followed`` the ids of the other bngrad batch norms it calls
    that a pattern follows (a shared one's report entry is then a refusal: fuse_model)."""
    modules = dict(root.named_modules())
    calls: Dict[str, List[fx.Node]] = {path: [] for path in owned}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in calls:
            calls[node.target].append(node)
        elif (node.op == "call_module" and type(modules.get(str(node.target))) in _FUSED
              and _followed([node], modules)):
            followed.add(id(modules[str(node.target)]))
    already = {str(n.args[0].target) for n in graph.nodes  # (an earlier convert's)
               if n.op == "call_function" and n.target in _GRAPH_OPS
               and isinstance(n.args[0], fx.Node)}
    made: Dict[fx.Node, str] = {}  # the fused calls put into the graph, by module path
    fused = False
    for target, nodes in calls.items():
        bn_module = owned[target]
        name = f"{prefix}{target}"
        if target in already and not nodes:
            report.fused.append((name, "fused already (by an earlier convert)"))
            continue
        if len(nodes) != 1:
            report.unfused.append((name, f"the module is called {len(nodes)} times in the "
                                   "forward; one module cannot be fused and unfused"
                                   if nodes else "the forward does not call it",
                                   _followed(nodes, modules)))
            continue
        bn = nodes[0]
        if _has_call_hooks(bn_module):
            report.unfused.append((name, "it has forward or backward hooks, which expect "
                                   "batch norm's own input and output", True))
            continue
        if len(bn.args) != 1 or bn.kwargs or not isinstance(bn.args[0], fx.Node):
            report.unfused.append((name, "it is not called with one positional tensor", False))
            continue
        match, why, refused = _match(bn, modules)
        if match is None and list(bn.users)[:1] and list(bn.users)[0] in made:
            why = (f"it is the side input of {prefix}{made[list(bn.users)[0]]}'s fused add "
                   "(its other operand)")
        if match is None:
            report.unfused.append((name, why, refused))
            continue
        # The fused call runs where the ReLU or the add is (the side input is ready there):
        # nothing in between may write into batch norm's input. Any in-place op at all (a
        # view of the input, x.view(-1).mul_(2), is another node), and any module given
        # something computed from the input that is not known to leave its arguments alone.
        x = bn.args[0]
        end = match.add if match.add is not None else match.relu
        shared = _may_share(x, modules)
        state = {n for n in graph.nodes  # the batch norm's parameters and statistics
                 if n.op == "get_attr" and str(n.target).startswith(f"{target}.")}
        node = bn.next
        while node is not end and not _mutates(node, modules) and not (
                _opaque(node, modules) and (_stateful(node, modules) or any(
                    a in shared for a in node.all_input_nodes))):
            if node in state or any(a in state for a in node.all_input_nodes):
                break  # reads the batch norm's state before the fused call updates it
            node = node.next
        if node is not end:
            what = ("reads its state" if node in state or any(
                a in state for a in node.all_input_nodes) else "may write in place")
            report.unfused.append((name, f"{_describe(node)} {what} between the batch norm "
                                   "and the ReLU (the fused call runs at the ReLU; a write "
                                   "would reach its input, or a tensor that may share its "
                                   "memory)", True))
            continue
        with graph.inserting_before(end):
            bn_ref = graph.get_attr(target)
            relu_ref: Any = (graph.get_attr(str(match.relu.target))
                             if match.relu.op == "call_module" else _mutates(match.relu, modules))
            if match.kind == "relu":
                new = graph.call_function(bn_relu, (bn_ref, relu_ref, x))
            else:
                add = _as_add(end)
                assert add is not None
                form = "+=" if add[2] else "+" if add[0] is bn else "side +"
                new = graph.call_function(bn_add_relu, (bn_ref, relu_ref, x, match.side, form))
        made[new] = target
        match.relu.replace_all_uses_with(new)
        graph.erase_node(match.relu)
        if match.add is not None:
            graph.erase_node(match.add)
        graph.erase_node(bn)
        report.fused.append((name, match.how))
        fused = True
    if fused:
        graph.lint()
    return fused


# A module's hooks and attributes, which GraphModule's own copies and pickles drop (they
# rebuild the module from its code and keep the state_dict hooks only)
_HOOKS_AND_STATE = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                    "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                    "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook")


def _kept(module: nn.Module, rebuilt: nn.Module) -> Dict[str, Any]:
    """What ``module``'s dict holds that ``rebuilt`` (GraphModule's copy) lacks: hooks, plain
    attributes, the fusion report."""
    return {k: v for k, v in module.__dict__.items()
            if k in _HOOKS_AND_STATE or k not in rebuilt.__dict__}


def _rebuilt(reduce: Any, args: Any, kept: Dict[str, Any]) -> nn.Module:
    module = reduce(*args)
    module.__dict__.update(kept)
    return module


class _Rewritten(fx.GraphModule):
    """The GraphModule of a rewritten forward: copies and pickles keep its hooks and
    attributes, as the module it replaces would."""

    def __deepcopy__(self, memo: Dict[int, Any]) -> fx.GraphModule:
        res = super().__deepcopy__(memo)
        for key, value in _kept(self, res).items():
            res.__dict__[key] = copy.deepcopy(value, memo)
        return res

    def __reduce__(self) -> Tuple[Any, ...]:
        reduce, args = super().__reduce__()
        rebuilt = reduce(*args)  # (what unpickling will make: to know what it lacks)
        return (_rebuilt, (reduce, args, _kept(self, rebuilt)))


def _graph_module(root: nn.Module, traced: nn.Module, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule running ``graph`` (traced from ``traced``, a shallow copy of ``root``)
    whose children, parameters and buffers are ``root``'s own, in ``root``'s order
    (GraphModule alone would copy only the referenced ones, in call order: keys and parameter
    order would change), with ``root``'s other attributes for its callers."""
    gm = _Rewritten(traced, graph, class_name=type(root).__name__)
    # the tensors the graph reads that are not root's state (plain tensor attributes, fx's
    # constants): plain attributes again, not buffers (state_dict keys stay root's)
    read = {k: v for k, v in gm._buffers.items()
            if k not in root._buffers and k not in root._parameters}
    gm._modules.clear()
    gm._modules.update(root._modules)
    gm._parameters.clear()
    gm._parameters.update(root._parameters)
    gm._buffers.clear()
    gm._buffers.update(root._buffers)
    gm._non_persistent_buffers_set = set(root._non_persistent_buffers_set)
    for key, value in read.items():
        gm.__dict__[key] = value
    # numbers and flags (instance and class attributes) a caller may read, e.g. a block's
    # stride; the graph's own reads were frozen by the trace
    own = dict(root.__dict__)
    for klass in reversed(type(root).__mro__):
        if issubclass(klass, nn.Module) and klass.__module__.split(".")[0] != "torch":
            own.update((k, v) for k, v in vars(klass).items() if not callable(v)
                       and not isinstance(v, (property, staticmethod, classmethod)))
    for key, value in own.items():
        if not key.startswith("_") and key not in gm.__dict__ and key != "training":
            gm.__dict__[key] = value
    _take_hooks(gm, root)
    gm.training = root.training  # not gm.train(): the children keep their own modes
    return gm


def _fuse_sequential(seq: nn.Sequential, prefix: str, owned: Dict[str, nn.Module],
                     report: FusionReport, followed: Set[int]) -> nn.Module:
    """An ``nn.Sequential``'s forward is its chain: adjacent [bngrad BatchNorm*d, nn.ReLU]
    children run fused, in a :class:`_FusedSequential` (``seq`` itself is left as it is);
    ``followed`` as in :func:`_fuse_graph`."""
    names = list(seq._modules)
    pairs = []
    for i, first in enumerate(names):
        relu = seq._modules[names[i + 1]] if i + 1 < len(names) else None
        if first not in owned:
            if type(seq._modules[first]) in _FUSED and type(relu) is nn.ReLU:
                followed.add(id(seq._modules[first]))
            continue
        name = f"{prefix}{first}"
        if type(relu) is not nn.ReLU:
            why = ("it is the last module of its nn.Sequential" if i + 1 == len(names) else
                   f"followed by module {prefix}{names[i + 1]} ({type(relu).__name__}), not "
                   "a ReLU")
            report.unfused.append((name, why, False))
        elif _has_call_hooks(owned[first]) or _has_call_hooks(relu):
            report.unfused.append((name, "it or the nn.ReLU after it has forward or backward "
                                   "hooks", True))
        else:
            assert isinstance(relu, nn.ReLU)
            pairs.append((first, names[i + 1]))
            report.fused.append((name, f"ReLU (nn.ReLU(inplace={relu.inplace}) "
                                 f"{prefix}{names[i + 1]}, in an nn.Sequential)"))
    if not pairs:
        return seq
    fused = cast(_FusedSequential, _as_sequential(seq, _FusedSequential))
    fused.fused_pairs = tuple(pairs)
    return fused


def _fuse_tree(module: nn.Module, prefix: str, report: FusionReport,
               paths: Dict[int, List[str]], done: Dict[int, nn.Module], followed: Set[int]
               ) -> nn.Module:
    """``module`` with the patterns in its own forward and in its descendants' fused; a
    module met again (shared) gets what it got the first time."""
    if id(module) in done:
        return done[id(module)]
    for name, child in list(module._modules.items()):
        if child is not None:
            new = _fuse_tree(child, f"{prefix}{name}.", report, paths, done, followed)
            if new is not child:
                module._modules[name] = new
    result = module
    owned, shared = _own_batch_norms(module, prefix, paths, report)
    if type(module) is nn.Sequential:
        result = _fuse_sequential(module, prefix, owned, report, followed)
    elif type(module) is _FusedSequential:
        report.fused.extend((f"{prefix}{bn}", "fused already (by an earlier convert)")
                            for bn, _ in module.fused_pairs)
    elif owned and isinstance(module, nn.Sequential):
        for path in owned:  # (traced, it would lose its indexing; its class is its own)
            report.unfused.append((f"{prefix}{path}", f"its nn.Sequential subclass "
                                   f"{type(module).__name__} is kept as it is", False))
    elif (owned or shared) and type(module) not in _CONTAINERS:
        # (a module with shared batch norms only is traced to see whether a ReLU follows one)
        try:
            graph, traced = _trace(module, child=bool(prefix))
        except Exception as exc:  # any error of user code under tracing: fall back, say why
            if owned:
                report.untraced.append((prefix.rstrip("."), f"{type(exc).__name__}: {exc}"))
        else:
            if _fuse_graph(module, graph, prefix, owned, report, followed):
                result = _graph_module(module, traced, graph)
    done[id(module)] = result
    return result


def fuse_model(module: nn.Module) -> nn.Module:
    """The fusion pass of ``convert(module, fuse=True)``, on a model whose batch norms are
    already bngrad's; attaches the report and warns when it needs attention."""
    report = FusionReport()
    paths: Dict[int, List[str]] = collections.defaultdict(list)
    for path, sub in module.named_modules(remove_duplicate=False):
        paths[id(sub)].append(path)
    followed: Set[int] = set()
    result = _fuse_tree(module, "", report, paths, {}, followed)
    # a batch norm shared between modules, a ReLU after one of its calls: a refused pattern
    shared = {where[0] for key, where in paths.items() if len(where) > 1 and key in followed}
    report.unfused = [(name, why, refused or name in shared)
                      for name, why, refused in report.unfused]
    result.__dict__["bngrad_fusion_report"] = report  # a plain attribute, not in state_dict
    if report.needs_attention:
        warnings.warn(str(report), FusionWarning, stacklevel=3)
    return result


# --- revert ----------------------------------------------------------------------------------

def _unfuse_graph(gm: fx.GraphModule) -> None:
    """Put the batch norm's call, the add and the ReLU back in place of every
    :func:`bn_relu` / :func:`bn_add_relu` call of ``gm``'s graph."""
    graph, found = gm.graph, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _GRAPH_OPS:
            continue
        bn_ref, relu_ref, x = node.args[:3]
        assert isinstance(bn_ref, fx.Node)
        with graph.inserting_before(node):
            out = graph.call_module(str(bn_ref.target), (x,))
            if node.target is bn_add_relu:
                side, add = node.args[3], node.args[4]
                out = graph.call_function(operator.iadd if add == "+=" else operator.add,
                                          (side, out) if add == "side +" else (out, side))
            relu = (graph.call_module(str(relu_ref.target), (out,))
                    if isinstance(relu_ref, fx.Node) else
                    graph.call_function(torch.relu_ if relu_ref else torch.relu, (out,)))
        node.replace_all_uses_with(relu)
        graph.erase_node(node)
        for ref in (bn_ref, relu_ref):
            if isinstance(ref, fx.Node) and not ref.users:
                graph.erase_node(ref)
        found = True
    if found:
        graph.lint()
        gm.recompile()


def unfuse_model(module: nn.Module) -> nn.Module:
    """The fused half of ``revert``: the fused calls of GraphModules become the batch norm's
    call, the add and the ReLU again, FusedSequentials nn.Sequentials; fused modules built by
    hand are left with a warning (their ReLU cannot be put back into arbitrary forward
    code)."""
    for gm in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        _unfuse_graph(gm)
    left = []

    def swap(mod: nn.Module, path: str) -> nn.Module:
        if type(mod) is _FusedSequential:
            mod = _as_sequential(mod, nn.Sequential)
        elif type(mod) in _FUSED_MODULES:
            left.append(path.rstrip(".") or "<model>")
            return mod
        for name, child in list(mod._modules.items()):
            if child is not None:
                mod._modules[name] = swap(child, f"{path}{name}.")
        return mod
    module = swap(module, "")
    if left:
        warnings.warn(f"bngrad.torch.revert: fused module(s) {', '.join(left)} left as they "
                      "are: they are not called in a torch.fx graph that revert can rewrite, so "
                      "their ReLU cannot be put back", FusionWarning, stacklevel=3)
    if "bngrad_fusion_report" in module.__dict__:
        del module.__dict__["bngrad_fusion_report"]
    return module
