"""The per-element maths of batch norm, each formula written once.

Every layout's loop (kernels.batchnorm) calls these, inlined (``@overload`` and
``inline="always"``): the loops compile as if the formula were written in place, with the
caller's fastmath flags, and Numba's disk cache keeps working, which it does not for functions
passed as arguments or made by closure factories. Variants are compile-time specialisations:
an operand that is ``None`` selects a formula when the kernel is compiled, never at run time.

- ``accumulate``: the terms of the backward sums, ``dy'`` and ``dy'*(x - mean)`` with
  ``dy' = dy - shift``, in float64;
- ``elementwise``: x and dy: the training grad_input ``(dy - GRAD_MEAN - (x - MEAN)*PROJ) *
  SCALE``; dy only: the eval grad_input ``dy*SCALE``; x only: the forward
  ``(x - MEAN)*SCALE + BIAS``.

``y``, the forward output, is the side input of fused activations (issue 13) and None today:
a ReLU backward adds a ``grad`` case returning ``dy * (y > 0)``.

Coefficient rows (``coef[ROW, c]``, compute dtype): ``SCALE = invstd*weight``,
``GRAD_MEAN = sum_dy/count``, ``PROJ = sum_dy_xmu/count*invstd**2``, ``MEAN``; the forward's
``BIAS`` shares GRAD_MEAN's row. The backward subtracts the mean gradient from dy before
scaling, and ``(x - MEAN)*PROJ`` by one fused multiply-add, as PyTorch's CPU kernel does (its
compiler contracts it): where grad_input cancels (a channel of one or two elements) it then
cancels exactly instead of leaving the rounding errors of separately scaled terms (one
element: exactly 0). Keeping ``x - mean`` explicit avoids the cancellation of
``a*dy + b*x + c`` when |mean| >> std.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from ._elements import to_float

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
    # The product is subtracted without rounding it first: where the terms cancel, its
    # rounding error would be all that is left.
    return lambda x, dy, y, scale, proj, shift, mean: (
        _fma(mean - to_float(x), proj, grad(dy, y) - shift) * scale)
