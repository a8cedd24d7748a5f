"""The launcher: who runs each parallel kernel's work items. Today Numba's pool (``prange``).

Every parallel kernel is ``for item in range(n): <kernel>_item(item, *args)`` over independent
items whose bodies (kernels.batchnorm) are pure; kernels.__init__ computes ``n`` from the plan
and calls the launcher of that name here. The items, and the serial combination of their
results afterwards, are the same whoever runs them, and so are the bits.

Another backend (for instance bngrad._gomp, which runs items on PyTorch's OpenMP team) is a
module with these same functions and signatures, looping over the same ``*_item`` bodies;
kernels.__init__ reads the launcher through its ``launch`` attribute, the one place to swap.
"""

from __future__ import annotations

from typing import Any

from numba import njit, prange

from . import batchnorm as b

_JIT: dict[str, Any] = dict(cache=True, nogil=True, parallel=True)


@njit(**_JIT)
def reduce_runs(n, x, dy, y, mean, shift, rows, seg, partial):
    for item in prange(n):
        b.reduce_runs_item(item, x, dy, y, mean, shift, rows, seg, partial)


@njit(**_JIT)
def reduce_short(n, x2, d2, y2, B, mean, shift, rows, group, partial):
    for item in prange(n):
        b.reduce_short_item(item, x2, d2, y2, B, mean, shift, rows, group, partial)


@njit(**_JIT)
def reduce_lanes(n, x, dy, y, mean, shift, rows, cols, partial):
    for item in prange(n):
        b.reduce_lanes_item(item, x, dy, y, mean, shift, rows, cols, partial)


@njit(**_JIT)
def elementwise_runs(n, x, dy, y, out, coef, seg):
    for item in prange(n):
        b.elementwise_runs_item(item, x, dy, y, out, coef, seg)


@njit(**_JIT)
def elementwise_short(n, x, dy, y, out, coef, group):
    for item in prange(n):
        b.elementwise_short_item(item, x, dy, y, out, coef, group)


@njit(**_JIT)
def elementwise_lanes(n, x, dy, y, out, coef, rows, cols):
    for item in prange(n):
        b.elementwise_lanes_item(item, x, dy, y, out, coef, rows, cols)


@njit(**_JIT)
def backward_fused(n, x, dy, y, out, mean, invstd, weight, count, rows, seg, sum_dy,
                   sum_dy_xmu, coef):
    for c in prange(n):
        b.backward_fused_item(c, x, dy, y, out, mean, invstd, weight, count, rows, seg, sum_dy,
                              sum_dy_xmu, coef)


@njit(**_JIT)
def forward_fused(n, x, out, weight, bias, eps, count, rows, seg, mean, var, coef):
    for c in prange(n):
        b.forward_fused_item(c, x, out, weight, bias, eps, count, rows, seg, mean, var, coef)


@njit(**_JIT)
def copy_rows(n, source, out):
    for i in prange(n):
        b.copy_rows_item(i, source, out)


@njit(**_JIT)
def transpose_last_two(n, source, out):
    for item in prange(n):
        b.transpose_item(item, source, out)
