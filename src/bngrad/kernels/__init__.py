"""Kernel dispatch: runs a :class:`KernelPlan` on canonical kernel arrays.

Layers, bottom up: ``_elements`` (dtype codecs), ``_ops`` (the per-element maths, once),
``batchnorm`` (loops, work items, launchers), ``_plan`` (path, tiles, tuning constants); this
module sizes the work, spreads per-channel values over lanes and combines partial sums.

The fused variants' operands (bngrad.fused) are canonical arrays like x, or None: ``y`` (the
backward's ReLU record: the forward output, or mask bytes as uint8), ``z`` (the forward's side
input) and ``aux`` (the elementwise pass's second output: the forward's mask bytes, which also
selects the ReLU, or the backward's grad_side_input). The forward's mask may be bits instead:
``aux = (bits, 0)``, bits a zeroed 1-D uint8 array of ``ceil(x.size / 8)`` bytes, one bit per
element in x's memory order (element k: bit ``k % 8`` of byte ``k // 8``), packed in the
normalize pass. kernels.batchnorm describes them.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional, Tuple, Union

import numpy as np

from . import batchnorm as k
from ._elements import as_kernel_array, compute_dtype
from ._ops import BIAS, GRAD_MEAN, MEAN, PROJ, SCALE
from ._plan import PATHS, Config, KernelPlan, LanePiece, _ceil_div, forced_path, override, plan

__all__ = ["BIAS", "GRAD_MEAN", "MEAN", "PATHS", "PROJ", "SCALE", "Config", "KernelPlan",
           "as_kernel_array", "backward_train", "compute_dtype", "copy_rows", "elementwise",
           "forced_path", "forward_train", "override", "plan", "reduce", "train_coefficients",
           "transpose_last_two"]

# Who runs the work items: the launchers at the end of kernels.batchnorm (prange), the one
# seam to swap (see there).
launch = k


# the elementwise pass's second output: an array like out, the forward's mask bits with the
# flat index of out's first element, or None
Aux = Union[np.ndarray, Tuple[np.ndarray, int], None]

_scratch = threading.local()


@contextlib.contextmanager
def _partial_sums(shape: tuple[int, ...]) -> Iterator[np.ndarray]:
    """A float64 array for a reduction's partial sums (the kernels overwrite every element),
    reused by this thread's next calls: fresh pages cost a page fault each (docs/internals.md).
    Checked out while in use, so that a call nested on this thread (a signal handler or
    finaliser between the outer call's kernels) gets a fresh array instead of this one."""
    n = math.prod(shape)
    buffer = getattr(_scratch, "partial", None)
    _scratch.partial = None
    if buffer is None or buffer.size < n:
        buffer = np.empty(n)
    try:
        yield buffer[:n].reshape(shape)
    finally:
        _scratch.partial = buffer


# ---------------------------------------------------------------------------------------------
# rows of lanes: 2-D views of each piece, per-channel values spread over its lanes

def _piece_view(a: Optional[np.ndarray], piece: LanePiece) -> Optional[np.ndarray]:
    if a is None:
        return None
    if piece.spread == "repeat":
        return a.reshape(a.shape[0], piece.lanes)
    rows = a[piece.start:piece.stop]
    return rows if piece.spread is None else rows.reshape(-1, piece.lanes)


def _spread(values: np.ndarray, piece: LanePiece) -> np.ndarray:
    """Per-channel values (..., C) -> per-lane values (..., lanes)."""
    if piece.spread == "repeat":
        return np.repeat(values, piece.times, axis=-1)
    if piece.spread == "tile":
        return np.tile(values, (1,) * (values.ndim - 1) + (piece.times,))
    return values


def _add_lanes(total: np.ndarray, lane_sums: np.ndarray, piece: LanePiece) -> None:
    """total[c] += the sums of channel c's lanes, one lane at a time, in lane order."""
    if piece.spread is None:
        total += lane_sums
        return
    C = len(total)
    k.add_lanes(total, lane_sums.reshape(C, piece.times).T if piece.spread == "repeat"
                else lane_sums.reshape(piece.times, C))


def reduce(plan: KernelPlan, x: np.ndarray, dy: np.ndarray, mean: np.ndarray,
           shift: Optional[np.ndarray] = None, y: Optional[np.ndarray] = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(sum dy', sum dy'*(x - mean)) per channel in float64, where dy' = dy - shift (default 0);
    with dy = x and shift = mean, the second pass of the variance. Given ``y``, dy is first
    masked by the ReLU it records."""
    C = x.shape[1]
    shift = np.zeros(C) if shift is None else shift
    sums = (np.zeros(C), np.zeros(C))
    if plan.path == "lanes":
        for piece in plan.reduce_pieces:
            px, pdy, py = (_piece_view(a, piece) for a in (x, dy, y))
            assert px is not None
            M, L = px.shape
            with _partial_sums((_ceil_div(M, piece.rows), 2, L)) as partial:
                launch.reduce_lanes(partial.shape[0] * _ceil_div(L, piece.cols), px, pdy, py,
                                    _spread(mean, piece), _spread(shift, piece), piece.rows,
                                    piece.cols, partial)
                for i, total in enumerate(sums):  # blocks, then lanes, in a fixed order
                    lane_sums = np.zeros(L)
                    k.add_lanes(lane_sums, partial[:, i])
                    _add_lanes(total, lane_sums, piece)
        return sums
    A, _, B = x.shape
    with _partial_sums((plan.blocks, plan.segments, C, 2)) as partial:
        if plan.path == "short":  # never fused, so its own order
            launch.reduce_short(plan.blocks * _ceil_div(C, plan.group), x.reshape(A, C * B),
                                dy.reshape(A, C * B), None if y is None else y.reshape(A, C * B),
                                B, mean, shift, plan.rows, plan.group, partial)
        else:
            launch.reduce_runs(partial.shape[0] * partial.shape[1] * C, x, dy, y, mean,
                               shift, plan.rows, plan.seg, partial)
        k.combine_channels_first(partial, *sums)
    return sums


def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype) -> np.ndarray:
    """Training backward coefficient rows (SCALE, PROJ, GRAD_MEAN, MEAN; see kernels._ops)
    in ``dtype``, from float64 per-channel sums and statistics."""
    coef = np.empty((4, len(mean)), dtype=dtype)
    k.train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, float(count), coef)
    return coef


def _piece_aux(aux: Aux, piece: LanePiece, C: int) -> Aux:
    """The piece's part of ``aux``: its view, or for mask bits (bits, start) the flat index of
    its first element (rows start:stop of (M, C); "repeat" pieces start at 0)."""
    if isinstance(aux, tuple):
        return aux[0], aux[1] + piece.start * C
    return _piece_view(aux, piece)


def elementwise(plan: KernelPlan, out: np.ndarray, coef: np.ndarray,
                x: Optional[np.ndarray] = None, dy: Optional[np.ndarray] = None,
                y: Optional[np.ndarray] = None, z: Optional[np.ndarray] = None,
                aux: Aux = None) -> None:
    """out = kernels._ops.elementwise with the rows of ``coef``: given x and dy, the training
    grad_input; dy only, the eval grad_input; x only, the forward output. The fused operands
    y, z, aux: see the module's docstring (aux as mask bits: zeroed by the caller)."""
    if plan.path == "lanes":
        for piece in plan.elemt_pieces:
            px, pdy, py, pz, pout = (_piece_view(a, piece) for a in (x, dy, y, z, out))
            paux = _piece_aux(aux, piece, out.shape[1])
            assert pout is not None
            M, L = pout.shape
            launch.elementwise_lanes(_ceil_div(M, piece.rows) * _ceil_div(L, piece.cols), px,
                                     pdy, py, pz, pout, paux, _spread(coef, piece), piece.rows,
                                     piece.cols)
    else:  # short: groups of whole runs; runs, fused: run segments
        A, C, B = out.shape
        group, seg = (plan.group, B) if plan.path == "short" else (1, plan.seg)
        launch.elementwise_runs(A * _ceil_div(C, group) * _ceil_div(B, seg), x, dy, y, z, out,
                                aux, coef, group, seg)


def forward_train(plan: KernelPlan, x, out, weight, bias, eps, count, dtype, z=None, aux=None):
    """Training forward in one pass where the plan fuses and the data are float64 (whose
    two-pass moments it saves two of three passes; docs/internals.md): writes ``out`` (and
    ``aux``), returns (mean, biased var) in float64, the bits of bngrad.api's moments then
    normalize. Else None."""
    if x.dtype != np.float64 or plan.path != "fused":
        return None
    C = x.shape[1]
    mean, var = np.empty(C), np.empty(C)
    coef = np.zeros((4, C), dtype=dtype)
    launch.forward_fused(C, x, z, out, aux, weight, bias, float(eps), float(count), plan.rows,
                         plan.seg, mean, var, coef)
    return mean, var


def backward_train(plan: KernelPlan, x, dy, out, mean, invstd, weight, count, dtype, y=None,
                   aux=None):
    """Training reduce + grad_input (and ``aux``), fused where the plan says so (same bits as
    reduce, then elementwise); returns (sum_dy, sum_dy_xmu) in float64."""
    if plan.path == "fused":
        C = x.shape[1]
        sum_dy, sum_dy_xmu = np.empty(C), np.empty(C)
        coef = np.empty((4, C), dtype=dtype)
        launch.backward_fused(C, x, dy, y, out, aux, mean, invstd, weight, float(count),
                              plan.rows, plan.seg, sum_dy, sum_dy_xmu, coef)
        return sum_dy, sum_dy_xmu
    sum_dy, sum_dy_xmu = reduce(plan, x, dy, mean, y=y)
    coef = train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype)
    elementwise(plan, out, coef, x, dy, y=y, aux=aux)
    return sum_dy, sum_dy_xmu


# ---------------------------------------------------------------------------------------------
# layout copies (bngrad._layout)

def copy_rows(source: np.ndarray, out: np.ndarray) -> None:
    """out[i, :] = source[i, :], rows in parallel; ``source`` may have any strides."""
    launch.copy_rows(source.shape[0], source, out)


def transpose_last_two(source: np.ndarray, out: np.ndarray) -> None:
    """out[a, q, p] = source[a, p, q], both C-contiguous, in parallel tiles of 32 x 32."""
    A, C, B = out.shape
    launch.transpose_last_two(A * _ceil_div(C, 32) * _ceil_div(B, 32), source, out)
