"""bngrad's batch norm as PyTorch custom operators (``torch.ops.bngrad.*``).

Registered with :mod:`torch.library`, each with a fake (meta) implementation so that
``torch.compile`` and ``torch.export`` can trace models that use them:

==========================================  =================================================
``bngrad::batch_norm_forward``              output, save_mean, save_invstd and the new
                                            running statistics (functional form)
``bngrad::batch_norm_backward``             grad_input, grad_weight, grad_bias
``bngrad::batch_norm_backward_reduce``      sum_dy, sum_dy_xmu, grad_weight, grad_bias
``bngrad::batch_norm_backward_elemt``       grad_input from (all-reduced) sums
``bngrad::batch_norm_moments``              per-channel mean and biased variance (float64)
==========================================  =================================================

Arguments and results are those of :mod:`bngrad`'s NumPy API (channel axis 1, as in PyTorch).
Outputs that were not asked for (``output_mask`` / ``*_g`` False) come back as empty (0,)
tensors, since a custom op cannot return None.

Autograd: ``batch_norm_forward`` differentiates through ``batch_norm_backward``, whose own
derivative (the double backward, written out in :func:`_double_backward`) is composed of
ordinary differentiable torch operations. The saved statistics are differentiable outputs of
the forward op (:func:`_forward_backward` gives their derivative), so third and higher
derivatives come out right too: PyTorch's own batch norm treats them as constants there and
silently returns wrong third-order results.

The real implementations run on CPU tensors only (see :mod:`bngrad.torch.functional` for the
fallback on other devices), on at most ``torch.get_num_threads()`` threads.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

import bngrad

from .. import _gomp
from ..errors import ArgumentTypeError, ArgumentValueError
from ._convert import (HALF, empty_like, from_numpy, output_like, stat_dtype, to_numpy,
                       to_numpy_optional, torch_terms)

__all__ = [
    "batch_norm_backward",
    "batch_norm_backward_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_forward",
    "batch_norm_moments",
]


# --- dtype and layout rules shared by the real and the fake implementations ------------------

def _stat_dtype(input: Tensor) -> torch.dtype:
    """dtype of save_mean / save_invstd: float32 for half inputs, else the input's."""
    return stat_dtype(input.dtype)


def _param_dtype(input: Tensor, weight: Optional[Tensor], stats: Sequence[Optional[Tensor]]
                 ) -> torch.dtype:
    """dtype of grad_weight / grad_bias, the rule of ``bngrad.batch_norm_backward``."""
    if weight is not None:
        return weight.dtype
    if input.dtype in HALF and any(s is not None and s.numel() and s.dtype not in HALF
                                   for s in stats):
        return stat_dtype(input.dtype)
    return input.dtype


