"""``convert(model, fuse=True)`` and its inverse: BN→ReLU and BN→add→ReLU in a model's
forward rewritten into :mod:`bngrad.torch.fused`'s modules, and back.

Mechanism: ``torch.fx`` symbolic tracing. The pairs to fuse are mostly written in forward
code (``torch.relu(self.bn2(self.conv2(x)) + identity)``, ``out += identity``,
``self.relu(out)``), which only a trace of that code sees; a pattern over modules alone
(``nn.Sequential`` [BN, ReLU] pairs) cannot find a residual add. fx records the ops as a
graph in which "is the batch norm's output used anywhere else" is a question about a node's
users, so the safety rules below are exact for the traced code.

One module at a time: each module that owns a batch norm (its child, or in a ModuleList or
ModuleDict of its own) has its own forward traced with every submodule a leaf (one call),
so only the code of the module that calls the batch norm is rewritten, and every other
module, called alone or hooked later, does what it did. An ``nn.Sequential``'s forward is the
chain of its children: its adjacent [BatchNorm, ReLU] pairs are fused by module pattern (the
ReLU's slot holds a pass-through), and it stays an ``nn.Sequential``. Where tracing fails (or
would bake in train/eval-dependent Python control flow), the module is left as it is.

Layout of the result: the fused module is put at the batch norm's path (so ``state_dict``
keys, parameter and buffer objects and their order do not change), and a traced module that
had something fused is replaced, in its parent, by a :class:`torch.fx.GraphModule` whose
children are the original child modules (every submodule kept, called or not). The unfused
ops are removed from the graph; ReLU modules stay in the tree, unused. The original module
object keeps its own children (its batch norms unfused, sharing their state), so it still
runs as written.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import operator
import re
import warnings
from typing import Any, Dict, List, Optional, Tuple, Type, cast

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from .fused import (BatchNormAddReLU1d, BatchNormAddReLU2d, BatchNormAddReLU3d, BatchNormReLU1d,
                    BatchNormReLU2d, BatchNormReLU3d, _AddReLU)
from .modules import (_TO_TORCH, BatchNorm1d, BatchNorm2d, BatchNorm3d,
                      _has_call_hooks, _share_state, _take_hooks)

__all__ = ["FusionReport", "FusionWarning", "fuse_model", "unfuse_model"]

# bngrad's batch norm -> (its BN+ReLU module, its BN+add+ReLU module)
_FUSED: Dict[Type[nn.Module], Tuple[Type[nn.Module], Type[nn.Module]]] = {
    BatchNorm1d: (BatchNormReLU1d, BatchNormAddReLU1d),
    BatchNorm2d: (BatchNormReLU2d, BatchNormAddReLU2d),
    BatchNorm3d: (BatchNormReLU3d, BatchNormAddReLU3d)}
# fused module -> PyTorch's batch norm of the same dimension
_UNFUSED: Dict[Type[nn.Module], Type[nn.Module]] = {
    f: _TO_TORCH[bn] for bn, pair in _FUSED.items() for f in pair}
_ADD_RELU = (BatchNormAddReLU1d, BatchNormAddReLU2d, BatchNormAddReLU3d)

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
                 f"{len(self.unfused)} not"]
        lines += [f"  fused     {name or '<model>'}: {how}" for name, how in self.fused]
        lines += [f"  not fused {name or '<model>'}: {why}" for name, why, _ in self.unfused]
        lines += [f"  not traced {name or '<model>'} (the batch norms its own forward calls "
                  f"are not fused): {why}" for name, why in self.untraced]
        return "\n".join(lines)


class _FusedAway(nn.Module):
    """Stands where an ``nn.ReLU`` was in an ``nn.Sequential`` whose batch norm before it now
    applies the ReLU (the module-pattern fallback); :func:`unfuse_model` puts the ReLU back."""

    def __init__(self, inplace: bool):
        super().__init__()
        self.inplace = inplace

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return input

    def extra_repr(self) -> str:
        return f"ReLU(inplace={self.inplace}) fused into the batch norm before"

    def _get_name(self) -> str:
        return "bngrad.torch.FusedAway"


class _Tracer(fx.Tracer):
    """Every submodule a leaf: the graph of the traced module's own forward, each submodule
    it calls one node (whose code, hooks and attributes then run as they are)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return True


