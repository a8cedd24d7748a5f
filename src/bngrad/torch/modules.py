"""Drop-in ``BatchNorm1d/2d/3d`` computed by bngrad, and model conversion both ways.

Each class subclasses PyTorch's module of the same name and replaces ``forward``, so the
constructor, parameters, buffers, ``state_dict`` keys (``num_batches_tracked`` included),
input-dimension checks and their messages and ``isinstance(m, torch.nn.BatchNorm2d)`` are
PyTorch's own, and a checkpoint saved from either loads into the other. The ``repr`` names
the class ``bngrad.torch.BatchNorm2d``, so that ``print(model)`` shows which layers were
converted. TorchScript (``torch.jit.script``) is refused with a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Type

import torch
import torch.fx as fx
from torch import Tensor, nn

from ..errors import ArgumentTypeError, ArgumentValueError
from ._convert import SUPPORTED_DTYPES, allowed_param_dtypes, cast_method
from .functional import batch_norm

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "convert", "revert"]


class _BngradModule:
    """What every bngrad layer adds to PyTorch's: its name in repr, and a clear TorchScript
    refusal."""

    def _get_name(self) -> str:
        # Used by repr (print(model)): tells bngrad's layers from PyTorch's at a glance.
        return f"bngrad.torch.{type(self).__name__}"

    def __prepare_scriptable__(self) -> None:
        # torch.jit.script calls this on every module before compiling it; without it the
        # error comes from deep inside TorchScript's compiler.
        revert = (", or bngrad.torch.revert(model) to script it with PyTorch's batch norm"
                  if type(self) in _TO_TORCH else "")
        raise RuntimeError(
            f"{self._get_name()}: bngrad's batch norm does not support TorchScript "
            f"(torch.jit.script); use torch.compile or torch.export{revert}")


if TYPE_CHECKING:  # the mixin only ever sits in front of PyTorch's _BatchNorm
    _BatchNormBase = nn.modules.batchnorm._BatchNorm
else:
    _BatchNormBase = object


def _traced_call(module: nn.Module, *args: Any) -> Any:
    """A call of ``module`` under torch.fx symbolic tracing, recorded as one node (PyTorch's
    own batch norms are leaves of fx's default tracer; bngrad's, outside torch.nn, would be
    traced into, and their input checks are Python control flow on tensor sizes)."""
    tracer = next(a.tracer for a in args if isinstance(a, fx.Proxy))
    assert isinstance(tracer, fx.Tracer)
    return tracer.create_proxy("call_module", tracer.path_of_module(module), args, {})


class _BngradBatchNorm(_BngradModule, _BatchNormBase):
    """The forward of ``torch.nn.modules.batchnorm._BatchNorm``, calling bngrad's batch_norm."""

    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, fx.Proxy):  # torch.fx.symbolic_trace of a model: one call
            return _traced_call(self, input)
        running_mean, running_var, bn_training, factor = self._step(input)
        try:
            return batch_norm(input, running_mean, running_var, self.weight, self.bias,
                              bn_training, factor, self.eps)
        except (ArgumentValueError, ArgumentTypeError) as exc:
            raise self._in_module_terms(exc, input) from None

    def _step(self, input: Tensor
              ) -> tuple[Optional[Tensor], Optional[Tensor], bool, float]:
        """PyTorch's _BatchNorm.forward bookkeeping: checks the input, counts the batch, and
        returns (running_mean, running_var, use batch statistics, momentum factor) for the
        functional call. momentum=None means a cumulative moving average, 1/num_batches_tracked.
        """
        self._check_input_dim(input)
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                if torch.jit.is_tracing():
                    # 1/num_batches_tracked would be frozen into the trace as a constant (a
                    # custom op takes momentum as a float): the traced model would be wrong.
                    raise RuntimeError(
                        f"{self._get_name()}(momentum=None) cannot be traced in training mode: "
                        "the cumulative average's factor changes every step and "
                        "torch.jit.trace would freeze it. Trace in eval mode (model.eval()), "
                        "set a momentum, or use torch.compile / torch.export")
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        use_buffers = not self.training or self.track_running_stats
        return (self.running_mean if use_buffers else None,
                self.running_var if use_buffers else None, bn_training,
                exponential_average_factor)

    def _in_module_terms(self, exc: Exception, input: Tensor) -> Exception:
        """``exc`` (from the functional form) said in terms of this module, where it can be:
        a wrong channel count or a parameter dtype that is not the input's."""
        name = self._get_name()
        if input.dtype not in SUPPORTED_DTYPES:  # the input itself is refused: nothing to add
            return exc
        if isinstance(exc, ArgumentValueError) and input.shape[1] != self.num_features:
            return ArgumentValueError(
                f"{name}: input has {input.shape[1]} channels (dimension 1 of shape "
                f"{tuple(input.shape)}), the module expects {self.num_features} "
                "(num_features)")
        if isinstance(exc, ArgumentTypeError):
            allowed = allowed_param_dtypes(input.dtype)
            for attr in ("weight", "bias", "running_mean", "running_var"):
                tensor = getattr(self, attr)
                if tensor is not None and tensor.dtype not in allowed:
                    or_input = (f", or the input with input.to({tensor.dtype})"
                                if tensor.dtype in SUPPORTED_DTYPES else "")
                    return ArgumentTypeError(
                        f"{name}: input has dtype {input.dtype} but the module's {attr} has "
                        f"dtype {tensor.dtype}; convert the model with "
                        f"model.{cast_method(input.dtype)}() (or .to({input.dtype})){or_input}")
        return exc


