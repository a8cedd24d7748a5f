"""Kernel dispatch: the one place that picks a kernel for a canonical layout.

Inputs are canonical kernel arrays (see bngrad._layout and ``as_kernel_array``): channels-first
``(A, C, B)`` or channels-last ``(M, C)``, both C-contiguous. Tile sizes are functions of the
shape only, which is what makes results identical for every thread count.

Narrow channels-last arrays (C < 16, e.g. RGB images in NHWC) would leave the vector units
idle, since the inner loop runs over C. They are viewed as ``(M // k, k*C)`` ("k rows folded
into one"), so the inner loop runs over k*C >= 32 lanes; the k partial sums of each channel are
then added in a fixed order, and the ``M % k`` leftover rows are handled as a small array.
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
# Channels-last arrays narrower than this are folded (see module docstring).
NARROW = 16
FOLDED_LANES = 32


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


def _fold(C: int) -> int:
    """How many channels-last rows to view as one (1: none)."""
    return _ceil_div(FOLDED_LANES, C) if 0 < C < NARROW else 1


def _folded(arrays, fold):
    """Split (M, C) arrays into (M // fold, fold*C) bodies and (M % fold, C) tails (views)."""
    M, C = arrays[0].shape
    cut = M - M % fold
    bodies = [None if a is None else a[:cut].reshape(M // fold, fold * C) for a in arrays]
    tails = [None if a is None else a[cut:] for a in arrays]
    return bodies, tails


def _reduce_channels_last(x, dy, mean):
    M, C = x.shape
    rows, cols = _channels_last_tiles(C)
    partial = np.empty((_ceil_div(M, rows), 2, C))
    k.reduce_channels_last(x, dy, mean, rows, cols, partial)
    sum_dy, sum_dy_xmu = np.empty(C), np.empty(C)
    k.combine_channels_last(partial, sum_dy, sum_dy_xmu)
    return sum_dy, sum_dy_xmu


def reduce(x: np.ndarray, dy: np.ndarray, mean: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum dy, sum dy*(x - mean)) per channel, float64."""
    C = x.shape[1]
    if x.ndim == 3:
        A, _, B = x.shape
        rows, seg = _channels_first_tiles(A, B)
        partial = np.empty((_ceil_div(A, rows), _ceil_div(B, seg), C, 2))
        k.reduce_channels_first(x, dy, mean, rows, seg, partial)
        sum_dy, sum_dy_xmu = np.empty(C), np.empty(C)
        k.combine_channels_first(partial, sum_dy, sum_dy_xmu)
        return sum_dy, sum_dy_xmu
    fold = _fold(C)
    if fold == 1:
        return _reduce_channels_last(x, dy, mean)
    (bx, bdy), (tx, tdy) = _folded((x, dy), fold)
    lanes = [s.reshape(fold, C) for s in _reduce_channels_last(bx, bdy, np.tile(mean, fold))]
    sums = [lane[0].copy() for lane in lanes]
    for total, lane in zip(sums, lanes):
        for i in range(1, fold):  # fixed order: fold 0, 1, 2, ..., then the tail
            total += lane[i]
    if tx.shape[0]:
        for total, tail in zip(sums, _reduce_channels_last(tx, tdy, mean)):
            total += tail
    return sums[0], sums[1]


def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype) -> np.ndarray:
    coef = np.empty((4, len(mean)), dtype=dtype)
    k.train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, float(count), coef)
    return coef


def _channels_last_pass(kernel, arrays, coef, *extra) -> None:
    """Run an elementwise channels-last kernel, folding narrow arrays."""
    C = coef.shape[1]
    fold = _fold(C)
    if fold == 1:
        kernel(*arrays, coef, _channels_last_tiles(C)[0], *extra)
        return
    bodies, tails = _folded(arrays, fold)
    kernel(*bodies, np.tile(coef, (1, fold)), _channels_last_tiles(fold * C)[0], *extra)
    if tails[0].shape[0]:
        kernel(*tails, coef, _channels_last_tiles(C)[0], *extra)


def elemt(x: np.ndarray, dy: np.ndarray, out: np.ndarray, coef: np.ndarray, train: bool) -> None:
    """out = a*dy - b*(x - mean) - d (train) or a*dy (eval), per channel coefficients."""
    if dy.ndim == 3:
        A, _, B = dy.shape
        k.elemt_channels_first(x, dy, out, coef, _channels_first_tiles(A, B)[1], train)
    else:
        _channels_last_pass(k.elemt_channels_last, (x, dy, out), coef, train)


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
        _channels_last_pass(k.normalize_channels_last, (x, out), coef)