# forward code that an fx graph does not record: grad mode and autocast switched inside it
_UNRECORDED = re.compile(r"\b(no_grad|enable_grad|set_grad_enabled|inference_mode|autocast)\b")


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
               if callable(value) and not name.startswith("_") and name != "forward"]
        if own:
            return (f"its class has methods besides forward ({', '.join(sorted(set(own)))}), "
                    "which a traced module would lose")
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return None
    found = _UNRECORDED.search(source)
    if found:
        return f"its forward uses {found.group(1)}, which an fx graph does not record"
    return None


def _trace(module: nn.Module, child: bool = False) -> fx.Graph:
    """The fx graph of ``module``'s forward; raises when tracing fails, when the graph
    depends on the training flag (fx would freeze the current mode's branch into the code),
    or when it would not do what the forward does (:func:`_untraceable`)."""
    why = _untraceable(module, child)
    if why is not None:
        raise RuntimeError(why)
    modes = {m: m.training for m in module.modules()}
    graph = _Tracer().trace(module)
    try:
        for m in modes:
            m.training = not modes[m]
        flipped = _Tracer().trace(module)
    finally:
        for m, mode in modes.items():
            m.training = mode
    if graph.python_code("self").src != flipped.python_code("self").src:
        raise RuntimeError("its traced ops differ between train and eval mode (control flow on "
                           "self.training, or a value read from a module that changes with "
                           "the mode), which an fx graph would freeze")
    return graph


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
    if node.op == "call_function" and node.target is operator.setitem:
        return True
    if node.op == "call_method":
        name = str(node.target)
        return name.endswith("_") and not name.endswith("__")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return ((name.endswith("_") and not name.endswith("__"))
                or node.target in (operator.iadd, operator.isub, operator.imul,
                                   operator.itruediv))
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


def _fused_copy(bn: nn.Module, cls: Type[nn.Module]) -> nn.Module:
    return _take_hooks(_share_state(cls(bn.num_features, bn.eps, bn.momentum, bn.affine,
                                        bn.track_running_stats), bn), bn)


# Modules without a forward of their own: a batch norm in one belongs to the module that
# holds the container (its forward calls ``self.bns[i](x)``).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _own_batch_norms(module: nn.Module) -> Dict[str, nn.Module]:
    """bngrad's batch norms that only ``module``'s forward can call, by path: its children,
    and those in its ModuleList / ModuleDict containers."""
    found: Dict[str, nn.Module] = {}
    todo = [("", module)]
    while todo:
        prefix, parent = todo.pop()
        for name, child in parent._modules.items():
            if child is None:
                continue
            if type(child) in _FUSED:
                found[prefix + name] = child
            elif type(child) in _CONTAINERS:
                todo.append((f"{prefix}{name}.", child))
    return found


def _fuse_graph(root: nn.Module, graph: fx.Graph, prefix: str, owned: Dict[str, nn.Module],
                report: FusionReport) -> Dict[str, nn.Module]:
    """Rewrite the patterns of ``graph`` (traced from ``root``) of the batch norms ``root``
    owns, in place; returns the fused modules to put at their paths."""
    modules = dict(root.named_modules())
    calls: Dict[str, List[fx.Node]] = {path: [] for path in owned}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in calls:
            calls[node.target].append(node)
    made: Dict[fx.Node, str] = {}  # the fused calls put into the graph, by module path
    fused: Dict[str, nn.Module] = {}
    for target, nodes in calls.items():
        bn_module = owned[target]
        name = f"{prefix}{target}"
        if len(nodes) != 1:
            report.unfused.append((name, f"the module is called {len(nodes)} times in the "
                                   "forward; one module cannot be fused and unfused"
                                   if nodes else "the forward does not call it", False))
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
        # The fused call runs where the add is (the side input is ready there): nothing in
        # between may write into batch norm's input.
        # (Any write at all: a view of the input, x.view(-1).mul_(2), is another node.)
        x = bn.args[0]
        end = match.add if match.add is not None else match.relu
        node = bn.next
        while node is not end and not _mutates(node, modules):
            node = node.next
        if node is not end:
            report.unfused.append((name, f"{_describe(node)} writes in place between the "
                                   "batch norm and the ReLU (into its input, or into a tensor "
                                   "that may share its memory)", True))
            continue
        relu_cls, add_relu_cls = _FUSED[type(bn_module)]
        if match.kind == "relu":
            match.relu.replace_all_uses_with(bn)
            graph.erase_node(match.relu)
            fused[target] = _fused_copy(bn_module, relu_cls)
        else:
            assert match.add is not None
            add = _as_add(match.add)
            assert add is not None
            with graph.inserting_before(match.add):
                new = graph.call_module(target, (x, match.side))
            made[new] = target
            match.relu.replace_all_uses_with(new)
            graph.erase_node(match.relu)
            graph.erase_node(match.add)
            graph.erase_node(bn)
            module = cast(_AddReLU, _fused_copy(bn_module, add_relu_cls))
            # the add as traced: a side input of another dtype or shape (autocast,
            # broadcasting) runs the ops unfused, as the original code does
            module.unfused_add = "+=" if add[2] else "+"
            fused[target] = module
        report.fused.append((name, match.how))
    if fused:
        graph.lint()
    return fused


