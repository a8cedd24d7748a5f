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
import types
from typing import (Any, ContextManager, Iterable, Iterator, Optional, Protocol, Sequence, Tuple,
                    Union)

import numpy as np

from .. import _gomp
from . import _launch, _plan
from . import batchnorm as k
from ._elements import as_kernel_array, compute_dtype
from ._ops import BIAS, GRAD_MEAN, MEAN, PROJ, SCALE
from .. import _threads
from ._plan import (PATHS, Config, KernelPlan, LanePiece, _ceil_div, config, forced_path, override,
                    plan, runs_serial)

__all__ = ["BIAS", "GRAD_MEAN", "MEAN", "PATHS", "PROJ", "SCALE", "Config", "KernelPlan",
           "Operand", "RowSource", "as_kernel_array", "backward_train", "compute_dtype", "config",
           "copy_rows", "elementwise", "forced_path", "forward_train", "inv_std", "moments",
           "normalize_coefficients", "one_call_backward", "one_call_forward", "override",
           "param_grads", "plan", "reduce", "reduce_block_rows", "region", "thread_count",
           "train_coefficients", "transpose_last_two", "update_running_stats"]

# Who runs the work items (docs/internals.md, "How to add a threading backend"): a namespace
# of launchers, each running items 0..n-1 of one kernel. ``launch`` runs them on Numba's pool
# (kernels._launch; the seam a backend swaps), ``serial`` on the calling thread;
# :func:`launcher` chooses, for every launch, in this one place.
LAUNCHERS = _launch.LAUNCHERS
launch = _launch.numba_pool
serial = types.SimpleNamespace(**{name: getattr(k, name + "_serial") for name in LAUNCHERS})


def launcher(serial_call: bool, n: int) -> Any:
    """The launchers for ``n`` items of a call: serial for a serial call (small work or one
    thread: kernels._plan.runs_serial, which ``KernelPlan.serial`` records), or where there
    is one item only (nothing to share, and a launch would still wake the pool); else, for
    bngrad.torch's calls and for NumPy callers in a process that has imported PyTorch,
    PyTorch's OpenMP team (kernels._launch.torch_team; where bngrad._gomp.use_torch_team
    says so); else ``launch``, Numba's pool."""
    if serial_call or n < 2:
        return serial
    return _launch.torch_team if _gomp.use_torch_team() else launch


def _team(plan: KernelPlan) -> Optional[tuple[int, int, int]]:
    """How a one-call pass (kernels.batchnorm) runs its items: None on the calling thread (a
    serial call), else the team of the pool :func:`launcher` would choose
    (kernels._launch.team)."""
    return None if plan.serial else _launch.team(_gomp.use_torch_team(), plan.threads)


def region(plan: KernelPlan) -> ContextManager[Any]:
    """What a call planned by ``plan`` runs its kernels inside (``with``, beside
    :func:`thread_count`): the fork gate's lock (bngrad._threads.gate), or, for a serial call,
    nothing: no native thread is involved, so there is nothing for the fork gate to guard (a
    fork copies only the forking thread, and a serial kernel holds no lock of the pool's). A
    parallel launch of a serial call's (the layout's copies) opens its own region."""
    return _gate_if(not plan.serial)


def thread_count(plan: KernelPlan) -> ContextManager[Any]:
    """Numba's thread count for the plan's launches (bngrad._threads.thread_count), inside its
    :func:`region`; nothing for a serial call."""
    return _count_if(not plan.serial, plan.threads)


def _gate_if(parallel: bool) -> ContextManager[Any]:
    return _threads.gate() if parallel else _NO_REGION


def _count_if(parallel: bool, threads: int) -> ContextManager[Any]:
    return _threads.thread_count(threads) if parallel else _NO_REGION


_NO_REGION = contextlib.nullcontext()


# the elementwise pass's second output: an array like out, the forward's mask bits with the
# flat index of out's first element, or None; the backward's ReLU record y likewise (the
# forward's output, its mask bytes, or its mask bits with x's flat index)
Aux = Union[np.ndarray, Tuple[np.ndarray, int], None]

