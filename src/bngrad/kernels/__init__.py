"""Kernel dispatch: the one place that picks a kernel for a canonical layout.

Inputs are canonical kernel arrays (see bngrad._layout and ``as_kernel_array``): channels-first
``(A, C, B)`` or channels-last ``(M, C)``, both C-contiguous. Tile sizes are functions of the
shape only, which is what makes results identical for every thread count.

The channels-last kernels run their inner loop over a row's "lanes". Two kinds of narrow rows
are re-viewed (no copy) before they reach a kernel:
- channels-last arrays with few channels are viewed as ``(M // k, k*C)``: k rows folded into
  one, with at least FOLD_LANES lanes for reductions and ELEMT_LANES for elementwise passes;
  the ``M % k`` leftover rows are a second, small piece. Reductions read four rows at a time,
  and four short rows of one page read in turn defeat the hardware prefetcher (measured on
  Zen 4: (131072, 256) float32 reduced in 18 ms, 8.5 ms folded to 4096 lanes). Elementwise
  passes read one coefficient per lane, so they fold only rows too short to vectorise
  (coefficients spread over 4096 lanes fall out of L1: 5.5 -> 9.5 ms at (100352, 256));
- channels-first arrays with short runs (B < 32, e.g. 5x5 feature maps) are viewed as
  ``(A, C*B)``: each of the C*B lanes belongs to one channel.
Each lane's sums are then added into its channel in lane order (a fixed order), and per-channel
coefficients are spread over the lanes.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator

import numpy as np

from .._threads import current_num_threads
from . import batchnorm as k
from ._elements import as_kernel_array, compute_dtype
from .batchnorm import copy_rows, transpose_last_two

__all__ = ["as_kernel_array", "compute_dtype", "copy_rows", "transpose_last_two", "reduce",
           "backward_train", "elemt", "forward_train", "normalize", "train_coefficients"]

# Elements per reduction tile: big enough to amortise the per-tile work, small enough that
# even a modest array splits into many tiles for the threads to share.
TILE = 1 << 14
# Channels-last tiles span at most this many lanes (whole rows up to there: tiles that cut rows
# read them in strided pieces, which measured 1.3-1.5x slower).
COLUMN_GROUP = 8192
# Row blocks per channels-last reduction: enough tasks for 64 threads...
MAX_ROW_BLOCKS = 64
# ...but at most this many bytes of float64 partial sums (2 per lane per block), so that
# extra memory stays O(lanes) however many rows there are, and at least this many rows per
# block, so that writing and combining the partial sums stays cheap next to reading the rows.
PARTIAL_BYTES = 1 << 21
MIN_BLOCK_ROWS = 32
# Channels-last pieces narrower than these are folded (see module docstring), and
# channels-first arrays with runs shorter than SHORT_RUN are viewed as rows of lanes.
FOLD_LANES = 4096
ELEMT_LANES = 256
SHORT_RUN = 32
# Shorter runs are not fused: per-run loop overhead costs more than a second pass over cached
# data, and they go to the channel-group ("short") kernels below instead. Same process, fp32,
# backward with out= (min ms), fused vs short two-pass: (32, 1024, 14, 14) 4.21 vs 3.08,
# (256, 256, 14, 14) 13.7 vs 10.1, (64, 256, 8, 8) 0.79 vs 0.60, (32, 64, 28, 28) 0.77 vs 0.89
# (fused wins from B = 784), (32, 256, 56, 56) 10.3 vs 14.3; float16/bfloat16/float64 alike.
FUSED_MIN_RUN = 256
# Channels-first arrays with runs of SHORT_RUN..FUSED_MIN_RUN go to the "short" kernels, whose
# tasks take a group of whole channels, about this many lanes of every row, as one loop instead
# of one run at a time (measured at (32, 2048, 7, 7) fp32, same process: reduce 1.30 -> 0.48 ms,
# with 1024 lanes 0.56 ms, 2048 and 3072 as 1536; elemt 0.98 -> 0.60 ms; normalize likewise).
# A fused kernel over the same groups measured 1.8-2.0 ms against 1.5 ms for the two passes.
SHORT_GROUP_LANES = 1536


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_scratch = threading.local()


@contextlib.contextmanager
def _partial_sums(shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """A float64 array for a reduction's partial sums, reused by this thread's next calls.

    The kernels overwrite every element. A fresh one per call can come from the allocator as
    new pages (mmap) and cost page faults every time: 13 faults per (65536, 64) float32
    backward alternating with another large allocation, 0.7 with this buffer; (256, 4096)
    backward 0.43 -> 0.40 ms.

    The buffer is checked out while in use: a call nested on the same thread (from a signal
    handler or a finaliser, which run between the outer call's kernels) finds none and gets
    a fresh array instead of overwriting the outer call's partial sums.
    """
    n = math.prod(shape)
    buffer = getattr(_scratch, "partial", None)
    _scratch.partial = None
    if buffer is None or buffer.size < n:
        buffer = np.empty(n)
    try:
        yield buffer[:n].reshape(shape)
    finally:
        _scratch.partial = buffer


def _channels_first_tiles(A: int, B: int) -> tuple[int, int]:
    """(rows per block, segment length) of a channels-first tile."""
    if B >= TILE:
        return 1, TILE
    return max(1, TILE // max(B, 1)), B


def _channels_last_tiles(L: int) -> tuple[int, int]:
    """(rows per block, lanes per group) of an elementwise channels-last tile."""
    cols = min(L, COLUMN_GROUP)
    return max(1, TILE // max(cols, 1)), cols


def _channels_last_reduce_tiles(M: int, L: int) -> tuple[int, int]:
    """(rows per block, lanes per group) of a channels-last reduction tile: at least TILE
    elements and MIN_BLOCK_ROWS rows, at most MAX_ROW_BLOCKS blocks and PARTIAL_BYTES of
    partial sums."""
    cols = min(L, COLUMN_GROUP)
    blocks = max(1, min(MAX_ROW_BLOCKS, PARTIAL_BYTES // (16 * max(L, 1)),
                        M * cols // TILE, M // MIN_BLOCK_ROWS))
    return _ceil_div(M, blocks), cols


def _short_group(B: int) -> int:
    """Channels per task of the short-run channels-first kernels."""
    return _ceil_div(SHORT_GROUP_LANES, max(B, 1))


def _uses_lanes(x: np.ndarray) -> bool:
    """Whether ``x`` goes to the channels-last kernels (see module docstring)."""
    return x.ndim == 2 or x.shape[2] < SHORT_RUN


class _Lanes:
    """How the lanes of a 2-D piece map to channels: lane ``c*runs + b`` (``repeat``, a
    channel's run is contiguous) or lane ``i*C + c`` (``tile``, folded rows)."""

    def __init__(self, kind: str, C: int, times: int):
        self.kind, self.C, self.times = kind, C, times

    def spread(self, values: np.ndarray) -> np.ndarray:
        """Per-channel values (..., C) -> per-lane values (..., C*times)."""
        if self.kind == "repeat":
            return np.repeat(values, self.times, axis=-1)
        return np.tile(values, (1,) * (values.ndim - 1) + (self.times,))

    def add_into(self, total: np.ndarray, lane_sums: np.ndarray) -> None:
        """total[c] += the sums of channel c's lanes, one lane at a time, in lane order."""
        per_lane = (lane_sums.reshape(self.C, self.times).T if self.kind == "repeat"
                    else lane_sums.reshape(self.times, self.C))
        k.add_lanes(total, per_lane)


def _lane_pieces(arrays, C: int, min_lanes: int):
    """[(2-D views of ``arrays``, their _Lanes, or None where lane == channel), ...], with
    channels-last rows narrower than ``min_lanes`` folded."""
    first = arrays[0]
    if first.ndim == 3:
        A, _, B = first.shape
        return [([a.reshape(A, C * B) for a in arrays], _Lanes("repeat", C, B))]
    M = first.shape[0]
    fold = min(M, _ceil_div(min_lanes, max(C, 1)))
    if C == 0 or fold <= 1:
        return [(arrays, None)]
    cut = M - M % fold
    pieces = [([a[:cut].reshape(M // fold, fold * C) for a in arrays], _Lanes("tile", C, fold))]
    if cut < M:
        pieces.append(([a[cut:] for a in arrays], None))
    return pieces


def _spread(values: np.ndarray, lanes) -> np.ndarray:
    return values if lanes is None else lanes.spread(values)


def _reduce_lanes(x, dy, mean, shift):
    M, L = x.shape
    rows, cols = _channels_last_reduce_tiles(M, L)
    sum_dy, sum_dy_xmu = np.empty(L), np.empty(L)
    with _partial_sums((_ceil_div(M, rows), 2, L)) as partial:
        k.reduce_channels_last(x, dy, mean, shift, rows, cols, partial)
        k.combine_channels_last(partial, sum_dy, sum_dy_xmu)
    return sum_dy, sum_dy_xmu


def reduce(x: np.ndarray, dy: np.ndarray, mean: np.ndarray, shift: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(sum dy', sum dy'*(x - mean)) per channel in float64, where dy' = dy - shift (default 0).

    With dy = x and shift = mean this gives sum(x - mean) and sum((x - mean)**2): the
    second pass of the variance.
    """
    C = x.shape[1]
    shift = np.zeros(C) if shift is None else shift
    if not _uses_lanes(x):
        A, _, B = x.shape
        rows, seg = _channels_first_tiles(A, B)
        sum_dy, sum_dy_xmu = np.empty(C), np.empty(C)
        with _partial_sums((_ceil_div(A, rows), _ceil_div(B, seg), C, 2)) as partial:
            if B < FUSED_MIN_RUN:  # never fused, so its own order (see SHORT_GROUP_LANES)
                k.reduce_channels_first_short(x, dy, mean, shift, rows, _short_group(B),
                                              partial)
            else:
                k.reduce_channels_first(x, dy, mean, shift, rows, seg, partial)
            k.combine_channels_first(partial, sum_dy, sum_dy_xmu)
        return sum_dy, sum_dy_xmu
    sums = (np.zeros(C), np.zeros(C))
    for (px, pdy), lanes in _lane_pieces((x, dy), C, FOLD_LANES):
        if px.shape[0] == 0:
            continue
        piece_sums = _reduce_lanes(px, pdy, _spread(mean, lanes), _spread(shift, lanes))
        for total, lane_sums in zip(sums, piece_sums):
            if lanes is None:
                total += lane_sums
            else:
                lanes.add_into(total, lane_sums)
    return sums


def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype) -> np.ndarray:
    """Training backward coefficient rows (SCALE, PROJ, GRAD_MEAN, MEAN; see kernels.batchnorm)
    in ``dtype``, from float64 per-channel sums and statistics."""
    coef = np.empty((4, len(mean)), dtype=dtype)
    k.train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, float(count), coef)
    return coef


def _lanes_pass(kernel, arrays, coef, *extra) -> None:
    """Run an elementwise channels-last kernel over the lane pieces of ``arrays``."""
    for pieces, lanes in _lane_pieces(arrays, coef.shape[1], ELEMT_LANES):
        if pieces[0].shape[0]:
            kernel(*pieces, _spread(coef, lanes), *_channels_last_tiles(pieces[0].shape[1]),
                   *extra)


def elemt(x: np.ndarray, dy: np.ndarray, out: np.ndarray, coef: np.ndarray, train: bool) -> None:
    """out = (dy - GRAD_MEAN - (x - MEAN)*PROJ) * SCALE (train) or dy*SCALE (eval), with the
    per-channel rows of ``coef`` (see kernels.batchnorm)."""
    if _uses_lanes(dy):
        _lanes_pass(k.elemt_channels_last, (x, dy, out), coef, train)
    else:
        A, _, B = dy.shape
        if B < FUSED_MIN_RUN:
            k.elemt_channels_first_short(x, dy, out, coef, _short_group(B), train)
        else:
            k.elemt_channels_first(x, dy, out, coef, _channels_first_tiles(A, B)[1], train)


def _fuses(x: np.ndarray) -> bool:
    """Channels-first with runs of at least FUSED_MIN_RUN and enough channels to keep every
    thread busy: reduce each channel, then write it while it is still in cache."""
    return (not _uses_lanes(x) and x.shape[2] >= FUSED_MIN_RUN
            and x.shape[1] >= 4 * current_num_threads())


def forward_train(x, out, weight, bias, eps, count, dtype):
    """Training forward of float64 data in one pass where it fuses (see _fuses): writes ``out``
    and returns (mean, biased var) in float64, the same bits as bngrad.api's corrected two-pass
    moments followed by ``normalize``; returns None where it does not fuse (nothing done).

    Only float64 data fuse: their moments read the data twice, and fusing saves two of three
    passes ((32, 256, 28, 28): 8.2 -> 5.2 ms). With one-pass moments (other dtypes) fusing saves
    one pass but writes the output channel by channel, and fresh output pages then cost more
    than the pass saved ((32, 256, 56, 56) float32 with a new output: 11.6 -> 12.9 ms).
    """
    if x.dtype != np.float64 or not _fuses(x):
        return None
    A, C, B = x.shape
    rows, seg = _channels_first_tiles(A, B)
    mean, var = np.empty(C), np.empty(C)
    coef = np.empty((4, C), dtype=dtype)
    k.forward_channels_first_fused(x, out, weight, bias, float(eps), float(count), rows, seg,
                                   mean, var, coef)
    return mean, var


def backward_train(x, dy, out, mean, invstd, weight, count, dtype):
    """Training-mode reduce + grad_input; returns (sum_dy, sum_dy_xmu) in float64.

    Fused where _fuses(x); otherwise reduce, then apply. Both give the same bits.
    """
    C = x.shape[1]
    if _fuses(x):
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
    """out = (x - MEAN)*SCALE + BIAS per channel (the forward pass; rows of ``coef``)."""
    if _uses_lanes(x):
        _lanes_pass(k.normalize_channels_last, (x, out), coef)
    else:
        A, _, B = x.shape
        if B < FUSED_MIN_RUN:
            k.normalize_channels_first_short(x, out, coef, _short_group(B))
        else:
            k.normalize_channels_first(x, out, coef, _channels_first_tiles(A, B)[1])
