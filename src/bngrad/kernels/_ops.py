"""The per-element maths of batch norm, each formula written once (docs/internals.md).

The loops of kernels.batchnorm inline these (``@overload``, ``inline="always"``): they compile
as if written in place, with the caller's fastmath flags, and stay in Numba's disk cache (which
functions passed as arguments or made by closure factories do not). An operand that is None
selects a formula when the kernel is compiled, never at run time:

- ``accumulate``: ``dy'`` and ``dy'*(x - mean)``, ``dy' = dy - shift``, in float64;
- ``elementwise``: x and dy: training grad_input ``(dy - GRAD_MEAN - (x - MEAN)*PROJ)*SCALE``;
  dy only: eval grad_input ``dy*SCALE``; x only: the forward ``(x - MEAN)*SCALE + BIAS``;
- ``grad``: the incoming gradient; ``y`` (the forward output, None today) is where fused
  activations (issue 13) add ``dy * (y > 0)``.

``(x - MEAN)*PROJ`` is subtracted by one fused multiply-add, after the mean gradient, as
PyTorch's CPU kernel does (its compiler contracts it): where grad_input cancels (a channel of
one or two elements) it cancels exactly (one element: exactly 0). Keeping ``x - mean``
explicit avoids the cancellation of ``a*dy + b*x + c`` when |mean| >> std.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from ._elements import to_float

# Rows of ``coef`` (per channel, compute dtype): SCALE = invstd*weight, PROJ =
# sum_dy_xmu/count*invstd**2, GRAD_MEAN = sum_dy/count, MEAN; the forward's BIAS uses
# GRAD_MEAN's row.
SCALE, PROJ, GRAD_MEAN, MEAN = 0, 1, 2, 3
BIAS = GRAD_MEAN


@intrinsic
def _fma(typingctx, a, b, c):
    """a*b + c rounded once (llvm.fma: one instruction on CPUs with FMA, exact everywhere)."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        fma = builder.module.declare_intrinsic("llvm.fma", [args[0].type] * 3)
        return builder.call(fma, args)
    return a(a, b, c), codegen


def take(values: Any, index: Any) -> Any:
    """``values[index]`` for an array, ``values`` itself for a scalar, None for None (jitted)."""
    raise NotImplementedError


@overload(take, inline="always")
def _take(values, index):
    if isinstance(values, types.NoneType):
        return lambda values, index: None
    if isinstance(values, types.Array):
        return lambda values, index: values[index]
    return lambda values, index: values


def grad(dy: Any, y: Any) -> Any:
    """The incoming gradient element in the compute type (jitted; ``y``: see the docstring)."""
    raise NotImplementedError


@overload(grad, inline="always")
def _grad(dy, y):
    if isinstance(y, types.NoneType):
        return lambda dy, y: to_float(dy)
    return None


@njit(inline="always")
def accumulate(dy, x, y, mean, shift):
    """(dy', dy'*(x - mean)) in float64, dy' = dy - shift: one element's terms of the sums."""
    d = np.float64(grad(dy, y)) - shift
    return d, d * (np.float64(to_float(x)) - mean)


def elementwise(x: Any, dy: Any, y: Any, scale: Any, proj: Any, shift: Any, mean: Any) -> Any:
    """grad_input (train: x and dy; eval: dy) or the forward output (x) of one element (jitted)."""
    raise NotImplementedError


@overload(elementwise, inline="always")
def _elementwise(x, dy, y, scale, proj, shift, mean):
    if isinstance(dy, types.NoneType):
        return lambda x, dy, y, scale, proj, shift, mean: (to_float(x) - mean) * scale + shift
    if isinstance(x, types.NoneType):
        return lambda x, dy, y, scale, proj, shift, mean: scale * grad(dy, y)
    return lambda x, dy, y, scale, proj, shift, mean: (
        _fma(mean - to_float(x), proj, grad(dy, y) - shift) * scale)