_scratch = threading.local()


def _partial_sums(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(array, buffer): a float64 array for a reduction's partial sums (the kernels overwrite
    every element) in ``buffer``, which this thread's next calls reuse: fresh pages cost a page
    fault each (docs/internals.md). Checked out until :func:`_return_partial_sums` gives the
    buffer back, so that a call nested on this thread (a signal handler or finaliser between
    the outer call's kernels) gets a fresh array instead of this one. (Two plain calls, not a
    context manager: a generator-based one costs more than a small reduction.)"""
    n = math.prod(shape)
    buffer = getattr(_scratch, "partial", None)
    _scratch.partial = None
    if buffer is None or buffer.size < n:
        buffer = np.empty(n)
    return buffer[:n].reshape(shape), buffer


def _return_partial_sums(buffer: np.ndarray) -> None:
    _scratch.partial = buffer


class RowSource(Protocol):
    """Canonical rows made on demand (bngrad._layout.RowCopies): x or dy where a whole copy
    would be needed. ``rows(r0, r1)``: rows r0..r1-1, C-contiguous, read-only, valid until the
    next call; ``row_bytes``: what a row costs to make; ``unit``: rows are made in whole units
    of this many (a chunk that starts or ends inside one makes all of it)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    row_bytes: int
    unit: int  # rows(r0, r1) copies whole units of this many rows

    def rows(self, r0: int, r1: int) -> np.ndarray: ...


# x and dy: canonical arrays, or sources of their rows. The passes take a source a chunk of
# rows at a time (_row_ranges); the fused operands (y, z, aux) come only with arrays.
Operand = Union[np.ndarray, RowSource]


def _rows(a: Optional[Operand], r0: int, r1: int) -> Optional[np.ndarray]:
    if a is None:
        return None
    return a[r0:r1] if isinstance(a, np.ndarray) else a.rows(r0, r1)


def _row_ranges(start: int, stop: int, align: int, *operands: Optional[Operand]
                ) -> Iterable[tuple[int, int]]:
    """Rows start..stop-1 in one range, or, where an operand is a RowSource, in chunks of a
    multiple of ``align`` rows (a reduction's row blocks, so that every block and every sum
    is the whole array's) making at most Config.copy_chunk_bytes of rows each (or one block);
    of whole units of the sources (which they copy whole) where such chunks fit the budget."""
    sources = [a for a in operands if a is not None and not isinstance(a, np.ndarray)]
    if not sources:
        return ((start, stop),)
    return _chunks(start, stop, align, sources)