class BatchNorm1d(_BngradBatchNorm, nn.BatchNorm1d):
    """:class:`torch.nn.BatchNorm1d` computed by bngrad; same arguments, state and behaviour.

    Parameters
    ----------
    num_features : int
        C, from an input of shape (N, C) or (N, C, L).
    eps : float
        Added to the variance for numerical stability (default 1e-5).
    momentum : float or None
        Weight of each new batch in the running statistics (default 0.1); None for a
        cumulative moving average.
    affine : bool
        Learnable weight and bias (default True).
    track_running_stats : bool
        Keep running statistics and use them in eval mode (default True).
    device, dtype
        Of the parameters and buffers.
    """


class BatchNorm2d(_BngradBatchNorm, nn.BatchNorm2d):
    """:class:`torch.nn.BatchNorm2d` computed by bngrad (input (N, C, H, W)); arguments as
    :class:`BatchNorm1d`."""


class BatchNorm3d(_BngradBatchNorm, nn.BatchNorm3d):
    """:class:`torch.nn.BatchNorm3d` computed by bngrad (input (N, C, D, H, W)); arguments as
    :class:`BatchNorm1d`."""


_TO_BNGRAD: Dict[Type[nn.Module], Type[nn.Module]] = {
    nn.BatchNorm1d: BatchNorm1d, nn.BatchNorm2d: BatchNorm2d, nn.BatchNorm3d: BatchNorm3d}
_TO_TORCH: Dict[Type[nn.Module], Type[nn.Module]] = {v: k for k, v in _TO_BNGRAD.items()}


def _share_state(new: nn.Module, module: nn.Module) -> nn.Module:
    """``new`` (a fresh batch norm) given ``module``'s parameters, buffers, mode and qconfig.

    The very same Parameter and buffer objects are kept, so an optimizer built before the
    conversion still updates the model, and nothing is copied.
    """
    with torch.no_grad():
        if module.affine:
            new.weight = module.weight
            new.bias = module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
    new.train(module.training)
    if hasattr(module, "qconfig"):
        new.qconfig = module.qconfig
    return new


# Every kind of hook a module keeps (PyTorch 2.13), with the flags that say how to call them
_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
          "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
          "_backward_hooks", "_is_full_backward_hook", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
# those that run when the module is called (forward or backward)
_CALL_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _take_hooks(new: nn.Module, old: nn.Module) -> nn.Module:
    """``new`` with ``old``'s hooks of every kind: the same dictionaries, so that the handles
    a caller holds still remove them (a copy kept only forward hooks, and lost with_kwargs)."""
    for name in _HOOKS:
        if name in old.__dict__:
            setattr(new, name, old.__dict__[name])
    return new


