"""The memory floor: one fused parallel pass ``dx = a[c]*dy + b[c]*x`` over the case's arrays.

No batch-norm backward that returns a new grad_input can beat it: it must read x and dy and
write dx too. The kernels use bngrad's element codecs, so every dtype is read and rounded the
way bngrad's own kernels do.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import numpy as np
from numba import njit, prange, uint64

from .. import _dtypes
from .._threads import gate, thread_count
from ..errors import ArgumentValueError
from ..kernels._cache import lock_cache_files
from ..kernels._elements import as_kernel_array, from_float, to_float


@njit(inline="always")
def _axpby_run(dy, x, out, a, b, i0, i1):
    # unsigned indices: Numba then emits no negative-index wraparound, and LLVM vectorises
    for i in range(uint64(i0), uint64(i1)):
        out[i] = from_float(a * to_float(dy[i]) + b * to_float(x[i]), out)


@njit(parallel=True, nogil=True, cache=True)
def _floor_channels_first(dy, x, out, a, b, inner, seg):
    """Flat arrays whose channel is (i // inner) % C: runs of ``inner`` share a coefficient."""
    C = a.size
    rows = dy.size // inner
    n_segs = (inner + seg - 1) // seg
    for item in prange(rows * n_segs):
        r = item // n_segs
        s = item - r * n_segs
        c = r % C
        i0 = r * inner + s * seg
        _axpby_run(dy, x, out, a[c], b[c], i0, min(i0 + seg, r * inner + inner))


@njit(parallel=True, nogil=True, cache=True)
def _floor_channels_last(dy, x, out, a_tiled, b_tiled):
    """Flat arrays whose channel is i % C; the coefficients come tiled to a multiple of C."""
    P = a_tiled.size
    n = dy.size
    for t in prange((n + P - 1) // P):
        i0 = t * P
        i1 = min(i0 + P, n)
        d, xs, o = dy[i0:i1], x[i0:i1], out[i0:i1]
        for j in range(o.size):  # from 0: no wraparound check, vectorises
            o[j] = from_float(a_tiled[j] * to_float(d[j]) + b_tiled[j] * to_float(xs[j]), o)


# Elements per parallel work item: large enough to stream, small enough to balance 2..N threads.
_FLOOR_SEG = 1 << 14


def dense_order(array: np.ndarray) -> Optional[Tuple[int, ...]]:
    """Axis permutation (outermost first) under which ``array`` is C-contiguous, else None."""
    order = tuple(sorted(range(array.ndim), key=lambda d: (-abs(array.strides[d]), d)))
    return order if array.transpose(order).flags.c_contiguous else None


def make_floor(grad_out: np.ndarray, input: np.ndarray, a: np.ndarray, b: np.ndarray,
               num_threads: Optional[int] = None, channel_axis: int = 1,
               in_place: bool = False) -> Callable[[], np.ndarray]:
    """A zero-argument callable computing the floor pass; returns ``dx`` (flat, memory order).

    ``grad_out`` and ``input`` must be dense with the same strides; ``a`` and ``b`` are the
    per-channel coefficients (converted to the compute dtype: float64 for float64 data,
    float32 otherwise). Each call allocates its output, as bngrad and PyTorch do; with
    ``in_place`` every call writes into one output allocated (and paged in) up front, which
    leaves out what the operating system charges for fresh memory.
    """
    order = dense_order(input)
    if order is None or grad_out.strides != input.strides or grad_out.dtype != input.dtype:
        raise ArgumentValueError("floor: grad_out and input must be dense with equal strides "
                                 "and dtype")
    ct = _dtypes.compute_dtype(input.dtype)
    a = np.ascontiguousarray(a, dtype=ct)
    b = np.ascontiguousarray(b, dtype=ct)
    dy = as_kernel_array(grad_out.transpose(order).reshape(-1))
    x = as_kernel_array(input.transpose(order).reshape(-1))
    memory_shape = tuple(input.shape[d] for d in order)
    inner = math.prod(memory_shape[order.index(channel_axis) + 1:])
    kernel_dtype, n = x.dtype, x.size
    fixed = np.zeros(n, kernel_dtype) if in_place else None
    if inner > 1:
        def kernel(out):
            _floor_channels_first(dy, x, out, a, b, inner, _FLOOR_SEG)
    else:
        reps = max(1, _FLOOR_SEG // max(a.size, 1))
        a_tiled, b_tiled = np.tile(a, reps), np.tile(b, reps)

        def kernel(out):
            _floor_channels_last(dy, x, out, a_tiled, b_tiled)

    def run() -> np.ndarray:
        out = np.empty(n, kernel_dtype) if fixed is None else fixed
        with gate(), thread_count(num_threads):
            kernel(out)
        return out
    return run


def floor_pass(grad_out: np.ndarray, input: np.ndarray, a: np.ndarray, b: np.ndarray, *,
               channel_axis: int = 1, num_threads: Optional[int] = None) -> np.ndarray:
    """``a[c]*grad_out + b[c]*input`` by the floor kernel, shaped and strided like ``input``.

    Computed in float32 for half and float32 data (float64 for float64), rounded once to the
    data's dtype. Both arrays must be dense with equal strides.
    """
    flat = make_floor(grad_out, input, a, b, num_threads, channel_axis)()
    order = dense_order(input)
    assert order is not None  # make_floor refuses an input that is not dense
    memory = flat.view(input.dtype).reshape(tuple(input.shape[d] for d in order))
    return memory.transpose(np.argsort(order))


lock_cache_files(globals())  # (kernels._cache: safe between processes)