def _chunks(start: int, stop: int, align: int, sources: list[RowSource]
            ) -> Iterator[tuple[int, int]]:
    budget, row_bytes = config().copy_chunk_bytes, sum(a.row_bytes for a in sources)
    whole_units = math.lcm(align, *(a.unit for a in sources))
    if whole_units * row_bytes <= budget:
        align = whole_units
    step = max(1, budget // (row_bytes * align)) * align
    for r0 in range(start, stop, step):
        yield r0, min(stop, r0 + step)


def reduce_block_rows(plan: KernelPlan) -> int:
    """Rows of the canonical array in a reduction's largest row block: the smallest chunk
    of rows a RowSource is taken in (tests/test_chunks.py sizes its budgets with it)."""
    if plan.path == "lanes":
        return max((p.rows * (p.times if p.spread == "tile" else 1) for p in plan.reduce_pieces),
                   default=1)
    return plan.rows


# ---------------------------------------------------------------------------------------------
# rows of lanes: 2-D views of each piece, per-channel values spread over its lanes

def _piece_view(rows: Optional[np.ndarray], piece: LanePiece) -> Optional[np.ndarray]:
    """Rows of a piece (all of them, or a chunk of them) as the piece's rows of lanes."""
    if rows is None or piece.spread is None:
        return rows
    return rows.reshape(-1, piece.lanes)


def _piece_rows(a: Optional[Operand], piece: LanePiece) -> Optional[np.ndarray]:
    """All rows of a piece of canonical array ``a`` as its rows of lanes (_piece_view of
    _rows, without the slice where the piece is the whole array: a small call's case)."""
    if a is None:
        return None
    assert isinstance(a, np.ndarray)  # (sources of rows are taken a chunk at a time)
    if piece.start or piece.stop != a.shape[0]:
        a = a[piece.start:piece.stop]
    return a if piece.spread is None else a.reshape(-1, piece.lanes)


def _spread(values: np.ndarray, piece: LanePiece) -> np.ndarray:
    """Per-channel values (C,) or (rows, C) -> per-lane values (..., lanes) (one compiled call:
    np.repeat and np.tile cost several microseconds each, on every small call)."""
    if piece.spread is None:
        return values
    if values.ndim == 1:  # (the common case, without the reshapes)
        lanes = np.empty(piece.lanes, values.dtype)
        k.spread_lanes(values[None], piece.spread == "repeat", piece.times, lanes[None])
        return lanes
    rows = values.reshape(-1, values.shape[-1])
    lanes = np.empty((rows.shape[0], piece.lanes), values.dtype)
    k.spread_lanes(rows, piece.spread == "repeat", piece.times, lanes)
    return lanes.reshape(values.shape[:-1] + (piece.lanes,))


def _lane_chunks(piece: LanePiece, block: int, x: Operand, dy: Optional[Operand],
                 partial: np.ndarray) -> Iterator[tuple]:
    """(x rows, dy rows, their partial sums) of a lanes piece a chunk at a time, for sources of
    rows (each chunk is made when the previous one is done with)."""
    for r0, r1 in _row_ranges(piece.start, piece.stop, block, x, dy):
        px = _piece_view(_rows(x, r0, r1), piece)
        assert px is not None
        j0 = (r0 - piece.start) // block
        yield (px, _piece_view(_rows(dy, r0, r1), piece),
               partial[j0:j0 + _ceil_div(px.shape[0], piece.rows)])


def reduce(plan: KernelPlan, x: Operand, dy: Optional[Operand], mean: np.ndarray,
           shift: Optional[np.ndarray] = None, y: Aux = None) -> tuple[np.ndarray, np.ndarray]:
    """(sum dy', sum dy'*(x - mean)) per channel in float64, where dy' = dy - shift (None: 0,
    and the backward's sums of half data go through float32 blocks, kernels._ops, taken again
    in float64 terms in the channels where bfloat16's overflowed: _widened). ``dy`` None: the
    moments' sums (sum d, sum d**2), d = x - mean, the values of dy = x and shift = mean in
    fewer operations. Given ``y`` (the forward's output, mask bytes, or mask bits with the
    flat index of x's first element), dy is first masked by the ReLU it records. Sources of
    rows give the bits of the arrays they stand for (chunks of whole row blocks)."""
    sums = _reduce(plan, x, dy, mean, shift, y)
    if dy is not None and shift is None and _overflowed(x, sums):
        return _widened(plan, x, dy, mean, y, sums)
    return sums


def _overflowed(x: Operand, sums: tuple[np.ndarray, np.ndarray]) -> bool:
    """Whether a backward's sums over bfloat16 data (x's kernel view uint16) are not all
    finite: bfloat16 has float32's range, so its float32 terms dy*(x - mean) overflow where
    |dy*(x - mean)| nears 3.4e38 (float16's stay below 1e10)."""
    return x.dtype == np.uint16 and not (np.isfinite(sums[0]).all()
                                         and np.isfinite(sums[1]).all())


def _widened(plan: KernelPlan, x: Operand, dy: Operand, mean: np.ndarray, y: Aux,
             sums: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The backward's ``sums`` over bfloat16 data, those of each channel whose float32 terms
    overflowed (a sum not finite) taken again in float64 terms (a zero shift selects them;
    kernels._ops): finite where the data are (as float32 data's sums, and the reference's);
    inf or NaN where they are not. The other channels keep their sums, so that a channel's
    bits never depend on another's data. Rare, so compiled when first needed."""
    wide = _reduce(plan, x, dy, mean, np.zeros(x.shape[1]), y)
    keep = np.isfinite(sums[0]) & np.isfinite(sums[1])
    return np.where(keep, sums[0], wide[0]), np.where(keep, sums[1], wide[1])


def _reduce(plan: KernelPlan, x: Operand, dy: Optional[Operand], mean: np.ndarray,
            shift: Optional[np.ndarray], y: Aux) -> tuple[np.ndarray, np.ndarray]:
    if dy is None:
        shift = mean
    C = x.shape[1]
    sums = (np.zeros(C), np.zeros(C))
    if plan.path == "lanes":
        arrays = isinstance(x, np.ndarray) and isinstance(dy, (np.ndarray, type(None)))
        for piece in plan.reduce_pieces:
            L = piece.lanes
            block = piece.rows * (piece.times if piece.spread == "tile" else 1)  # x's rows
            lane_mean = _spread(mean, piece)
            lane_shift = (lane_mean if shift is mean else None if shift is None
                          else _spread(shift, piece))
            py = _piece_aux(y, piece, C)
            partial, buffer = _partial_sums((_ceil_div(piece.stop - piece.start, block), 2, L))
            try:
                chunks = (((_piece_rows(x, piece), _piece_rows(dy, piece), partial),) if arrays
                          else _lane_chunks(piece, block, x, dy, partial))
                for px, pdy, part in chunks:
                    n = part.shape[0] * _ceil_div(L, piece.cols)
                    launcher(plan.serial, n).reduce_lanes(n, px, pdy, py, lane_mean, lane_shift,
                                                          piece.rows, piece.cols, part)
                # blocks, then lanes, in a fixed order
                k.combine_lanes(partial, piece.spread == "repeat", piece.times, *sums)
            finally:
                _return_partial_sums(buffer)
        return sums
    A, _, B = x.shape
    partial, buffer = _partial_sums((plan.blocks, plan.segments, C, 2))
    try:
        for r0, r1 in _row_ranges(0, A, plan.rows, x, dy):
            xr, dyr = _rows(x, r0, r1), _rows(dy, r0, r1)
            assert xr is not None
            part = partial[r0 // plan.rows:_ceil_div(r1, plan.rows)]
            if plan.short:  # its own order, which only fused_short's backward shares
                a = r1 - r0
                n = part.shape[0] * _ceil_div(C, plan.group)
                launcher(plan.serial, n).reduce_short(
                    n, xr.reshape(a, C * B), None if dyr is None else dyr.reshape(a, C * B),
                    y if y is None or isinstance(y, tuple) else y.reshape(A, C * B), B, mean,
                    shift, plan.rows, plan.group, part)
            else:
                n = part.shape[0] * part.shape[1] * C
                launcher(plan.serial, n).reduce_runs(n, xr, dyr, y, mean, shift, plan.rows,
                                                     plan.seg, part)
        k.combine_channels_first(partial, *sums)
    finally:
        _return_partial_sums(buffer)
    return sums


def moments(shift: np.ndarray, sum_d: np.ndarray, sum_d2: np.ndarray, count: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """(mean, biased var) in float64 from the sums of d = x - shift and d**2 over ``count``
    elements per channel (bngrad.api._moments)."""
    mean, var = np.empty(len(shift)), np.empty(len(shift))
    k.finish_moments(shift, sum_d, sum_d2, float(count), mean, var)
    return mean, var


def update_running_stats(running_mean: Optional[np.ndarray], running_var: Optional[np.ndarray],
                         mean: np.ndarray, var: np.ndarray, momentum: float, count: int) -> None:
    """running = (1 - momentum) * running + momentum * batch statistic, in place (None:
    skipped); the variance's batch statistic is unbiased (count 1: NaN, as in PyTorch).
    float32 and float64 in one compiled call for both (kernels.batchnorm.update_running_pair);
    halves by NumPy, in float64 and rounded once to the half type (correctly rounded, as
    PyTorch's float16 update; its bfloat16 update rounds twice, a unit off in about a third
    of the channels)."""
    if ((running_mean is None or running_mean.dtype in _COMPILED_STATS)
            and (running_var is None or running_var.dtype in _COMPILED_STATS)):
        if running_mean is not None or running_var is not None:
            k.update_running_pair(running_mean, running_var, mean, var, float(momentum),
                                  int(count))
        return
    for running, stat, unbiased in ((running_mean, mean, False), (running_var, var, True)):
        if running is None:
            continue
        if running.dtype in _COMPILED_STATS:
            k.update_running(running, stat, float(momentum), int(count), unbiased)
        else:
            # inf statistics: NaN, and beyond the running statistics' dtype (float16): inf,
            # both without NumPy's warnings
            with np.errstate(invalid="ignore", over="ignore"):
                batch = (stat if not unbiased else stat * count / (count - 1) if count > 1
                         else np.full(len(stat), np.nan))
                running[...] = (1 - momentum) * running.astype(np.float64) + momentum * batch


_COMPILED_STATS = frozenset((np.dtype(np.float32), np.dtype(np.float64)))


def param_grads(sum_dy: np.ndarray, sum_dy_xmu: np.ndarray, invstd: np.ndarray,
                mask: Sequence[bool], dtype: np.dtype
                ) -> tuple[Optional[np.ndarray], Optional[np.ndarray]]:
    """(grad_weight = sum_dy_xmu * invstd, grad_bias = sum_dy) as ``mask[1:]`` asks, in the
    parameters' ``dtype``: inf where they leave its range (a float16 weight's gradients under
    loss scaling), NaN for 0 x inf (an infinite invstd), as PyTorch gives them, and without
    NumPy's warnings, which under ``-W error`` would be raised instead of the result. float32
    and float64 in one compiled call (kernels.batchnorm.param_grads: the same bits); halves by
    NumPy, rounded once from float64 (a compiled cast would round through float32 first)."""
    if dtype in _COMPILED_STATS:
        C = len(sum_dy)
        grad_weight = np.empty(C, dtype) if mask[1] else None
        grad_bias = np.empty(C, dtype) if mask[2] else None
        k.param_grads(sum_dy, sum_dy_xmu, invstd, grad_weight, grad_bias)
        return grad_weight, grad_bias
    with np.errstate(over="ignore", invalid="ignore"):
        return ((sum_dy_xmu * invstd).astype(dtype) if mask[1] else None,
                sum_dy.astype(dtype) if mask[2] else None)


def normalize_coefficients(mean: np.ndarray, var: np.ndarray, eps: float, weight: np.ndarray,
                           bias: np.ndarray, dtype: np.dtype, train: bool = True
                           ) -> tuple[np.ndarray, np.ndarray]:
    """(invstd in float64, the normalize pass's coefficient rows in ``dtype``: SCALE =
    invstd * weight, BIAS, MEAN) from float64 statistics and parameters (var: the batch's in
    ``train``ing, else the running one; invstd where var + eps is 0: inv_std)."""
    invstd, coef = np.empty(len(mean)), np.empty((4, len(mean)), dtype=dtype)
    k.normalize_coefficients(mean, var, float(eps), weight, bias, invstd, coef, bool(train))
    return invstd, coef


def inv_std(var: np.ndarray, eps: float, train: bool) -> np.ndarray:
    """1 / sqrt(var + eps) in float64 where var + eps is 0 too (var and eps both 0): 0 in
    training (PyTorch's InvStd: the channel's output is its bias, its grad_input 0), inf in
    eval (PyTorch's 1 / sqrt(running_var + eps)); never a warning."""
    invstd = np.empty(len(var))
    k.inv_stds(np.asarray(var, np.float64), float(eps), bool(train), invstd)
    return invstd


def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, dtype) -> np.ndarray:
    """Training backward coefficient rows (SCALE, PROJ, GRAD_MEAN, MEAN; see kernels._ops)
    in ``dtype``, from float64 per-channel sums and statistics."""
    coef = np.empty((4, len(mean)), dtype=dtype)
    k.train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, float(count), coef)
    return coef


def _piece_aux(aux: Aux, piece: LanePiece, C: int) -> Aux:
    """The piece's part of ``aux``: None, its view, or for mask bits (bits, start) the flat
    index of its first element (rows start:stop of (M, C); "repeat" pieces start at 0)."""
    if isinstance(aux, tuple):
        return aux[0], aux[1] + piece.start * C
    return _piece_rows(aux, piece)


def elementwise(plan: KernelPlan, out: np.ndarray, coef: np.ndarray,
                x: Optional[Operand] = None, dy: Optional[Operand] = None,
                y: Aux = None, z: Optional[np.ndarray] = None, aux: Aux = None) -> None:
    """out = kernels._ops.elementwise with the rows of ``coef``: given x and dy, the training
    grad_input; dy only, the eval grad_input; x only, the forward output. The fused operands
    y, z, aux: see the module's docstring (aux as mask bits: zeroed by the caller). Sources
    of rows are taken a chunk at a time, each chunk planned on its own (elementwise results do
    not depend on the tiles)."""
    if not isinstance(x, (np.ndarray, type(None))) or not isinstance(dy, (np.ndarray, type(None))):
        for r0, r1 in _row_ranges(0, out.shape[0], 1, x, dy):
            xr, dyr = _rows(x, r0, r1), _rows(dy, r0, r1)
            rows = out[r0:r1]
            elementwise(_plan.plan(rows, plan.threads), rows, coef, xr, dyr)
        return
    # lanes; and the training grad_input of the short kernels' runs shorter than short_run
    # (wide rows) as the lanes path writes it (the same values, the same bits): run by run,
    # such runs cost more in loop overhead than in arithmetic (1.6x at (64, 512, 16))
    if plan.path == "lanes" or (plan.elemt_pieces and x is not None and dy is not None):
        for piece in plan.elemt_pieces:
            pout = _piece_rows(out, piece)
            assert pout is not None
            px, pdy, pz = _piece_rows(x, piece), _piece_rows(dy, piece), _piece_rows(z, piece)
            py, paux = _piece_aux(y, piece, out.shape[1]), _piece_aux(aux, piece, out.shape[1])
            M, L = pout.shape
            n = _ceil_div(M, piece.rows) * _ceil_div(L, piece.cols)
            launcher(plan.serial, n).elementwise_lanes(n, px, pdy, py, pz, pout, paux,
                                                       _spread(coef, piece), piece.rows,
                                                       piece.cols)
    else:  # short: groups of whole runs; runs, fused: run segments
        A, C, B = out.shape
        group, seg = (plan.group, B) if plan.short else (1, plan.seg)
        n = A * _ceil_div(C, group) * _ceil_div(B, seg)
        launcher(plan.serial, n).elementwise_runs(n, x, dy, y, z, out, aux, coef, group, seg)


def forward_train(plan: KernelPlan, x, out, weight, bias, eps, count, dtype, z=None, aux=None):
    """Training forward in one pass over memory where the plan fuses (a channel, or a group of
    channels, reduced, then normalized while it is in cache; float64's two-pass moments read
    it twice more from cache), or in one compiled call where the plan says so and there are no
    fused operands: writes ``out`` (and ``aux``), returns (mean, biased var) in float64 and
    invstd (normalize_coefficients'), the bits of bngrad.api's moments then normalize. Else
    None."""
    if not isinstance(x, np.ndarray):
        return None
    if plan.one_call and z is None and aux is None:  # moments, coefficients, normalize
        return one_call_forward(plan, x, out, weight, bias, eps, count, dtype)
    if plan.path not in ("fused", "fused_short"):
        return None
    C = x.shape[1]
    coef = np.empty((4, C), dtype=dtype)
    mean, var, invstd = np.empty(C), np.empty(C), np.empty(C)
    two_pass = x.dtype == np.float64  # (bngrad.api._moments)
    n = _ceil_div(C, plan.fused_group)  # an item per group of channels
    if plan.path == "fused":
        launcher(plan.serial, n).forward_fused(n, x, z, out, aux, two_pass, weight, bias,
                                               float(eps), float(count), plan.rows, plan.seg,
                                               plan.fused_group, mean, var, invstd, coef)
    else:
        launcher(plan.serial, n).forward_fused_short(n, x, z, out, aux, two_pass, weight, bias,
                                                     float(eps), float(count), plan.rows,
                                                     plan.fused_group, mean, var, invstd, coef)
    return mean, var, invstd


def one_call_forward(plan: KernelPlan, x: np.ndarray, out: np.ndarray, weight: np.ndarray,
                     bias: np.ndarray, eps: float, count: int, dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`forward_train` of a plain call on a ``one_call`` plan (x and out dense arrays):
    the moments, the coefficients and the normalize pass in one compiled call; returns (mean,
    biased var, invstd) in float64."""
    C = x.shape[1]
    stats = np.empty((3, C))
    k.forward_one_call(x, out, np.zeros(C) if x.dtype == np.float64 else None, weight, bias,
                       float(eps), float(count), plan.one_call_lanes, plan.one_call_tiles,
                       stats, np.empty((4, C), dtype=dtype), _team(plan))
    return stats[0], stats[1], stats[2]


def one_call_backward(plan: KernelPlan, x: np.ndarray, dy: np.ndarray, out: np.ndarray,
                      mean: np.ndarray, invstd: np.ndarray, weight: np.ndarray, count: int,
                      dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """:func:`backward_train` of a plain call on a ``one_call`` plan (x, dy and out dense
    arrays): the sums, the coefficients and grad_input in one compiled call; returns (sum_dy,
    sum_dy_xmu) in float64."""
    C = x.shape[1]
    sums = np.zeros((2, C))
    k.backward_one_call(x, dy, out, mean, invstd, weight, float(count), plan.one_call_lanes,
                        plan.one_call_tiles, sums, np.empty((4, C), dtype=dtype), _team(plan))
    return sums[0], sums[1]


def backward_train(plan: KernelPlan, x, dy, out, mean, invstd, weight, count, dtype, y=None,
                   aux=None):
    """Training reduce + grad_input (and ``aux``), fused where the plan says so (same bits as
    reduce, then elementwise), or in one compiled call where the plan says so and there are
    no fused operands; returns (sum_dy, sum_dy_xmu) in float64."""
    if (plan.one_call and y is None and aux is None and isinstance(x, np.ndarray)
            and isinstance(dy, np.ndarray)):
        sums = one_call_backward(plan, x, dy, out, mean, invstd, weight, count, dtype)
        return _rewritten_if_overflowed(plan, x, dy, out, mean, invstd, weight, count, dtype,
                                        None, None, sums)
    if plan.path in ("fused", "fused_short") and isinstance(x, np.ndarray) and isinstance(
            dy, np.ndarray):
        C = x.shape[1]
        sum_dy, sum_dy_xmu = np.empty(C), np.empty(C)
        coef = np.empty((4, C), dtype=dtype)
        n = _ceil_div(C, plan.fused_group)  # an item per group of channels
        if plan.path == "fused":
            launcher(plan.serial, n).backward_fused(n, x, dy, y, out, aux, mean, invstd, weight,
                                                    float(count), plan.rows, plan.seg,
                                                    plan.fused_group, sum_dy, sum_dy_xmu, coef)
        else:
            launcher(plan.serial, n).backward_fused_short(
                n, x, dy, y, out, aux, mean, invstd, weight, float(count), plan.rows,
                plan.fused_group, plan.span_loop, sum_dy, sum_dy_xmu, coef)
        return _rewritten_if_overflowed(plan, x, dy, out, mean, invstd, weight, count, dtype,
                                        y, aux, (sum_dy, sum_dy_xmu))
    # (widened where overflowed, before out is written; but as the one-pass paths, which
    # cannot, where out is the memory of x, dy or the record: the same bits on every path)
    sums = _reduce(plan, x, dy, mean, None, y)
    if _overflowed(x, sums) and not _in_operands(out, x, dy, y):
        sums = _widened(plan, x, dy, mean, y, sums)
    return _write_grad_input(plan, x, dy, out, mean, invstd, weight, count, dtype, y, aux, sums)


def _in_operands(out: np.ndarray, x: Operand, dy: Operand, y: Aux) -> bool:
    """Whether ``out`` may share memory with x, dy or the ReLU's record ``y`` (an out= of
    grad_out, input or the forward's output, or grad_out copied into grad_input's buffer)."""
    record = y[0] if isinstance(y, tuple) else y  # (mask bits: their array)
    return any(isinstance(a, np.ndarray) and np.may_share_memory(out, a)
               for a in (x, dy, record))


def _write_grad_input(plan: KernelPlan, x: Operand, dy: Operand, out: np.ndarray,
                      mean, invstd, weight, count, dtype, y: Aux, aux: Aux,
                      sums: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The two-phase backward's second pass: grad_input (and ``aux``) from ``sums``; returns
    them."""
    coef = train_coefficients(*sums, mean, invstd, weight, count, dtype)
    elementwise(plan, out, coef, x, dy, y=y, aux=aux)
    return sums


def _rewritten_if_overflowed(plan: KernelPlan, x: np.ndarray, dy: np.ndarray, out: np.ndarray,
                             mean, invstd, weight, count, dtype, y: Aux, aux: Aux,
                             sums: tuple[np.ndarray, np.ndarray]
                             ) -> tuple[np.ndarray, np.ndarray]:
    """After a pass that summed and wrote grad_input at once: where bfloat16's float32 terms
    overflowed (_overflowed), those channels' sums again in float64 terms (_widened) and
    grad_input (and ``aux``) written again with them, unless ``out`` is the memory of x, dy or
    the ReLU's record ``y``, already overwritten (_in_operands): NaN there, as PyTorch's (and
    as the two-phase path, which could widen, leaves it)."""
    if not _overflowed(x, sums) or _in_operands(out, x, dy, y):
        return sums
    return _write_grad_input(plan, x, dy, out, mean, invstd, weight, count, dtype, y, aux,
                             _widened(plan, x, dy, mean, y, sums))


# ---------------------------------------------------------------------------------------------
# layout copies (bngrad._layout)

def copy_rows(source: np.ndarray, out: np.ndarray, threads: int) -> None:
    """out[i, :] = source[i, :], in blocks of rows of about ``Config.copy_block`` elements,
    in parallel on ``threads`` threads where it pays; ``source`` may have any strides."""
    rows = max(1, config().copy_block // max(1, out.shape[1]))
    n = _ceil_div(out.shape[0], rows)
    run = launcher(runs_serial(out.size, threads), n)
    with _gate_if(run is not serial), _count_if(run is not serial, threads):
        run.copy_rows(n, source, out, rows)


def transpose_last_two(source: np.ndarray, out: np.ndarray, threads: int) -> None:
    """out[a, q, p] = source[a, p, q], both C-contiguous, in tiles of
    ``TRANSPOSE_ROWS x TRANSPOSE_COLS`` of the source (kernels.batchnorm), in parallel on
    ``threads`` threads where it pays."""
    A, C, B = out.shape
    n = A * _ceil_div(C, k.TRANSPOSE_COLS) * _ceil_div(B, k.TRANSPOSE_ROWS)
    run = launcher(runs_serial(out.size, threads), n)
    with _gate_if(run is not serial), _count_if(run is not serial, threads):
        run.transpose_last_two(n, source, out)
