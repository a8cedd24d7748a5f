"""Kernel dispatch: the one place that picks a kernel for a canonical layout.

Inputs are canonical kernel arrays (see bngrad._layout and ``as_kernel_array``): channels-first
``(A, C, B)`` or channels-last ``(M, C)``, both C-contiguous. Tile sizes are functions of the
shape only, which is what makes results identical for every thread count.
"""

from __future__ import annotations

import numpy as np

from .._threads import current_num_threads
from . import batchnorm as k
from ._elements import as_kernel_array, compute_dtype

__all__ = ["as_kernel_array", "compute_dtype", "reduce", "backward_train", "elemt",
           "normalize", "train_coefficients"]

# Elements per reduction tile: big enough to amortise the per-tile work, small enough that
# even a modest array splits into many tiles for the threads to share.
TILE = 1 << 14
# Channels-last reductions handle at most this many channels per task, so that each task's
# partial sums stay in L1 and wide tensors still split into many tasks.
COLUMN_GROUP = 512


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _channels_first_tiles(A: int, B: int) -> tuple[int, int]:
    """(rows per block, segment length) of a channels-first tile."""
    if B >= TILE:
        return 1, TILE
    return max(1, TILE // max(B, 1)), B


def _channels_last_tiles(C: int) -> tuple[int, int]:
    """(rows per block, columns per group) of a channels-last tile."""
    cols = min(C, COLUMN_GROUP)
    return max(1, TILE // max(cols, 1)), cols


def reduce(x: np.ndarray, dy: np.ndarray, mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum dy, sum dy*(x - mean)) per channel, float64."""
    C = x.shape[1]
    sum_dy = np.empty(C)
    sum_dy_xmu = np.empty(C)
    if x.ndim == 3:
        A, _, B = x.shape
        rows, seg = _channels_first_tiles(A, B)
        partial = np.empty((_ceil_div(A, rows), _ceil_div(B, seg), C, 2))
        k.reduce_channels_first(x, dy, mean, rows, seg, partial)
        k.combine_channels_first(partial, sum_dy, sum_dy_xmu)
    else:
        M = x.shape[0]
        rows, cols = _channels_last_tiles(C)
        partial = np.empty((_ceil_div(M, rows), 2, C))
        k.reduce_channels_last(x, dy, mean, rows, cols, partial)
        k.combine_channels_last(partial, sum_dy, sum_dy_xmu)
    return sum_dy, sum_dy_xmu


def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype) -> np.ndarray:
    coef = np.empty((4, len(mean)), dtype=dtype)
    k.train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, float(count), coef)
    return coef


def elemt(x: np.ndarray, dy: np.ndarray, out: np.ndarray, coef: np.ndarray, train: bool) -> None:
    """out = a*dy - b*(x - mean) - d (train) or a*dy (eval), per channel coefficients."""
    if dy.ndim == 3:
        A, _, B = dy.shape
        k.elemt_channels_first(x, dy, out, coef, _channels_first_tiles(A, B)[1], train)
    else:
        k.elemt_channels_last(x, dy, out, coef, _channels_last_tiles(dy.shape[1])[0], train)


def backward_train(x, dy, out, mean, invstd, weight, count, dtype):
    """Training-mode reduce + grad_input; returns (sum_dy, sum_dy_xmu) in float64.

    Channels-first with enough channels to keep every thread busy runs fused (each channel is
    reduced and then written while still in cache); otherwise reduce, then apply. Both give
    the same bits.
    """
    C = x.shape[1]
    if x.ndim == 3 and C >= 4 * current_num_threads():
        A, _, B = x.shape
        rows, seg = _channels_first_tiles(A, B)
        sum_dy, sum_dy_xmu = np.empty(C), np.empty(C)
        coef = np.empty((4, C), dtype=dtype)
        k.backward_channels_first_fused(x, dy, out, mean, invstd, weight, float(count), rows, seg,
                                        sum_dy, sum_dy_xmu, coef)
        return sum_dy, sum_dy_xmu
    sum_dy, sum_dy_xmu = reduce(x, dy, mean)
    coef = train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype)
    elemt(x, dy, out, coef, True)
    return sum_dy, sum_dy_xmu


def normalize(x: np.ndarray, out: np.ndarray, coef: np.ndarray) -> None:
    """out = (x - mean)*a + d per channel (the forward pass)."""
    if x.ndim == 3:
        A, _, B = x.shape
        k.normalize_channels_first(x, out, coef, _channels_first_tiles(A, B)[1])
    else:
        k.normalize_channels_last(x, out, coef, _channels_last_tiles(x.shape[1])[0])
