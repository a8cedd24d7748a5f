"""Batch norm fused with ReLU, and with a residual add and ReLU, for PyTorch.

- :func:`batch_norm_relu` = ``relu(F.batch_norm(...))`` and :func:`batch_norm_add_relu` =
  ``relu(F.batch_norm(...) + side_input)``, differentiable to any order;
- :class:`BatchNormReLU1d/2d/3d` and :class:`BatchNormAddReLU1d/2d/3d`: modules with a
  BatchNorm*d's arguments, parameters, buffers and ``state_dict`` keys, for a fusion pass to
  put in place of BN→ReLU and BN→add→ReLU;
- ``torch.ops.bngrad.batch_norm_relu_forward`` / ``batch_norm_relu_backward``: the custom
  operators, with fake implementations and autograd (double backward included).

What autograd keeps for the backward: the input and a mask of one bit per element
(:mod:`bngrad.fused`'s "bits" format, a uint8 tensor), never the output nor the side input;
PyTorch's unfused sequence keeps the input and the output. The backward's masked gradients
are made inside batch norm's own kernel passes, and the forward writes the output and the
mask in batch norm's normalize pass (see :mod:`bngrad.fused`).

Double backward: ReLU's second derivative is zero almost everywhere, so the derivative of the
fused backward is batch norm's double backward (:func:`bngrad.torch.ops._double_backward`)
of the masked gradient ``g = grad_out * mask``, and ``g``'s own derivative (the side input's
gradient) is the mask.
"""

from __future__ import annotations

import types
from typing import Iterator, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn

import bngrad

from .. import _gomp
from ..errors import ArgumentTypeError, ArgumentValueError
from . import _eager, functional, ops
from ._convert import (empty_like, from_numpy, is_supported_device, output_like, to_numpy,
                       to_numpy_optional, torch_terms)
from .modules import _BngradBatchNorm, _traced_call

__all__ = ["BatchNormAddReLU1d", "BatchNormAddReLU2d", "BatchNormAddReLU3d", "BatchNormReLU1d",
           "BatchNormReLU2d", "BatchNormReLU3d", "batch_norm_add_relu", "batch_norm_relu"]

_ACTIVATIONS = ("relu", "none")


def _mask_len(input: Tensor) -> int:
    return (input.numel() + 7) // 8


def unpack_mask(relu_mask: Tensor, like: Tensor) -> Tensor:
    """The bool tensor of ``like``'s shape that a "bits" mask of ``like`` encodes: element i of
    like's memory order (:func:`bngrad.fused.mask_order`: the axes by decreasing stride where
    like is dense in that order, else C order) is bit ``i % 8`` of byte ``i // 8``, least
    significant first. The result is laid out in that order (no transpose)."""
    strides = like.stride()
    order = sorted(range(like.dim()), key=lambda axis: -strides[axis])
    if not like.permute(order).is_contiguous():
        order = list(range(like.dim()))
    shifts = torch.arange(8, dtype=torch.uint8, device=relu_mask.device)
    bits = (relu_mask.unsqueeze(1) >> shifts) & 1
    in_memory = bits.reshape(-1)[:like.numel()].view([like.shape[axis] for axis in order])
    return in_memory.permute(sorted(range(like.dim()), key=order.__getitem__)).bool()