def _set_path(root: nn.Module, path: str, new: nn.Module) -> None:
    """Put ``new`` at ``path`` under ``root``, copying the containers on the way (they are
    shared with the module ``root`` was made from, whose forward must not see ``new``)."""
    *parents, name = path.split(".")
    for part in parents:
        shared = root._modules[part]
        assert shared is not None  # (a path fx called)
        container = copy.copy(shared)
        container._modules = dict(shared._modules)
        root._modules[part] = container
        root = container
    root._modules[name] = new


def _graph_module(root: nn.Module, graph: fx.Graph, fused: Dict[str, nn.Module]
                  ) -> fx.GraphModule:
    """A GraphModule running ``graph`` whose children, parameters and buffers are ``root``'s
    own, in ``root``'s order (GraphModule alone would copy only the referenced ones, in call
    order: keys and parameter order would change), with ``fused`` at their paths."""
    gm = fx.GraphModule(root, graph, class_name=type(root).__name__)
    gm._modules.clear()
    gm._modules.update(root._modules)
    for path, module in fused.items():
        _set_path(gm, path, module)
    gm._parameters.clear()
    gm._parameters.update(root._parameters)
    gm._buffers.clear()
    gm._buffers.update(root._buffers)
    gm._non_persistent_buffers_set = set(root._non_persistent_buffers_set)
    _take_hooks(gm, root)
    gm.training = root.training  # not gm.train(): the children keep their own modes
    return gm


def _fuse_sequential(seq: nn.Sequential, prefix: str, report: FusionReport) -> None:
    """An ``nn.Sequential``'s forward is its chain: adjacent [bngrad BatchNorm*d, nn.ReLU]
    children are fused in place (the ReLU's slot then holds a pass-through)."""
    names = list(seq._modules)
    for i, first in enumerate(names):
        bn = seq._modules[first]
        if type(bn) not in _FUSED:
            continue
        relu = seq._modules[names[i + 1]] if i + 1 < len(names) else None
        name = f"{prefix}{first}"
        if type(relu) is not nn.ReLU:
            why = ("it is the last module of its nn.Sequential" if relu is None else
                   f"followed by module {prefix}{names[i + 1]} ({type(relu).__name__}), not "
                   "a ReLU")
            report.unfused.append((name, why, False))
        elif _has_call_hooks(bn) or _has_call_hooks(relu):
            report.unfused.append((name, "it or the nn.ReLU after it has forward or backward "
                                   "hooks", True))
        else:
            assert isinstance(relu, nn.ReLU)
            seq._modules[first] = _fused_copy(bn, _FUSED[type(bn)][0])
            seq._modules[names[i + 1]] = _FusedAway(relu.inplace)
            report.fused.append((name, f"ReLU (nn.ReLU(inplace={relu.inplace}) "
                                 f"{prefix}{names[i + 1]}, in an nn.Sequential)"))


