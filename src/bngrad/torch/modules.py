"""Drop-in ``BatchNorm1d/2d/3d`` computed by bngrad, and model conversion both ways.

Each class subclasses PyTorch's module of the same name and replaces ``forward``, so the
constructor, parameters, buffers, ``state_dict`` keys (``num_batches_tracked`` included),
input-dimension checks and their messages and ``isinstance(m, torch.nn.BatchNorm2d)`` are
PyTorch's own, and a checkpoint saved from either loads into the other. The ``repr`` names
the class ``bngrad.torch.BatchNorm2d``, so that ``print(model)`` shows which layers were
converted. TorchScript (``torch.jit.script``) is refused with a clear error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Optional, Type

import torch
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


class _BngradBatchNorm(_BngradModule, _BatchNormBase):
    """The forward of ``torch.nn.modules.batchnorm._BatchNorm``, calling bngrad's batch_norm."""

    def forward(self, input: Tensor) -> Tensor:
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
                    return ArgumentTypeError(
                        f"{name}: input has dtype {input.dtype} but the module's {attr} has "
                        f"dtype {tensor.dtype}; convert the model with "
                        f"model.{cast_method(input.dtype)}() (or .to({input.dtype})), "
                        f"or the input with input.to({tensor.dtype})")
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


def _swap(module: nn.Module, table: Dict[Type[nn.Module], Type[nn.Module]]) -> nn.Module:
    new_type = table.get(type(module))
    if new_type is not None:
        new = _share_state(new_type(module.num_features, module.eps, module.momentum,
                                    module.affine, module.track_running_stats), module)
        for hook_dict in ("_forward_pre_hooks", "_forward_hooks"):
            getattr(new, hook_dict).update(getattr(module, hook_dict))
        module = new
    for name, child in module.named_children():
        module.add_module(name, _swap(child, table))
    return module


def convert(module: nn.Module) -> nn.Module:
    """Replace every ``torch.nn.BatchNorm1d/2d/3d`` in ``module`` with bngrad's.

    Parameters and buffers are kept (the same tensor objects), as are the training flag and
    forward hooks. Only exact instances of PyTorch's three classes are replaced: subclasses,
    ``SyncBatchNorm`` and lazy modules are left alone. Works in place on the children and
    returns the model (a new object only when ``module`` itself is a batch norm), like
    :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`.
    """
    return _swap(module, _TO_BNGRAD)


def revert(module: nn.Module) -> nn.Module:
    """Replace every bngrad ``BatchNorm1d/2d/3d`` in ``module`` with PyTorch's (see
    :func:`convert`)."""
    return _swap(module, _TO_TORCH)