class _Masked(torch.autograd.Function):
    """``where(passes, grad_out, 0)``, the ReLU's masked gradient, as a function of the forward's
    ``sources`` too, with a zero derivative: PyTorch's ``threshold_backward(grad_out, y, 0)``
    depends so on the ReLU output ``y``, and through it on everything y was computed from. A
    derivative of the fused backward with respect to one of them is then 0, as through
    PyTorch's unfused sequence, not an error that the tensor was not used in the graph."""

    @staticmethod
    def forward(ctx, grad_out, passes, *sources):
        ctx.passes = passes
        ctx.save_for_backward(*sources)  # (kept already: the forward's input and parameters)
        return torch.where(passes, grad_out, 0)

    @staticmethod
    def backward(ctx, grad):
        # Each zero depends on its source (a where that never selects it: 0 even where the
        # source is inf or NaN), so that a derivative made of it alone can be differentiated
        # again, to 0, as PyTorch's can.
        zeros = [torch.where(torch.zeros_like(s, dtype=torch.bool), s, 0) if need else None
                 for s, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        return (torch.where(ctx.passes, grad, 0), None, *zeros)


def _masked(grad_out: Tensor, passes: Tensor, input: Tensor, weight: Optional[Tensor],
            bias: Optional[Tensor]) -> Tensor:
    """:class:`_Masked` of the forward's input and those of its parameters it was given."""
    return _Masked.apply(grad_out, passes, *(t for t in (input, weight, bias) if t is not None))


# --- torch.ops.bngrad.batch_norm_relu_forward --------------------------------------------------

@torch.library.custom_op("bngrad::batch_norm_relu_forward", mutates_args=(), device_types="cpu")
@_gomp.on_torch_team
def batch_norm_relu_forward(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                            running_mean: Optional[Tensor], running_var: Optional[Tensor],
                            side_input: Optional[Tensor], training: bool, momentum: float,
                            eps: float, activation: str
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``act(native_batch_norm(...) + side_input)`` in functional form.

    Returns (output, save_mean, save_invstd, new_running_mean, new_running_var, relu_mask):
    the first five as ``bngrad::batch_norm_forward``; relu_mask is the "bits" mask (uint8,
    ``ceil(numel / 8)``), empty for ``activation="none"``.
    """
    new_mean = running_mean.clone() if training and running_mean is not None else None
    new_var = running_var.clone() if training and running_var is not None else None
    output = output_like(input)
    try:
        _, save_mean, save_invstd, mask = bngrad.batch_norm_relu_forward(
            to_numpy(input, "input"), to_numpy_optional(weight, "weight"),
            to_numpy_optional(bias, "bias"),
            to_numpy_optional(new_mean if training else running_mean, "running_mean"),
            to_numpy_optional(new_var if training else running_var, "running_var"),
            train=training, momentum=momentum, eps=eps,
            side_input=to_numpy_optional(side_input, "side_input"), activation=activation,
            mask_format="bits", num_threads=torch.get_num_threads(), out=to_numpy(output))
    except (ArgumentValueError, ArgumentTypeError) as exc:
        raise torch_terms(exc, input, {"weight": weight, "bias": bias,
                                       "running_mean": running_mean,
                                       "running_var": running_var}) from None
    stat = ops._stat_dtype(input)
    dev = input.device
    relu_mask = (torch.from_numpy(mask) if mask is not None
                 else torch.empty(0, dtype=torch.uint8, device=dev))
    return (output, ops._vector(save_mean, stat, dev), ops._vector(save_invstd, stat, dev),
            new_mean if new_mean is not None else ops._empty(stat, dev),
            new_var if new_var is not None else ops._empty(stat, dev), relu_mask)


@batch_norm_relu_forward.register_fake
def _(input, weight, bias, running_mean, running_var, side_input, training, momentum, eps,
      activation):
    n = input.shape[1] if training else 0
    stat = ops._stat_dtype(input)

    def new_stat(r):
        return torch.empty_like(r) if training and r is not None else input.new_empty((0,),
                                                                                      dtype=stat)

    n_mask = _mask_len(input) if activation == "relu" else 0
    return (output_like(input), input.new_empty((n,), dtype=stat),
            input.new_empty((n,), dtype=stat), new_stat(running_mean), new_stat(running_var),
            input.new_empty((n_mask,), dtype=torch.uint8))


def _forward_setup_context(ctx, inputs, output):
    (input, weight, bias, running_mean, running_var, side_input, training, momentum, eps,
     activation) = inputs
    _, save_mean, save_invstd, new_mean, new_var, relu_mask = output
    ctx.mark_non_differentiable(new_mean, new_var, relu_mask)
    ctx.training, ctx.eps, ctx.activation = training, eps, activation
    ctx.has = (weight is not None, bias is not None, side_input is not None)
    stats = (running_mean, running_var) if not training else (None, None)
    ctx.save_for_backward(input, weight, bias, *stats, save_mean, save_invstd, relu_mask)
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, grad_out, grad_save_mean, grad_save_invstd, *_):
    input, weight, bias, running_mean, running_var, save_mean, save_invstd, relu_mask = \
        ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[1] and ctx.has[0], need[2] and ctx.has[1], need[5] and ctx.has[2]]
    grads: list[Optional[Tensor]] = [None] * 4
    if grad_out is not None and torch.is_grad_enabled() and ctx.activation == "relu":
        grad_out = _masked(grad_out, unpack_mask(relu_mask, input), input, weight, bias)
    if grad_out is not None and any(mask):
        outs = torch.ops.bngrad.batch_norm_relu_backward(
            grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
            relu_mask, ctx.training, ctx.eps, mask, ctx.activation)
        grads = [o if m else None for o, m in zip(outs, mask)]
    grad_input = grads[0]
    if ctx.training and need[0]:
        grad_input = ops.add_statistics_grad(grad_input, input, save_mean, save_invstd,
                                             grad_save_mean, grad_save_invstd)
    return grad_input, grads[1], grads[2], None, None, grads[3], None, None, None, None


batch_norm_relu_forward.register_autograd(_forward_backward,
                                          setup_context=_forward_setup_context)


# --- torch.ops.bngrad.batch_norm_relu_backward -------------------------------------------------

@torch.library.custom_op("bngrad::batch_norm_relu_backward", mutates_args=(),
                         device_types="cpu")
@_gomp.on_torch_team
def batch_norm_relu_backward(grad_out: Tensor, input: Tensor, weight: Optional[Tensor],
                             running_mean: Optional[Tensor], running_var: Optional[Tensor],
                             save_mean: Optional[Tensor], save_invstd: Optional[Tensor],
                             relu_mask: Tensor, train: bool, eps: float,
                             output_mask: list[bool], activation: str
                             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_input, grad_weight, grad_bias, grad_side_input) of the fused forward, given its
    "bits" relu_mask (ignored for ``activation="none"``); outputs masked off are (0,)."""
    _check_bits(relu_mask, activation)
    if grad_out.dtype != input.dtype:
        grad_out = grad_out.to(input.dtype)
    grad_input = (empty_like(input) if output_mask[0]
                  else ops._empty(input.dtype, input.device))
    _, grad_weight, grad_bias, g = bngrad.batch_norm_relu_backward(
        to_numpy(grad_out, "grad_out"), to_numpy(input, "input"),
        to_numpy_optional(weight, "weight"), to_numpy_optional(running_mean, "running_mean"),
        to_numpy_optional(running_var, "running_var"),
        ops._stat_or_none(save_mean, "save_mean"), ops._stat_or_none(save_invstd, "save_invstd"),
        train=train, eps=eps, output_mask=tuple(output_mask),
        relu_mask=relu_mask.numpy() if activation == "relu" else None, activation=activation,
        num_threads=torch.get_num_threads(),
        out=to_numpy(grad_input) if output_mask[0] else None)
    param = ops._param_dtype(input, weight, (running_mean, running_var, save_mean, save_invstd))
    grad_side = ops._empty(input.dtype, input.device)
    if output_mask[3]:  # in the strides the fake implementation promises
        assert g is not None
        grad_side = empty_like(input)
        grad_side.copy_(from_numpy(g))
    return (grad_input, ops._vector(grad_weight, param, input.device),
            ops._vector(grad_bias, param, input.device), grad_side)


def _check_bits(relu_mask: Tensor, activation: str) -> None:
    # (the NumPy API would take a bool mask too, but this op's double backward reads bits)
    if activation == "relu" and relu_mask.dtype != torch.uint8:
        raise ArgumentTypeError(f"relu_mask: expected the forward's \"bits\" mask "
                                f"(torch.uint8), got dtype {relu_mask.dtype}")


@batch_norm_relu_backward.register_fake
def _(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, relu_mask,
      train, eps, output_mask, activation):
    _check_bits(relu_mask, activation)
    c = input.shape[1]
    param = ops._param_dtype(input, weight, (running_mean, running_var, save_mean, save_invstd))
    return (torch.empty_like(input) if output_mask[0] else input.new_empty((0,)),
            input.new_empty((c if output_mask[1] else 0,), dtype=param),
            input.new_empty((c if output_mask[2] else 0,), dtype=param),
            torch.empty_like(input) if output_mask[3] else input.new_empty((0,)))


def _backward_setup_context(ctx, inputs, output):
    (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, relu_mask,
     train, eps, output_mask, activation) = inputs
    ctx.train, ctx.eps, ctx.activation = train, eps, activation
    ctx.save_for_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                          save_invstd, relu_mask)
    ctx.set_materialize_grads(False)


def _fused_double_backward(ctx, gg_input, gg_weight, gg_bias, gg_side):
    """Batch norm's double backward of g = grad_out * mask; d(grad_side_input)/d(grad_out) is
    the mask. The mask is piecewise constant in the forward's arguments: no other term."""
    (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
     relu_mask) = ctx.saved_tensors
    need_dy, need_x, need_w = ctx.needs_input_grad[:3]
    passes = unpack_mask(relu_mask, input) if ctx.activation == "relu" else None
    g = grad_out if passes is None else torch.where(passes, grad_out, 0)
    inner = types.SimpleNamespace(
        saved_tensors=(g, input, weight, running_mean, running_var, save_mean, save_invstd),
        needs_input_grad=(need_dy, need_x, need_w) + (False,) * 7,
        train=ctx.train, eps=ctx.eps)
    d_g, d_x, d_w = ops._double_backward(inner, gg_input, gg_weight, gg_bias)[:3]
    if gg_side is not None and gg_side.numel() and need_dy:
        side = gg_side.to(grad_out.dtype)
        d_g = side if d_g is None else d_g + side
    if d_g is not None and passes is not None:
        d_g = torch.where(passes, d_g, 0)
    return (d_g, d_x, d_w) + (None,) * 9


batch_norm_relu_backward.register_autograd(_fused_double_backward,
                                           setup_context=_backward_setup_context)


# --- the eager path: an autograd.Function on the NumPy API (as bngrad.torch._eager) ------------

class _BatchNormReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, side_input, running_mean, running_var, training,
                momentum, eps, activation):
        output, save_mean, save_invstd, mask = _forward(
            input, weight, bias, side_input, running_mean, running_var, training, momentum,
            eps, activation)
        ctx.training, ctx.eps, ctx.activation = training, eps, activation
        ctx.has_side = side_input is not None
        stats = (None, None) if training else (running_mean, running_var)
        ctx.save_for_backward(input, weight, bias, *stats)
        # NumPy arrays, not tensors: the statistics and the 1-bit mask (not output, not side)
        ctx.save_mean, ctx.save_invstd, ctx.relu_mask = save_mean, save_invstd, mask
        return output

    @staticmethod
    @_gomp.on_torch_team
    def backward(ctx, grad_out):
        input, weight, bias, running_mean, running_var = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = (need[0], need[1] and weight is not None, need[2] and bias is not None,
                need[3] and ctx.has_side)
        if _eager.differentiable(grad_out):
            return _differentiable_backward(ctx, ctx.saved_tensors, grad_out, mask) + (None,) * 6
        if grad_out.dtype != input.dtype:
            grad_out = grad_out.to(input.dtype)
        grad_input = empty_like(input) if mask[0] else None
        _, grad_weight, grad_bias, g = bngrad.batch_norm_relu_backward(
            to_numpy(grad_out, "grad_out"), to_numpy(input, "input"),
            to_numpy_optional(weight, "weight"), to_numpy_optional(running_mean, "running_mean"),
            to_numpy_optional(running_var, "running_var"), ctx.save_mean, ctx.save_invstd,
            train=ctx.training, eps=ctx.eps, output_mask=mask, relu_mask=ctx.relu_mask,
            activation=ctx.activation, num_threads=torch.get_num_threads(),
            out=None if grad_input is None else to_numpy(grad_input))
        return (grad_input, _eager._as(grad_weight, weight), _eager._as(grad_bias, bias),
                None if g is None else from_numpy(g)) + (None,) * 6