def _fuse_tree(module: nn.Module, prefix: str, report: FusionReport,
               done: Dict[int, nn.Module]) -> nn.Module:
    """``module`` with the patterns in its own forward and in its descendants' fused; a
    module met again (shared) gets what it got the first time."""
    if id(module) in done:
        return done[id(module)]
    for name, child in list(module._modules.items()):
        if child is not None:
            new = _fuse_tree(child, f"{prefix}{name}.", report, done)
            if new is not child:
                module._modules[name] = new
    result = module
    owned = _own_batch_norms(module)
    if type(module) is nn.Sequential:
        _fuse_sequential(module, prefix, report)
    elif owned and type(module) not in _CONTAINERS:
        try:
            graph = _trace(module, child=bool(prefix))
        except Exception as exc:  # any error of user code under tracing: fall back, say why
            report.untraced.append((prefix.rstrip("."), f"{type(exc).__name__}: {exc}"))
        else:
            fused = _fuse_graph(module, graph, prefix, owned, report)
            if fused:
                result = _graph_module(module, graph, fused)
    done[id(module)] = result
    return result


def fuse_model(module: nn.Module) -> nn.Module:
    """The fusion pass of ``convert(module, fuse=True)``, on a model whose batch norms are
    already bngrad's; attaches the report and warns when it needs attention."""
    report = FusionReport()
    result = _fuse_tree(module, "", report, {})
    result.__dict__["bngrad_fusion_report"] = report  # a plain attribute, not in state_dict
    if report.needs_attention:
        warnings.warn(str(report), FusionWarning, stacklevel=3)
    return result


# --- revert ----------------------------------------------------------------------------------

def _unfuse_graph(gm: fx.GraphModule) -> List[nn.Module]:
    """Put ``torch.relu`` (and the add) back after every fused module called in ``gm``'s
    graph; returns the modules so unfused."""
    graph, done = gm.graph, []
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(str(node.target))
        if type(mod) not in _UNFUSED:
            continue
        if isinstance(mod, _ADD_RELU):
            args = list(node.args) + [node.kwargs[k] for k in ("side_input",) if k in node.kwargs]
            x, side = args[0], args[1]
            node.args, node.kwargs = (x,), {}
            in_place = getattr(mod, "unfused_add", "+") == "+="
            with graph.inserting_after(node):
                add = graph.call_function(operator.iadd if in_place else operator.add,
                                          (node, side))
            with graph.inserting_after(add):
                relu = graph.call_function(torch.relu, (add,))
            keep = {add}
        else:
            with graph.inserting_after(node):
                relu = graph.call_function(torch.relu, (node,))
            keep = {relu}
        node.replace_all_uses_with(relu, delete_user_cb=lambda user, keep=keep: user not in keep)
        done.append(mod)
    if done:
        graph.lint()
        gm.recompile()
    return done


def unfuse_model(module: nn.Module) -> nn.Module:
    """The fused half of ``revert``: fused modules called in a GraphModule's graph or followed
    by the fallback's placeholder become PyTorch's batch norm + ReLU (+ add); others are left
    with a warning (their ReLU cannot be put back into arbitrary forward code)."""
    unfused: set = set()
    for gm in [m for m in module.modules() if isinstance(m, fx.GraphModule)]:
        unfused.update(id(m) for m in _unfuse_graph(gm))
    for seq in [m for m in module.modules() if isinstance(m, nn.Sequential)]:
        names = list(seq._modules)
        for first, second in zip(names, names[1:]):
            away = seq._modules[second]
            if type(seq._modules[first]) in _UNFUSED and isinstance(away, _FusedAway):
                unfused.add(id(seq._modules[first]))
                seq._modules[second] = nn.ReLU(away.inplace)
    left = []

    def swap(mod: nn.Module, path: str) -> nn.Module:
        if type(mod) in _UNFUSED:
            if id(mod) not in unfused:
                left.append(path.rstrip(".") or "<model>")
                return mod
            return _take_hooks(_share_state(_UNFUSED[type(mod)](
                mod.num_features, mod.eps, mod.momentum, mod.affine, mod.track_running_stats),
                mod), mod)
        if isinstance(mod, _FusedAway):  # its batch norm was not a fused one any more
            return nn.ReLU(mod.inplace)
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