def _has_call_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks that run when it is called (forward or backward)."""
    return any(getattr(module, name, None) for name in _CALL_HOOKS)


def _replace(module: nn.Module, new_for: Callable[[nn.Module], Optional[nn.Module]],
             done: Optional[Dict[int, nn.Module]] = None) -> nn.Module:
    """``module`` with every module ``new_for`` gives a replacement for replaced (children in
    place); a module reachable by two names is replaced once, by one new module (``done``)."""
    done = {} if done is None else done
    if id(module) in done:
        return done[id(module)]
    new = new_for(module)
    out = module if new is None else new
    done[id(module)] = out
    for name, child in list(out._modules.items()):
        if child is not None:
            out._modules[name] = _replace(child, new_for, done)
    return out


def _swap(module: nn.Module, table: Dict[Type[nn.Module], Type[nn.Module]]) -> nn.Module:
    """``module`` with every batch norm of a type in ``table`` replaced by its new type, state
    and hooks shared (:func:`_replace`)."""
    def new_for(bn: nn.Module) -> Optional[nn.Module]:
        new_type = table.get(type(bn))
        if new_type is None:
            return None
        return _take_hooks(_share_state(new_type(bn.num_features, bn.eps, bn.momentum,
                                                 bn.affine, bn.track_running_stats), bn), bn)
    return _replace(module, new_for)


def _check_module(module: object, fn: str) -> None:
    if not isinstance(module, nn.Module):
        raise ArgumentTypeError(f"bngrad.torch.{fn}: argument 'module' must be a "
                                f"torch.nn.Module, got {type(module).__name__}")


def convert(module: nn.Module, *, fuse: bool = False) -> nn.Module:
    """Replace every ``torch.nn.BatchNorm1d/2d/3d`` in ``module`` with bngrad's; with
    ``fuse=True``, also fuse BN→ReLU and BN→add→ReLU into one module each.

    Parameters
    ----------
    module : torch.nn.Module
        The model. Its children are changed in place.
    fuse : bool
        Also run each batch norm whose output goes only to a ReLU, and each whose output goes
        only to an addition whose sum goes only to a ReLU (a residual block's
        ``relu(bn2(conv2(x)) + shortcut)``), as one fused pass (:mod:`bngrad.fused`).
        Default False.

    Returns
    -------
    torch.nn.Module
        The model: ``module`` itself, except when ``module`` is a batch norm (a new module),
        or when ``fuse=True`` fused something in ``module``'s own forward (a
        :class:`torch.fx.GraphModule`, see below).

    Notes
    -----
    Parameters and buffers are kept (the same tensor objects), as are the training flag and
    forward hooks: an optimizer built before the conversion still trains the model. Only
    exact instances of PyTorch's three classes are replaced: subclasses, ``SyncBatchNorm``
    and lazy modules are left alone; a module reachable by two names is replaced once.
    Without ``fuse``, works like :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`.

    **Fusion** uses ``torch.fx`` symbolic tracing, because the pairs to fuse are mostly
    written in forward code (``torch.relu(out + identity)``, ``out += identity``,
    ``self.relu(out)``), which a pattern over modules cannot see; fx also makes "is this
    output used elsewhere" exact. ReLU as ``nn.ReLU`` (in place or not), ``torch.relu(_)``,
    ``F.relu(_)`` (``inplace=True`` too) and ``Tensor.relu(_)``; the add as ``+``, ``+=``,
    ``torch.add`` or ``Tensor.add(_)`` without ``alpha``. Each module whose own forward calls
    a batch norm has that forward traced (every submodule one call) and, where something was
    fused, becomes a :class:`torch.fx.GraphModule` whose graph calls one fused op with the
    batch norm and ReLU modules, which stay in the tree as they were (``state_dict`` keys,
    tensor objects and parameter order do not change); every other module keeps its class
    and code. The fused op runs the modules one by one instead where they changed since
    (hooks, a ``SyncBatchNorm`` in the batch norm's place) or where the side input has
    another dtype or shape (autocast, broadcasting). An ``nn.Sequential`` with adjacent
    [BatchNorm, ReLU] children becomes an ``nn.Sequential`` subclass that fuses them (same
    children, indexing and slicing). A GraphModule has no methods of the original class
    other than ``forward`` (its plain attributes are copied), and numbers its forward read
    from ``self`` are frozen (docs/torch.md).

    Not fused, each for the reason stated: a batch norm whose output (or whose sum) is used
    anywhere besides the ReLU (or the add), one called more than once or reachable by two
    paths, one with forward hooks, an in-place add that writes into the other operand
    (``identity.add_(out)``), an add of a tensor made from parameters, buffers or constants
    only (it could broadcast), an in-place op or a possibly writing module call between the
    batch norm and the ReLU, a batch norm whose output the module returns (the ReLU in the
    caller's forward), one in an ``nn.Sequential`` subclass. Where fx cannot trace a forward
    (data-dependent control flow, or control flow on ``self.training``, which fx would
    freeze), that module is kept as it is, and the batch norms it calls are not fused.
    Everything not fused is still converted to bngrad's batch norm.

    **Report:** the result carries ``bngrad_fusion_report``, a
    :class:`bngrad.torch.FusionReport` listing every batch norm fused (with what) and not
    fused (why), and every module that could not be traced. When a ReLU or an add followed a
    batch norm but was refused, or a module could not be traced, the report is also issued as
    a :class:`bngrad.torch.FusionWarning`.

    Raises
    ------
    TypeError
        ``module`` is not a ``torch.nn.Module``, or ``fuse`` not a bool.
    """
    _check_module(module, "convert")
    if not isinstance(fuse, bool):
        raise ArgumentTypeError(f"bngrad.torch.convert: argument 'fuse' must be a bool, got "
                                f"{type(fuse).__name__}")
    module = _swap(module, _TO_BNGRAD)
    if fuse:
        from ._fuse import fuse_model  # here: _fuse imports the fused modules, which import us
        module = fuse_model(module)
    return module


def revert(module: nn.Module) -> nn.Module:
    """Replace every bngrad ``BatchNorm1d/2d/3d`` in ``module`` with PyTorch's, and undo
    ``convert(..., fuse=True)``.

    The fused calls of a :class:`torch.fx.GraphModule`'s graph become the batch norm's call,
    the add and the ReLU again, and each ``nn.Sequential`` that ``convert`` made fuse its
    pairs a plain ``nn.Sequential``. The rewritten modules stay GraphModules. Fused modules
    built by hand into your own forward code are left as they are, with a
    :class:`bngrad.torch.FusionWarning`: their ReLU cannot be put back into arbitrary code.
    Parameters and buffers are kept (the same objects), as by :func:`convert`.

    Raises
    ------
    TypeError
        ``module`` is not a ``torch.nn.Module``.
    """
    _check_module(module, "revert")
    from ._fuse import unfuse_model
    return _swap(unfuse_model(module), _TO_TORCH)