@_gomp.on_torch_team
def _forward(input, weight, bias, side_input, running_mean, running_var, training, momentum,
             eps, activation):
    output = output_like(input)
    try:
        _, save_mean, save_invstd, mask = bngrad.batch_norm_relu_forward(
            to_numpy(input, "input"), to_numpy_optional(weight, "weight"),
            to_numpy_optional(bias, "bias"), to_numpy_optional(running_mean, "running_mean"),
            to_numpy_optional(running_var, "running_var"), train=training, momentum=momentum,
            eps=eps, side_input=to_numpy_optional(side_input, "side_input"),
            activation=activation, mask_format="bits", num_threads=torch.get_num_threads(),
            out=to_numpy(output))
    except (ArgumentValueError, ArgumentTypeError) as exc:
        raise torch_terms(exc, input, {"weight": weight, "bias": bias,
                                       "running_mean": running_mean,
                                       "running_var": running_var}) from None
    return output, save_mean, save_invstd, mask


def _differentiable_backward(ctx, saved, grad_out, mask):
    """The backward as a graph that can be differentiated again (or, for a batched grad_out,
    of torch operations: _eager.differentiable): batch norm's forward is recomputed with the
    custom op (running statistics left alone) and differentiated by autograd at the masked
    gradient g, which is also the side input's gradient. (g depends on the forward's input,
    weight and bias with a zero derivative (_Masked); not on its side input, which is not kept
    for the backward.)"""
    input, weight, bias, running_mean, running_var = saved
    g = grad_out
    if ctx.relu_mask is not None:
        passes = unpack_mask(torch.from_numpy(ctx.relu_mask), input)
        g = _masked(grad_out, passes, input, weight, bias)
    wanted = [t for t, m in zip((input, weight, bias), mask) if m]
    grads: Iterator[Optional[Tensor]] = iter([])
    if wanted:
        grads = iter(_eager.recomputed_grads(ctx, input, weight, bias, running_mean,
                                             running_var, wanted, g))
    return tuple(next(grads) if m else None for m in mask[:3]) + (g if mask[3] else None,)


