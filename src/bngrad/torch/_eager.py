"""The eager-mode path of ``bngrad.torch.batch_norm``: an autograd.Function on the NumPy API.

``torch.ops.bngrad.*`` (see :mod:`bngrad.torch.ops`) are what compilers and exporters trace.
Calling them eagerly costs a dispatcher round trip, argument normalisation and functional
copies of the running statistics on every forward and backward, a fixed ~100-200 us per layer
and step that is as large as the kernels themselves on small feature maps. Eager calls on plain
CPU tensors therefore take this path: one Function whose forward and backward call
:func:`bngrad.batch_norm_forward` and :func:`bngrad.batch_norm_backward` on NumPy views of the
tensors, updating the running statistics in place.

Higher derivatives: when the backward itself is differentiated (``create_graph=True``, e.g.
gradient penalties, gradgradcheck), the backward recomputes the forward with the custom op,
whose graph is differentiable to any order, and differentiates that. Both paths compute the
same numbers with the same kernels.

Threads: every call passes ``num_threads=torch.get_num_threads()`` to the NumPy API, so
``torch.set_num_threads`` limits bngrad's kernels too (a DataLoader worker that sets 1 thread
runs them single-threaded).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

import bngrad

from .. import _gomp
from ..errors import ArgumentTypeError, ArgumentValueError
from ._convert import (empty_like, from_numpy, output_like, to_numpy, to_numpy_optional,
                       torch_terms)

__all__ = ["applies", "batch_norm"]


# Private torch functions (present in the pinned 2.13); without them, assume no transform and
# no dispatch mode.
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)


def applies(input: Tensor) -> bool:
    """Whether this path may run: a plain tensor, outside any tracer, functorch transform or
    dispatch mode (make_fx's real-tensor tracing is one: it sees only the custom ops)."""
    return (type(input) is Tensor and not torch.compiler.is_compiling()
            and not torch.jit.is_tracing() and not _functorch_active()
            and not _dispatch_modes())


def _as(array, like: Optional[Tensor]):
    """A (C,) result of the NumPy API as a tensor in ``like``'s dtype (None if not needed)."""
    if array is None or like is None:
        return None
    # The API's (C,) results are fresh, writable, contiguous: torch.from_numpy takes NumPy's
    # own dtypes as they are (from_numpy's checks are for anything else, bfloat16 included).
    tensor = (torch.from_numpy(array) if array.dtype in _NATIVE and array.flags.writeable
              else from_numpy(array))
    return tensor if tensor.dtype == like.dtype else tensor.to(like.dtype)


_NATIVE = frozenset(np.dtype(name) for name in ("float64", "float32", "float16"))


@_gomp.on_torch_team
def _forward(input, weight, bias, running_mean, running_var, training, momentum, eps):
    """(output, save_mean, save_invstd); running statistics updated in place in training."""
    output = output_like(input)
    try:
        _, save_mean, save_invstd = bngrad.batch_norm_forward(
            to_numpy(input, "input"), to_numpy_optional(weight, "weight"),
            to_numpy_optional(bias, "bias"), to_numpy_optional(running_mean, "running_mean"),
            to_numpy_optional(running_var, "running_var"), train=training, momentum=momentum,
            eps=eps, num_threads=torch.get_num_threads(), out=to_numpy(output))
    except (ArgumentValueError, ArgumentTypeError) as exc:
        raise torch_terms(exc, input, {"weight": weight, "bias": bias,
                                       "running_mean": running_mean,
                                       "running_var": running_var}) from None
    return output, save_mean, save_invstd


class _BatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, training, momentum, eps):
        output, save_mean, save_invstd = _forward(input, weight, bias, running_mean,
                                                  running_var, training, momentum, eps)
        ctx.training, ctx.eps = training, eps
        # Eval mode normalises with the running statistics, which the backward needs too
        # (train mode changes them in place, and does not need them).
        stats = (None, None) if training else (running_mean, running_var)
        ctx.save_for_backward(input, weight, bias, *stats)
        ctx.save_mean, ctx.save_invstd = save_mean, save_invstd  # NumPy arrays, not tensors
        return output

    @staticmethod
    @_gomp.on_torch_team
    def backward(ctx, grad_out):
        input, weight, bias, running_mean, running_var = ctx.saved_tensors
        need = ctx.needs_input_grad
        mask = (need[0], need[1] and weight is not None, need[2] and bias is not None)
        if differentiable(grad_out):
            return _differentiable_backward(ctx, ctx.saved_tensors, grad_out, mask) + (None,) * 5
        if grad_out.dtype != input.dtype:  # autograd may hand over a grad of another dtype
            grad_out = grad_out.to(input.dtype)
        grad_input = empty_like(input) if mask[0] else None
        _, grad_weight, grad_bias = bngrad.batch_norm_backward(
            to_numpy(grad_out, "grad_out"), to_numpy(input, "input"),
            to_numpy_optional(weight, "weight"), to_numpy_optional(running_mean, "running_mean"),
            to_numpy_optional(running_var, "running_var"), ctx.save_mean, ctx.save_invstd,
            train=ctx.training, eps=ctx.eps, output_mask=mask,
            num_threads=torch.get_num_threads(),
            out=None if grad_input is None else to_numpy(grad_input))
        return (grad_input, _as(grad_weight, weight), _as(grad_bias, bias)) + (None,) * 5


def differentiable(grad_out: Tensor) -> bool:
    """Whether a backward must be made of torch operations, not run on NumPy views: when it is
    itself differentiated (``create_graph=True``), and when ``grad_out`` is batched
    (``torch.autograd.grad(..., is_grads_batched=True)``, ``jacobian(..., vectorize=True)``:
    autograd's vmap over the backward, whose batched tensors have no NumPy view)."""
    return torch.is_grad_enabled() or _legacy_batched(grad_out)


_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


def _differentiable_backward(ctx, saved, grad_out, mask):
    """The backward as a graph that can be differentiated again (or, for a batched grad_out,
    of torch operations; see :func:`differentiable`): the forward is recomputed with the
    custom op (running statistics left alone) and differentiated by autograd."""
    input, weight, bias, running_mean, running_var = saved
    wanted = [t for t, m in zip((input, weight, bias), mask) if m]
    if not wanted:
        return None, None, None
    grads = iter(recomputed_grads(ctx, input, weight, bias, running_mean, running_var, wanted,
                                  grad_out))
    return tuple(next(grads) if m else None for m in mask)


def recomputed_grads(ctx, input, weight, bias, running_mean, running_var, wanted, grad_out):
    """Gradients of batch norm's forward, recomputed by the custom op, with respect to
    ``wanted`` at ``grad_out``: a graph of its own where the backward is differentiated
    (grad mode on), else plain values (the recomputation needs grad mode all the same)."""
    create_graph = torch.is_grad_enabled()
    with torch.enable_grad():
        output = torch.ops.bngrad.batch_norm_forward(
            input, weight, bias, None if ctx.training else running_mean,
            None if ctx.training else running_var, ctx.training, 0.0, ctx.eps)[0]
        return torch.autograd.grad(output, wanted, grad_out, create_graph=create_graph,
                                   allow_unused=True)


def batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps):
    """``bngrad.torch.batch_norm`` on plain CPU tensors in eager mode (see module docstring)."""
    if torch.is_grad_enabled() and (input.requires_grad
                                    or (weight is not None and weight.requires_grad)
                                    or (bias is not None and bias.requires_grad)):
        return _BatchNorm.apply(input, weight, bias, running_mean, running_var, training,
                                momentum, eps)
    return _forward(input, weight, bias, running_mean, running_var, training, momentum, eps)[0]
