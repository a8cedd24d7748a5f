"""``bngrad.torch.batch_norm``: ``torch.nn.functional.batch_norm`` computed by bngrad."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import forward_ad

from .. import _validate
from . import _eager
from . import ops  # noqa: F401  (registers torch.ops.bngrad.*)
from ._convert import is_supported_device

__all__ = ["batch_norm"]

_warned_fallback = False


def _fallback_warning(device: torch.device) -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        warnings.warn(
            f"bngrad computes on CPU tensors only; batch norm on a {device.type} tensor runs on "
            "PyTorch's own implementation instead (this warning is shown once)",
            RuntimeWarning, stacklevel=3)


def batch_norm(input: Tensor, running_mean: Optional[Tensor], running_var: Optional[Tensor],
               weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """Batch normalization, as :func:`torch.nn.functional.batch_norm`, on bngrad's kernels.

    Same signature and results as PyTorch's; differentiable to any order (gradients come from
    :func:`bngrad.batch_norm_backward`). Runs on CPU tensors of float64, float32, float16 and
    bfloat16 without copying them to or from NumPy; float16/bfloat16 inputs may have float32
    weight, bias and running statistics (mixed precision). The output's memory format is
    PyTorch's (channels_last stays channels_last; another permuted layout gives a contiguous
    output), grad_input keeps the input's layout.

    Parameters
    ----------
    input : Tensor (N, C, ...)
    running_mean, running_var : Tensor (C,) or None
        Updated in place when ``training`` (with the unbiased batch variance); required when
        not ``training``.
    weight, bias : Tensor (C,), optional
        Affine scale and shift.
    training : bool
        Normalise with the batch statistics (and update the running ones) or with the running
        statistics.
    momentum : float
        Weight of the new batch statistics in the running average.
    eps : float
        Added to the variance for numerical stability.

    Returns
    -------
    Tensor
        Same shape and dtype as ``input``; memory format as PyTorch's (above).

    Raises
    ------
    ValueError
        As :func:`torch.nn.functional.batch_norm`: one value per channel in training, or
        ``eps <= 0`` in training (``eps < 0`` in eval). :class:`bngrad.ArgumentValueError` (a
        ``ValueError``) or :class:`bngrad.ArgumentTypeError` (a ``TypeError``) for a
        per-channel tensor of the wrong length or dtype, and any other unusable argument.

    Notes
    -----
    Tensors on any other device than the CPU (CUDA, MPS, ...) are passed to
    :func:`torch.nn.functional.batch_norm` instead, with a one-time ``RuntimeWarning``; so
    are calls that forward-mode AD or ``torch.func``'s differentiating transforms (``grad``,
    ``jacrev``, ``jvp``, ...) differentiate, which bngrad's kernels cannot serve
    (:func:`needs_pytorch_autodiff`): the same results as PyTorch's, at PyTorch's speed.
    The kernels use at most ``torch.get_num_threads()`` threads.
    """
    if not isinstance(input, Tensor):
        raise TypeError(f"batch_norm(): argument 'input' must be Tensor, not "
                        f"{type(input).__name__}")
    momentum, eps = checked_arguments(input, running_mean, running_var, training, momentum, eps)
    if not is_supported_device(input):
        if input.device.type != "meta":  # meta tensors carry no data: nothing to warn about
            _fallback_warning(input.device)
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                            eps)
    if input.dim() == 1 and input.numel() == 0:
        # Nothing to normalise, and no channel axis to check against: PyTorch returns an empty
        # result (still connected to weight and bias), so let PyTorch give it.
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                            eps)
    if needs_pytorch_autodiff(input, weight, bias, running_mean, running_var):
        refuse_negative_variance(running_var)  # (bngrad's check, which PyTorch does not make)
        return F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
                            eps)
    if _eager.applies(input):  # eager mode: straight to the NumPy API (see bngrad.torch._eager)
        return _eager.batch_norm(input, running_mean, running_var, weight, bias, bool(training),
                                 momentum, eps)
    # traced (torch.compile, torch.export, jit.trace, functorch.vmap): the custom op
    output, _, _, new_mean, new_var = torch.ops.bngrad.batch_norm_forward(
        input, weight, bias, running_mean, running_var, bool(training), momentum, eps)
    if training:  # the running statistics are state, not part of the autograd graph
        if running_mean is not None:
            running_mean.copy_(new_mean)
        if running_var is not None:
            running_var.copy_(new_var)
    return output


def needs_pytorch_autodiff(*tensors: Optional[Tensor]) -> bool:
    """Whether a call must run on PyTorch's own operations, which forward-mode AD and
    torch.func's differentiating transforms can differentiate: an input carries a forward-mode
    tangent (``torch.autograd.forward_ad``), or the call runs under ``torch.func.grad``,
    ``vjp``, ``jacrev``, ``jacfwd``, ``jvp``, ``hessian`` (alone or inside ``vmap``) or
    ``functionalize``. bngrad has no forward derivative, PyTorch's custom operators would
    drop a tangent without a word (or fail on one given to the running statistics), cannot be
    differentiated under those transforms, and their in-place update of the running statistics
    cannot be functionalized. ``vmap`` alone runs bngrad's layers as they are."""
    return _has_tangent(tensors) or _under_a_pytorch_only_transform()