# --- functional forms ---------------------------------------------------------------------------

def _fused(input, side_input, running_mean, running_var, weight, bias, training, momentum, eps,
           activation):
    if not isinstance(input, Tensor):
        raise TypeError(f"argument 'input' must be Tensor, not {type(input).__name__}")
    if side_input is not None and not isinstance(side_input, Tensor):
        raise TypeError(f"argument 'side_input' must be Tensor, not "
                        f"{type(side_input).__name__}")
    momentum, eps = functional.checked_arguments(input, running_mean, running_var, training,
                                                 momentum, eps)
    # PyTorch's own sequence on other devices, and where forward-mode AD or torch.func must
    # differentiate it (functional.needs_pytorch_autodiff), after the checks of the operands
    # that bngrad's kernels would make
    supported = is_supported_device(input)
    if not supported or functional.needs_pytorch_autodiff(input, weight, bias, side_input,
                                                          running_mean, running_var):
        if not supported and input.device.type != "meta":
            functional._fallback_warning(input.device)
        if side_input is not None:
            _check_side_input(input, side_input)
        if supported:
            functional.refuse_negative_variance(running_var)
        y = F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        y = y if side_input is None else y + side_input
        return F.relu(y) if activation == "relu" else y
    if _eager.applies(input) and (side_input is None or _eager.applies(side_input)):
        args = (input, weight, bias, side_input, running_mean, running_var, bool(training),
                momentum, eps, activation)
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (input, weight, bias, side_input)):
            return _BatchNormReLU.apply(*args)
        return _forward(*args)[0]
    output, _, _, new_mean, new_var, _ = torch.ops.bngrad.batch_norm_relu_forward(
        input, weight, bias, running_mean, running_var, side_input, bool(training),
        momentum, eps, activation)
    if training:
        if running_mean is not None:
            running_mean.copy_(new_mean)
        if running_var is not None:
            running_var.copy_(new_var)
    return output