def _empty(dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _vector(array, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A (C,) result from the NumPy API as a tensor of the promised dtype ((0,) if None)."""
    if array is None:
        return _empty(dtype, device)
    tensor = from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


# --- batch_norm_forward -----------------------------------------------------------------------

@torch.library.custom_op("bngrad::batch_norm_forward", mutates_args=(), device_types="cpu")
@_gomp.on_torch_team
def batch_norm_forward(input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                       running_mean: Optional[Tensor], running_var: Optional[Tensor],
                       training: bool, momentum: float, eps: float
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``native_batch_norm`` on bngrad, in functional form (no argument is modified).

    Returns (output, save_mean, save_invstd, new_running_mean, new_running_var), like
    ``aten._native_batch_norm_legit_functional``: the caller copies the new running
    statistics into its buffers (a custom op with a backward formula may not mutate its
    arguments). In eval mode, and for running statistics not given, the last two are empty;
    in eval mode save_mean and save_invstd are empty too, as in PyTorch.
    """
    new_mean = running_mean.clone() if training and running_mean is not None else None
    new_var = running_var.clone() if training and running_var is not None else None
    # output is allocated by torch (the strides the fake implementation promises; compiled
    # graphs rely on them) and written in place by bngrad, as grad_input is in the backward.
    output = output_like(input)
    try:
        _, save_mean, save_invstd = bngrad.batch_norm_forward(
            to_numpy(input, "input"), to_numpy_optional(weight, "weight"),
            to_numpy_optional(bias, "bias"),
            to_numpy_optional(new_mean if training else running_mean, "running_mean"),
            to_numpy_optional(new_var if training else running_var, "running_var"),
            train=training, momentum=momentum, eps=eps, num_threads=torch.get_num_threads(),
            out=to_numpy(output))  # updates new_mean, new_var in place
    except (ArgumentValueError, ArgumentTypeError) as exc:
        raise torch_terms(exc, input, {"weight": weight, "bias": bias,
                                       "running_mean": running_mean,
                                       "running_var": running_var}) from None
    stat = _stat_dtype(input)
    dev = input.device
    return (output, _vector(save_mean, stat, dev), _vector(save_invstd, stat, dev),
            new_mean if new_mean is not None else _empty(stat, dev),
            new_var if new_var is not None else _empty(stat, dev))


@batch_norm_forward.register_fake
def _(input, weight, bias, running_mean, running_var, training, momentum, eps):
    n = input.shape[1] if training else 0
    stat = _stat_dtype(input)

    def new_stat(r):
        if training and r is not None:
            return torch.empty_like(r)
        return input.new_empty((0,), dtype=stat)

    return (output_like(input), input.new_empty((n,), dtype=stat),
            input.new_empty((n,), dtype=stat), new_stat(running_mean), new_stat(running_var))


def _forward_setup_context(ctx, inputs, output):
    input, weight, bias, running_mean, running_var, training, momentum, eps = inputs
    _, save_mean, save_invstd, new_mean, new_var = output
    ctx.mark_non_differentiable(new_mean, new_var)
    ctx.training, ctx.eps = training, eps
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    # Running statistics are needed in eval mode only (in train mode they change after
    # every forward, and saving them would make a second forward before backward an error).
    stats = (running_mean, running_var) if not training else (None, None)
    ctx.save_for_backward(input, weight, *stats, save_mean, save_invstd)
    # Gradients w.r.t. save_mean / save_invstd only exist in higher-order graphs; with
    # materialisation off they arrive as None instead of full zero vectors.
    ctx.set_materialize_grads(False)


def _forward_backward(ctx, grad_out, grad_save_mean, grad_save_invstd, _grad_new_mean,
                      _grad_new_var):
    input, weight, running_mean, running_var, save_mean, save_invstd = ctx.saved_tensors
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    mask = [need_input, need_weight and ctx.has_weight, need_bias and ctx.has_bias]
    grad_input = grad_weight = grad_bias = None
    if grad_out is not None and any(mask):
        grad_input, grad_weight, grad_bias = torch.ops.bngrad.batch_norm_backward(
            grad_out, input, weight, running_mean, running_var, save_mean, save_invstd,
            ctx.training, ctx.eps, mask)
        grad_input = grad_input if mask[0] else None
        grad_weight = grad_weight if mask[1] else None
        grad_bias = grad_bias if mask[2] else None
    if ctx.training and need_input:
        grad_input = add_statistics_grad(grad_input, input, save_mean, save_invstd,
                                         grad_save_mean, grad_save_invstd)
    return grad_input, grad_weight, grad_bias, None, None, None, None, None


def add_statistics_grad(grad_input: Optional[Tensor], input: Tensor, save_mean: Tensor,
                        save_invstd: Tensor, grad_save_mean: Optional[Tensor],
                        grad_save_invstd: Optional[Tensor]) -> Optional[Tensor]:
    """``grad_input`` plus what flows back through the training forward's saved statistics,
    which are functions of the input too: d mean / dx = 1/M, d invstd / dx = -invstd**2*xhat/M.
    """
    if grad_save_mean is None and grad_save_invstd is None:
        return grad_input
    _dims, shape, m = _reduce_dims(input)
    extra = torch.zeros_like(input, dtype=save_mean.dtype)
    if grad_save_mean is not None:
        extra = extra + grad_save_mean.view(shape) / m
    if grad_save_invstd is not None:
        xhat = (input - save_mean.view(shape)) * save_invstd.view(shape)
        extra = extra - grad_save_invstd.view(shape) * save_invstd.view(shape) ** 2 * xhat / m
    extra = extra.to(input.dtype)
    return extra if grad_input is None else grad_input + extra


batch_norm_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)


# --- batch_norm_backward ----------------------------------------------------------------------

@torch.library.custom_op("bngrad::batch_norm_backward", mutates_args=(), device_types="cpu")
@_gomp.on_torch_team
def batch_norm_backward(grad_out: Tensor, input: Tensor, weight: Optional[Tensor],
                        running_mean: Optional[Tensor], running_var: Optional[Tensor],
                        save_mean: Optional[Tensor], save_invstd: Optional[Tensor],
                        train: bool, eps: float, output_mask: list[bool]
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """``native_batch_norm_backward`` on bngrad: (grad_input, grad_weight, grad_bias).

    Outputs masked off by ``output_mask`` are empty (0,) tensors.
    """
    if grad_out.dtype != input.dtype:  # autograd may hand over a grad of another dtype
        grad_out = grad_out.to(input.dtype)
    # grad_input is allocated by torch (its allocator, its alignment, the strides the fake
    # implementation promises) and written in place by bngrad.
    grad_input = empty_like(input) if output_mask[0] else _empty(input.dtype, input.device)
    _, grad_weight, grad_bias = bngrad.batch_norm_backward(
        to_numpy(grad_out, "grad_out"), to_numpy(input, "input"),
        to_numpy_optional(weight, "weight"), to_numpy_optional(running_mean, "running_mean"),
        to_numpy_optional(running_var, "running_var"), _stat_or_none(save_mean, "save_mean"),
        _stat_or_none(save_invstd, "save_invstd"), train=train, eps=eps,
        output_mask=tuple(output_mask), num_threads=torch.get_num_threads(),
        out=to_numpy(grad_input) if output_mask[0] else None)
    param = _param_dtype(input, weight, (running_mean, running_var, save_mean, save_invstd))
    return (grad_input, _vector(grad_weight, param, input.device),
            _vector(grad_bias, param, input.device))


def _stat_or_none(stat: Optional[Tensor], name: str):
    # The forward returns empty save_mean/save_invstd in eval mode, as PyTorch does; the
    # NumPy API spells "not given" as None.
    return None if stat is None or stat.numel() == 0 else to_numpy(stat, name)


@batch_norm_backward.register_fake
def _(grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
      output_mask):
    c = input.shape[1]
    param = _param_dtype(input, weight, (running_mean, running_var, save_mean, save_invstd))
    return (torch.empty_like(input) if output_mask[0] else input.new_empty((0,)),
            input.new_empty((c if output_mask[1] else 0,), dtype=param),
            input.new_empty((c if output_mask[2] else 0,), dtype=param))


def _backward_setup_context(ctx, inputs, output):
    (grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps,
     output_mask) = inputs
    ctx.train, ctx.eps, ctx.output_mask = train, eps, list(output_mask)
    ctx.save_for_backward(grad_out, input, weight, running_mean, running_var, save_mean,
                          save_invstd)
    ctx.set_materialize_grads(False)


def _reduce_dims(input: Tensor) -> tuple[list[int], list[int], int]:
    """Dimensions reduced per channel, the (1, C, 1, ...) broadcast shape, and M."""
    dims = [0] + list(range(2, input.dim()))
    shape = [1, input.shape[1]] + [1] * (input.dim() - 2)
    m = input.numel() // input.shape[1] if input.shape[1] else 0
    return dims, shape, m


def _double_backward(ctx, gg_input, gg_weight, gg_bias):
    r"""Derivative of (grad_input, grad_weight, grad_bias) w.r.t. (grad_out, input, weight).

    Notation, per channel over its M elements: ``E[.]`` the mean, ``g`` = grad_out,
    ``xhat = (x - mean) * s`` with ``s`` = invstd, ``w`` the weight (1 if None), and
    ``P(t) = t - E[t] - xhat * E[xhat * t]`` (a symmetric linear map). The first backward is

        train:  dx = w s P(g),        dw = sum(g xhat),   db = sum(g)
        eval:   dx = w s g,           dw = sum(g xhat),   db = sum(g)

    (eval: mean and s from the running statistics, constants). In train mode mean and s depend
    on x, and ``d xhat = s P(dx)``, ``d s = -s**2 E[xhat dx]``. With incoming gradients
    ``ggx, ggw, ggb`` for (dx, dw, db), the derivatives of ``L = <ggx,dx> + ggw.dw + ggb.db``:

        train:
          dL/dg = w s P(ggx) + ggw xhat + ggb
          dL/dw = s sum(ggx P(g))
          dL/dx = ggw s P(g) + w s**2 (xhat (E[ggx xhat] E[g xhat] - E[ggx g] + E[ggx] E[g])
                                       - E[g xhat] P(ggx) - E[ggx xhat] P(g))
        eval:
          dL/dg = w s ggx + ggw xhat + ggb
          dL/dw = s sum(ggx g)
          dL/dx = ggw s g

    Everything here is an ordinary torch operation on tensors that carry their own history
    (save_mean / save_invstd included), so differentiating this again (third order) is exact.
    Computed in the statistics' dtype (float32 for half inputs), results in the inputs' dtypes.
    """
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd = ctx.saved_tensors
    need_g, need_x, need_w = ctx.needs_input_grad[:3]
    dims, shape, m = _reduce_dims(input)
    if ctx.train:
        mean, s = save_mean, save_invstd
        if mean is None or mean.numel() == 0 or s is None or s.numel() == 0:
            var, mean = torch.var_mean(input.to(stat_dtype(input.dtype)), dims, correction=0)
            s = torch.rsqrt(var + ctx.eps)
    else:
        mean, s = running_mean, torch.rsqrt(running_var + ctx.eps)
    cdt = s.dtype
    mean, s = mean.view(shape), s.view(shape)
    g, x = grad_out.to(cdt), input.to(cdt)
    w = weight.to(cdt).view(shape) if weight is not None else None
    ggx = gg_input.to(cdt) if gg_input is not None and gg_input.numel() else None
    ggw = gg_weight.to(cdt).view(shape) if gg_weight is not None and gg_weight.numel() else None
    ggb = gg_bias.to(cdt).view(shape) if gg_bias is not None and gg_bias.numel() else None

    def E(t):
        return t.mean(dims, keepdim=True)

    def sum_c(t):
        return t.sum(dims)

    xhat = (x - mean) * s
    ws = s if w is None else w * s
    d_g = d_x = d_w = None
    if ctx.train:
        def P(t):
            return t - E(t) - xhat * E(xhat * t)
        Pg = P(g) if (need_x or need_w) else None
        Pggx = P(ggx) if ggx is not None and (need_g or need_x) else None
        if need_g:
            d_g = _add(ws * Pggx if Pggx is not None else None,
                       ggw * xhat if ggw is not None else None, ggb, like=g)
        if need_w and w is not None and ggx is not None:
            d_w = sum_c(ggx * Pg) * s.view(-1)
        if need_x:
            term = ggw * s * Pg if ggw is not None else None
            if ggx is not None:
                e_gx_xhat, e_g_xhat = E(ggx * xhat), E(g * xhat)
                inner = (xhat * (e_gx_xhat * e_g_xhat - E(ggx * g) + E(ggx) * E(g))
                         - e_g_xhat * Pggx - e_gx_xhat * Pg)
                term = _add(term, ws * s * inner)
            d_x = term
    else:
        if need_g:
            d_g = _add(ws * ggx if ggx is not None else None,
                       ggw * xhat if ggw is not None else None, ggb, like=g)
        if need_w and w is not None and ggx is not None:
            d_w = sum_c(ggx * g) * s.view(-1)
        if need_x and ggw is not None:
            d_x = ggw * s * g
    return (_cast(d_g, grad_out), _cast(d_x, input), _cast(d_w, weight),
            None, None, None, None, None, None, None)


def _add(*terms, like: Optional[Tensor] = None) -> Optional[Tensor]:
    """Sum of the terms that are not None, broadcast to ``like``'s shape if given."""
    total = None
    for t in terms:
        if t is not None:
            total = t if total is None else total + t
    if total is not None and like is not None and total.shape != like.shape:
        total = total.expand_as(like)
    return total


def _cast(t: Optional[Tensor], like: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None or like is None else t.to(like.dtype)


batch_norm_backward.register_autograd(_double_backward, setup_context=_backward_setup_context)


# --- the two halves of the backward, and the moments (for synchronized batch norm) ------------

@torch.library.custom_op("bngrad::batch_norm_backward_reduce", mutates_args=(),
                         device_types="cpu")
@_gomp.on_torch_team
def batch_norm_backward_reduce(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
                               weight: Optional[Tensor], input_g: bool, weight_g: bool,
                               bias_g: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(sum_dy, sum_dy_xmu, grad_weight, grad_bias); sums in mean's dtype, (0,) where not asked."""
    sum_dy, sum_dy_xmu, grad_weight, grad_bias = bngrad.batch_norm_backward_reduce(
        to_numpy(grad_out, "grad_out"), to_numpy(input, "input"), to_numpy(mean, "mean"),
        to_numpy(invstd, "invstd"), to_numpy_optional(weight, "weight"), input_g, weight_g,
        bias_g, num_threads=torch.get_num_threads())
    param = _param_dtype(input, weight, (mean, invstd))
    dev = input.device
    return (_vector(sum_dy, mean.dtype, dev), _vector(sum_dy_xmu, mean.dtype, dev),
            _vector(grad_weight, param, dev), _vector(grad_bias, param, dev))


@batch_norm_backward_reduce.register_fake
def _(grad_out, input, mean, invstd, weight, input_g, weight_g, bias_g):
    c = input.shape[1]
    param = _param_dtype(input, weight, (mean, invstd))
    return (input.new_empty((c if input_g else 0,), dtype=mean.dtype),
            input.new_empty((c if input_g else 0,), dtype=mean.dtype),
            input.new_empty((c if weight_g else 0,), dtype=param),
            input.new_empty((c if bias_g else 0,), dtype=param))


@torch.library.custom_op("bngrad::batch_norm_backward_elemt", mutates_args=(),
                         device_types="cpu")
@_gomp.on_torch_team
def batch_norm_backward_elemt(grad_out: Tensor, input: Tensor, mean: Tensor, invstd: Tensor,
                              weight: Optional[Tensor], sum_dy: Tensor, sum_dy_xmu: Tensor,
                              count: Tensor) -> Tensor:
    """grad_input from the (all-reduced) sums; ``count``: per-rank element counts (summed)."""
    grad_input = empty_like(input)
    bngrad.batch_norm_backward_elemt(
        to_numpy(grad_out, "grad_out"), to_numpy(input, "input"), to_numpy(mean, "mean"),
        to_numpy(invstd, "invstd"), to_numpy_optional(weight, "weight"),
        to_numpy(sum_dy, "sum_dy"), to_numpy(sum_dy_xmu, "sum_dy_xmu"),
        count.detach().cpu().numpy(), num_threads=torch.get_num_threads(),
        out=to_numpy(grad_input))
    return grad_input


@batch_norm_backward_elemt.register_fake
def _(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    return torch.empty_like(input)


@torch.library.custom_op("bngrad::batch_norm_moments", mutates_args=(), device_types="cpu")
@_gomp.on_torch_team
def batch_norm_moments(input: Tensor) -> tuple[Tensor, Tensor]:
    """Per-channel (mean, biased variance) in float64, two-pass accurate."""
    mean, var = bngrad.batch_norm_moments(to_numpy(input, "input"),
                                          num_threads=torch.get_num_threads())
    return (_vector(mean, torch.float64, input.device), _vector(var, torch.float64, input.device))


@batch_norm_moments.register_fake
def _(input):
    c = input.shape[1]
    return (input.new_empty((c,), dtype=torch.float64), input.new_empty((c,), dtype=torch.float64))