def _has_tangent(tensors: tuple[Optional[Tensor], ...]) -> bool:
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level open: no tangents (cheap)
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


_functorch = getattr(torch._C, "_functorch", None)
_PYTORCH_ONLY_TRANSFORMS = tuple(getattr(getattr(_functorch, "TransformType", None), name)
                         for name in ("Grad", "Jvp", "Functionalize")
                         if hasattr(getattr(_functorch, "TransformType", None), name))


def _under_a_pytorch_only_transform() -> bool:
    if _functorch is None or not _eager._functorch_active():
        return False
    stack = _functorch.get_interpreter_stack() or ()
    return any(level.key() in _PYTORCH_ONLY_TRANSFORMS for level in stack)


def checked_arguments(input: Tensor, running_mean: Optional[Tensor],
                      running_var: Optional[Tensor], training: bool, momentum: object,
                      eps: object) -> tuple[float, float]:
    """PyTorch's checks of batch norm's arguments, with its messages, then bngrad's of
    momentum and eps (numbers, finite; a one-element tensor momentum and a 0-d tensor eps are
    taken as PyTorch takes them): (momentum, eps) as floats."""
    if training:
        _verify_batch_size(input)
    if isinstance(momentum, Tensor) and momentum.numel() == 1:
        momentum = momentum.item()
    if isinstance(eps, Tensor) and eps.dim() == 0:
        eps = eps.item()
    _verify_eps(eps, training)
    _verify_running_stats(running_mean, running_var, training)
    _verify_momentum(momentum)
    return _validate.momentum(momentum), _validate.eps(eps)


def refuse_negative_variance(running_var: Optional[Tensor]) -> None:
    """bngrad's check that a running_var has no negative entry (bngrad._validate.running_var),
    for a call that runs on PyTorch's batch norm: of the values under torch.func's wrappers
    (under vmap, every sample's) and a tangent's primal; not while compiling (a value check
    would break the graph)."""
    if running_var is None or torch.compiler.is_compiling():
        return
    values = running_var
    while _functorch is not None and _functorch.is_functorch_wrapped_tensor(values):
        values = _functorch.get_unwrapped(values)
    values = forward_ad.unpack_dual(values).primal.detach().flatten()
    negative = torch.nonzero(values < 0)
    if negative.numel():
        k = int(negative[0, 0])
        channels = running_var.shape[-1] if running_var.dim() else 1
        raise _validate.negative_variance(float(values[k]), k % channels)


def _verify_batch_size(input: Tensor) -> None:
    # Same check and message as torch.nn.functional.batch_norm.
    if torch.jit.is_tracing():
        # torch.jit.trace records sizes as tensors, and comparing them prints a TracerWarning;
        # but the check is meant to run once, at trace time, like PyTorch's own (whose
        # warnings PyTorch silences for torch.nn).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            bad = bool(_values_per_channel(input.shape) == 1)
    else:
        bad = _values_per_channel(input.shape) == 1
    if bad:
        raise ValueError(
            f"Expected more than 1 value per channel when training, got input size {input.shape}")


def _values_per_channel(size: torch.Size) -> int:
    return size[0] * math.prod(size[2:]) if len(size) >= 2 else 0


def _verify_running_stats(running_mean: Optional[Tensor], running_var: Optional[Tensor],
                          training: bool) -> None:
    # Same checks and messages as PyTorch's batch norm (in eval mode both are required, which
    # bngrad's own check says naming them).
    if training and (running_mean is None) != (running_var is None):
        raise ValueError("running_mean and running_var must either both be None or neither be "
                         "None")
    if torch.is_grad_enabled():
        for name, stat in (("running_mean", running_mean), ("running_var", running_var)):
            if stat is not None and stat.requires_grad:
                raise RuntimeError(f"The function 'native_batch_norm' is not differentiable with "
                                   f"respect to argument '{name}'. This input cannot have "
                                   "requires_grad True.")


def _verify_momentum(momentum: object) -> None:
    # As PyTorch: a number (momentum=None, the modules' cumulative average, is theirs to turn
    # into a factor); values that are numbers but unusable are refused by bngrad's own check.
    if type(momentum) is not float and not isinstance(momentum, numbers.Real):
        raise TypeError(f"batch_norm(): argument 'momentum' (position 7) must be float, not "
                        f"{type(momentum).__name__}")


def _verify_eps(eps: object, training: bool) -> None:
    # Same checks and messages as torch.nn.functional.batch_norm (eps = 0 in training divides
    # a constant channel by zero). Values that are not numbers, NaN and inf are refused by
    # bngrad's own check, which names them.
    if type(eps) is not float and not isinstance(eps, numbers.Real):  # (float: no ABC check)
        return
    if training and eps <= 0.0:
        raise ValueError(f"batch_norm eps must be positive during training, but got {eps}")
    if eps < 0.0:
        raise ValueError(f"batch_norm eps must be non-negative, but got {eps}")