def _check_side_input(input: Tensor, side_input: Tensor) -> None:
    """side_input's shape and dtype are input's (as bngrad.fused checks them), where PyTorch's
    sequence would broadcast or promote it."""
    if side_input.shape != input.shape:
        raise ArgumentValueError(f"side_input: expected the shape of input "
                                 f"{tuple(input.shape)}, got shape {tuple(side_input.shape)}")
    if side_input.dtype != input.dtype:
        raise ArgumentTypeError(f"side_input: expected the dtype of input "
                                f"({str(input.dtype).removeprefix('torch.')}), got dtype "
                                f"{str(side_input.dtype).removeprefix('torch.')}")


def batch_norm_relu(input: Tensor, running_mean: Optional[Tensor],
                    running_var: Optional[Tensor], weight: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, training: bool = False,
                    momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``relu(F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum,
    eps))``, with :func:`bngrad.torch.batch_norm`'s arguments, checks and devices.

    Differentiable to any order; autograd keeps the input and a 1-bit-per-element mask, not
    the output. Its backward is fused into batch norm's passes (see :mod:`bngrad.fused`).
    """
    return _fused(input, None, running_mean, running_var, weight, bias, training, momentum, eps,
                  "relu")


def batch_norm_add_relu(input: Tensor, side_input: Tensor, running_mean: Optional[Tensor],
                        running_var: Optional[Tensor], weight: Optional[Tensor] = None,
                        bias: Optional[Tensor] = None, training: bool = False,
                        momentum: float = 0.1, eps: float = 1e-5) -> Tensor:
    """``relu(F.batch_norm(input, ...) + side_input)``: the end of a residual block.

    ``side_input`` has input's shape and dtype, any memory format. Otherwise as
    :func:`batch_norm_relu`; autograd keeps neither the output nor the side input.
    """
    if not isinstance(side_input, Tensor):
        raise TypeError(f"batch_norm_add_relu(): argument 'side_input' must be Tensor, not "
                        f"{type(side_input).__name__}")
    return _fused(input, side_input, running_mean, running_var, weight, bias, training,
                  momentum, eps, "relu")


# --- modules ------------------------------------------------------------------------------------

class _FusedBatchNorm(_BngradBatchNorm):
    """A batch norm module's bookkeeping (as ``torch.nn.modules.batchnorm._BatchNorm.forward``
    and :class:`bngrad.torch.BatchNorm2d`) around the fused functional form."""

    def _fused_forward(self, input: Tensor, side_input: Optional[Tensor]) -> Tensor:
        running_mean, running_var, bn_training, factor = self._step(input)
        try:
            return _fused(input, side_input, running_mean, running_var, self.weight, self.bias,
                          bn_training, factor, self.eps, "relu")
        except (ArgumentValueError, ArgumentTypeError) as exc:
            raise self._in_module_terms(exc, input) from None


class _ReLU(_FusedBatchNorm):
    def forward(self, input: Tensor) -> Tensor:
        if isinstance(input, fx.Proxy):  # torch.fx.symbolic_trace of a model: one call
            return _traced_call(self, input)
        return self._fused_forward(input, None)


class _AddReLU(_FusedBatchNorm):
    def forward(self, input: Tensor, side_input: Tensor) -> Tensor:  # type: ignore[override]
        if not isinstance(side_input, Tensor):  # (None too: that is BatchNormReLU's work)
            raise TypeError(f"{type(self).__name__}.forward(): argument 'side_input' must be "
                            f"Tensor, not {type(side_input).__name__}")
        if isinstance(input, fx.Proxy) or isinstance(side_input, fx.Proxy):
            return _traced_call(self, input, side_input)
        return self._fused_forward(input, side_input)


_Base = nn.modules.batchnorm._BatchNorm


class BatchNormReLU1d(_ReLU, _Base):
    """``relu(BatchNorm1d(x))`` in one module: a BatchNorm1d's arguments, parameters, buffers
    and state_dict keys (not a subclass of nn.BatchNorm1d: it is not one)."""
    _check_input_dim = nn.BatchNorm1d._check_input_dim


class BatchNormReLU2d(_ReLU, _Base):
    """``relu(BatchNorm2d(x))`` in one module (see :class:`BatchNormReLU1d`)."""
    _check_input_dim = nn.BatchNorm2d._check_input_dim


class BatchNormReLU3d(_ReLU, _Base):
    """``relu(BatchNorm3d(x))`` in one module (see :class:`BatchNormReLU1d`)."""
    _check_input_dim = nn.BatchNorm3d._check_input_dim


class BatchNormAddReLU1d(_AddReLU, _Base):
    """``relu(BatchNorm1d(x) + side_input)``: ``forward(input, side_input)``; state as
    :class:`BatchNormReLU1d`."""
    _check_input_dim = nn.BatchNorm1d._check_input_dim


class BatchNormAddReLU2d(_AddReLU, _Base):
    """``relu(BatchNorm2d(x) + side_input)`` (see :class:`BatchNormAddReLU1d`)."""
    _check_input_dim = nn.BatchNorm2d._check_input_dim


class BatchNormAddReLU3d(_AddReLU, _Base):
    """``relu(BatchNorm3d(x) + side_input)`` (see :class:`BatchNormAddReLU1d`)."""
    _check_input_dim = nn.BatchNorm3d._check_input_dim
