"""The kernel plan: the path and tiles for a canonical array, decided once per call.

:func:`plan` maps a canonical array's shape (bngrad._layout) and the thread count to a frozen,
cached :class:`KernelPlan` (docs/internals.md maps shapes to paths, with examples):

- ``lanes``: 2-D rows, and channels-first runs shorter than ``short_run`` viewed as rows of
  ``C*B`` lanes (but wide rows of runs of ``wide_run`` or more in few rows: ``short``).
  Narrow channels-last rows are folded (``k`` rows into one, a view; rather a ``k`` down to
  half as large that divides M, else the ``M % k`` leftover rows are a second piece). Lane
  sums go to their channel in lane order;
- ``short``: runs of ``short_run..fused_min_run`` (and the wide rows above), an item per
  group of whole channels;
- ``fused_short``: as ``short``, but the training backward and forward reduce a group of
  channels (about ``fused_group_elements`` elements) and write it while it is in cache, if
  ``C >= fused_channels_per_thread * threads`` and ``A <= fused_short_max_rows``;
- ``runs``: longer runs, an item per tile (reductions) or run segment (elementwise);
- ``fused``: as ``runs``, but the training backward and forward reduce a group of channels
  (about ``fused_runs_group_bytes`` of x and dy, read a row at a time) and write it while it
  is in cache, if ``C >= fused_channels_per_thread * threads``.

``fused`` and ``runs`` share tiles and order (kernels.batchnorm), as do ``fused_short`` and
``short``, so the one choice that depends on the thread count (to fuse or not) gives the same
bits (tests/test_paths.py); all others depend on the shape.

:func:`runs_serial` decides, for every call, whether its items run on the calling thread (the
serial launchers) instead of Numba's pool: when one thread is asked for, or when the work is
too small for a parallel launch to pay (``Config.serial_elements``). The items and their order
are the same either way, so is every bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .._threads import current_num_threads

PATHS = ("lanes", "short", "fused_short", "runs", "fused")


def cache_bytes(level: int, root: str = "/sys/devices/system/cpu/cpu0/cache",
                default: int = 1 << 20) -> int:
    """The first CPU's data or unified cache of ``level`` (its size as the OS reports it; a
    level-3 cache is shared), from Linux's sysfs; ``default`` where it cannot be read (another
    OS, a container hiding it)."""
    def read(index: str, name: str) -> str:
        with open(os.path.join(root, index, name)) as f:
            return f.read().strip()
    try:
        for index in sorted(os.listdir(root)):
            if read(index, "level") == str(level) and read(index, "type") in ("Data", "Unified"):
                size = read(index, "size")  # e.g. "1024K"
                scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
                return int(size.rstrip("KM")) * scale
    except (OSError, ValueError):
        pass
    return default


def compile_cpu() -> str:
    """The CPU the kernels are compiled for, as LLVM names it ("znver4", "sapphirerapids",
    ...): Numba's ``NUMBA_CPU_NAME`` where set, else the host's."""
    from llvmlite import binding
    from numba.core import config
    name = config.CPU_NAME
    return name if name and name != "host" else binding.get_host_cpu_name()


@dataclass(frozen=True)
class Config:
    """The tuning constants (why each value, and how to re-measure it: docs/internals.md)."""

    tile: int = 1 << 14               # elements per reduction tile
    column_group: int = 8192          # at most this many lanes per channels-last tile
    max_row_blocks: int = 64          # row blocks per lane reduction: enough for 64 threads,
    partial_bytes: int = 1 << 21      # but at most this many bytes of partial sums
    min_block_rows: int = 128         # and at least this many rows per block
    reduce_items_per_thread: int = 4  # fewer row blocks: the lanes split into column groups,
    min_reduce_cols: int = 256        # of at least this many lanes, to make this many items
    fold_lanes: int = 4096            # narrower channels-last rows are folded, for reductions
    elemt_lanes: int = 256            # and for elementwise passes
    short_run: int = 32               # shorter channels-first runs are seen as lanes,
    # but for runs of at least wide_run, wide rows of at least wide_lanes lanes (C*B) and few
    # rows (A <= fused_short_max_rows) take the short kernels: there the lanes' per-lane work
    # (sums and coefficients per lane, spread and combined on the calling thread) outweighs
    # the data (docs/internals.md)
    wide_run: int = 16
    wide_lanes: int = 8192
    fused_min_run: int = 256          # shorter runs take the short kernels (fused_short)
    short_group_lanes: int = 1536     # lanes per task of the short kernels
    fused_channels_per_thread: int = 4  # fewer channels per thread leave threads idle: no fusing
    # elements of x per fused_short item: its float32 x and dy fill the L2 cache (one core's),
    # up to 1 MiB of them (a 2 MiB L2 filled ran 15-20% slower: docs/internals.md)
    fused_group_elements: int = min(cache_bytes(2) // 8, 1 << 17)
    # bytes of x and dy per fused item (a group of whole channels; float32: 8 per element):
    # four L2 caches' worth, which the item's second pass reads from the L3 cache, the groups
    # of all threads taking at most a quarter of it (_plan). Runs of a few KiB a channel at a
    # time, each a sample's stride from the last, ran 30-40% slower (docs/internals.md)
    fused_runs_group_bytes: int = 4 * cache_bytes(2)
    l3_bytes: int = cache_bytes(3, default=1 << 24)
    # and at most this many rows: a group's rows lie a sample apart in memory, and more of them
    # conflict in the cache before the group is written (docs/internals.md)
    fused_short_max_rows: int = 64
    # fused_short's training backward writes runs shorter than this in one loop over each
    # row's span of the group, with per-lane coefficients, instead of run by run: where that
    # was measured to pay (an Intel Xeon), not on AMD's Zen cores, where it cost 10-15%
    # (docs/internals.md)
    span_runs_below: int = 0 if compile_cpu().startswith("znver") else 64
    # elements whose serial work costs about a call's parallel launches (waking the pool):
    # smaller calls run serially (runs_serial scales it by the threads and halves it for a
    # fused path's one launch; docs/internals.md)
    serial_elements: int = 1 << 15
    # an array that is not dense in the kernels' order (grad_out in another layout than input, a
    # sliced input) is copied whole if no larger, else this many bytes of rows at a time
    copy_chunk_bytes: int = 1 << 23
    # elements per work item of such a copy (whole rows; a row per item at the least)
    copy_block: int = 1 << 12


_config = Config()
_forced: Optional[str] = None


@contextlib.contextmanager
def override(**values: int) -> Iterator[Config]:
    """Tests: run the enclosed calls with some tuning constants changed (not thread-safe)."""
    global _config
    previous, _config = _config, dataclasses.replace(_config, **values)
    _plans.clear()
    try:
        yield _config
    finally:
        _config = previous
        _plans.clear()


@contextlib.contextmanager
def forced_path(path: str) -> Iterator[None]:
    """Tests: make every call take ``path`` (not thread-safe); 2-D arrays have only lanes, and
    a call on one under another forced path raises ValueError."""
    global _forced
    if path not in PATHS:
        raise ValueError(f"unknown kernel path {path!r}; expected one of {PATHS}")
    previous, _forced = _forced, path
    _plans.clear()
    try:
        yield
    finally:
        _forced = previous
        _plans.clear()


def config() -> Config:
    """The tuning constants in force."""
    return _config


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def runs_serial(elements: int, threads: int) -> bool:
    """Whether a call on ``elements`` elements with ``threads`` threads runs serially.

    A launch on t threads saves at most (1 - 1/t) of the serial time, so it cannot pay unless
    that exceeds the launches' own cost, ``serial_elements`` elements' worth of serial work
    (a call's two launches: a reduction, then an elementwise pass): serial below
    ``serial_elements * t / (t - 1)`` elements, and always on one thread. A call that
    launches once (``one_launch``: the fused paths' training calls, whose items reduce and
    write their channels) pays from half that.
    """
    return _runs_serial(_config, elements, threads)


def _runs_serial(cfg: Config, elements: int, threads: int, one_launch: bool = False) -> bool:
    launch_cost = cfg.serial_elements // 2 if one_launch else cfg.serial_elements
    return threads <= 1 or elements * (threads - 1) < launch_cost * threads


@dataclass(frozen=True)
class LanePiece:
    """Rows ``start:stop`` of a 2-D array seen as rows of ``lanes`` lanes: lane ``c*times + b``
    (``spread`` "repeat": runs as lanes), lane ``i*C + c`` ("tile": ``times`` rows folded into
    one) or lane == channel (None); tiles of ``rows`` rows x ``cols`` lanes."""

    start: int
    stop: int
    spread: Optional[str]
    times: int
    lanes: int
    rows: int
    cols: int

    def __repr__(self) -> str:
        view = {None: "as is", "repeat": f"runs of {self.times} as lanes",
                "tile": f"{self.times} rows folded"}[self.spread]
        return (f"rows {self.start}:{self.stop} ({view}, {self.lanes} lanes): "
                f"tiles of {self.rows} rows x {self.cols} lanes")


@dataclass(frozen=True)
class KernelPlan:
    """The path and tiles for one canonical array shape. Channels-first: reduction tiles of
    ``rows`` rows x ``seg`` elements of a run (elementwise ``runs`` items: one segment),
    ``short`` items of ``group`` channels, ``fused`` and ``fused_short``'s training items of
    ``fused_group`` channels. ``lanes``: the pieces of each pass."""

    path: str
    shape: tuple[int, ...]
    threads: int
    forced: bool = False
    serial: bool = False  # the items run on the calling thread (runs_serial)
    # a training backward or forward runs as one compiled call (the one-call passes of
    # kernels.batchnorm): a call on the lanes path whose passes take one piece each; the same
    # items in the same order, so the same bits
    one_call: bool = False
    rows: int = 0
    seg: int = 0
    group: int = 0
    fused_group: int = 0
    span_loop: bool = False  # fused_short's backward writes a row's span of a group at once
    reduce_pieces: tuple[LanePiece, ...] = ()
    # (also the short kernels' for runs shorter than short_run, wide rows: their training
    # grad_input is written as the lanes path writes it, with per-lane coefficients)
    elemt_pieces: tuple[LanePiece, ...] = ()
    # a one-call plan's two pieces (each the whole array) as the one-call passes take them: the
    # lanes of their rows (0: the canonical array as it is), and (spread "repeat", times, rows,
    # cols) of the reduction's piece, then of the elementwise pass's
    one_call_lanes: tuple[int, int] = (0, 0)
    one_call_tiles: tuple = ()

    @property
    def short(self) -> bool:
        """Whether the passes take the short kernels (fused_short's, but for its backward)."""
        return self.path in ("short", "fused_short")

    @property
    def blocks(self) -> int:
        return _ceil_div(self.shape[0], self.rows)

    @property
    def segments(self) -> int:
        return 1 if self.short else _ceil_div(self.shape[2], self.seg)

    def __repr__(self) -> str:
        head = (f"KernelPlan(path={self.path!r}{' (forced)' if self.forced else ''}, "
                f"shape={self.shape}, threads={self.threads}{' (serial)' if self.serial else ''}")
        if self.path == "lanes":
            return "\n  ".join([head + ")", "reduce:"] + [f"  {p!r}" for p in self.reduce_pieces]
                               + ["elementwise:"] + [f"  {p!r}" for p in self.elemt_pieces])
        if self.short:
            fused = (f", fused in {_ceil_div(self.shape[1], self.fused_group)} groups of "
                     f"{self.fused_group}{', span loops' if self.span_loop else ''}"
                     if self.path == "fused_short" else "")
            lanes = ", training elementwise as lanes" if self.elemt_pieces else ""
            return (f"{head}, {self.blocks} row blocks of {self.rows}, "
                    f"{_ceil_div(self.shape[1], self.group)} groups of {self.group} channels"
                    f"{fused}{lanes})")
        fused = (f", fused in {_ceil_div(self.shape[1], self.fused_group)} groups of "
                 f"{self.fused_group}" if self.path == "fused" else "")
        return (f"{head}, tiles of {self.rows} rows x {self.seg} elements, "
                f"{self.blocks} x {self.segments} per channel{fused})")


def _lane_pieces(cfg: Config, shape: tuple[int, ...], min_lanes: int, reduce: bool,
                 threads: int) -> tuple[LanePiece, ...]:
    def piece(start, stop, spread, times, lanes):
        cols = min(lanes, cfg.column_group)
        rows = max(1, cfg.tile // max(cols, 1))  # elementwise
        if reduce:  # blocks: <= max_row_blocks and partial_bytes (2 float64 per lane), and
            # >= tile elements and min_block_rows rows each
            M = (stop - start) // times if spread == "tile" else stop - start
            blocks = min(cfg.max_row_blocks, cfg.partial_bytes // (16 * max(lanes, 1)),
                         M * cols // cfg.tile, M // cfg.min_block_rows)
            rows = _ceil_div(M, max(1, blocks))
            # Few row blocks: narrower column groups, so that every thread has items. A lane's
            # sum runs over the rows only, so the column groups, unlike the row blocks, may
            # follow the thread count without changing a bit.
            if M and lanes:
                groups = _ceil_div(cfg.reduce_items_per_thread * threads, _ceil_div(M, rows))
                if groups > _ceil_div(lanes, cols):
                    cols = min(cols, max(cfg.min_reduce_cols,
                                         _ceil_div(_ceil_div(lanes, groups), 64) * 64))
        return LanePiece(start, stop, spread, times, lanes, rows, cols)

    if len(shape) == 3:
        A, C, B = shape
        return (piece(0, A, "repeat", B, C * B),)
    M, C = shape
    fold = min(M, _ceil_div(min_lanes, max(C, 1)))
    if C == 0 or fold <= 1:
        return (piece(0, M, None, 1, C),) if M else ()
    # rather a fold down to half as wide that divides the rows: one piece, which a small call
    # takes in one compiled call (KernelPlan.one_call), where two pieces cost it a dozen
    # Python steps ((196, 256): 4 x 7 x 7 maps, channels-last)
    fold = next((k for k in range(fold, fold // 2, -1) if M % k == 0), fold)
    cut = M - M % fold
    pieces = [piece(0, cut, "tile", fold, fold * C)]
    if cut < M:
        pieces.append(piece(cut, M, None, 1, C))
    return tuple(pieces)


def _runs_as_lanes(cfg: Config, shape: tuple[int, ...]) -> bool:
    """Whether channels-first ``(A, C, B)`` takes the lanes path (by its shape alone, so
    that the choice cannot depend on the thread count)."""
    A, C, B = shape
    wide = B >= cfg.wide_run and C * B >= cfg.wide_lanes and A <= cfg.fused_short_max_rows
    return B < cfg.short_run and not wide


def _plan(shape: tuple[int, ...], threads: int, cfg: Config, forced: Optional[str]
          ) -> KernelPlan:
    if forced not in (None, "lanes") and len(shape) == 2:
        raise ValueError(f"path {forced!r} needs channels-first (A, C, B) data, got {shape}")
    elements = math.prod(shape)
    if len(shape) == 2 or forced == "lanes" or (forced is None and _runs_as_lanes(cfg, shape)):
        serial = _runs_serial(cfg, elements, threads)
        reduce_pieces = _lane_pieces(cfg, shape, cfg.fold_lanes, True, threads)
        elemt_pieces = _lane_pieces(cfg, shape, cfg.elemt_lanes, False, threads)
        if len(reduce_pieces) != 1 or len(elemt_pieces) != 1:
            return KernelPlan("lanes", shape, threads, forced is not None, serial,
                              reduce_pieces=reduce_pieces, elemt_pieces=elemt_pieces)
        r, e = reduce_pieces[0], elemt_pieces[0]
        return KernelPlan("lanes", shape, threads, forced is not None, serial, True,
                          reduce_pieces=reduce_pieces, elemt_pieces=elemt_pieces,
                          one_call_lanes=(r.lanes if r.spread else 0, e.lanes if e.spread else 0),
                          one_call_tiles=(r.spread == "repeat", r.times, r.rows, r.cols,
                                          e.spread == "repeat", e.times, e.rows, e.cols))
    A, C, B = shape
    rows, seg = (1, cfg.tile) if B >= cfg.tile else (max(1, cfg.tile // max(B, 1)), max(B, 1))
    fuses = C >= cfg.fused_channels_per_thread * threads
    path = forced or (("fused_short" if fuses and A <= cfg.fused_short_max_rows else "short")
                      if B < cfg.fused_min_run else "fused" if fuses else "runs")
    # fused items: groups of about fused_group_elements elements (fused_short), or of
    # fused_runs_group_bytes of float32 x and dy (fused), and at least
    # fused_channels_per_thread groups per thread where there are channels enough (which group
    # cannot change a bit)
    group_elements = (cfg.fused_group_elements if path in ("short", "fused_short") else
                      min(cfg.fused_runs_group_bytes, cfg.l3_bytes // (4 * threads)) // 8)
    fused_group = max(1, min(group_elements // max(A * B, 1),
                             _ceil_div(C, cfg.fused_channels_per_thread * threads)))
    elemt_as_lanes = path in ("short", "fused_short") and B < cfg.short_run
    # (a fused plan's other calls, eval backward and reductions, launch twice: rarer, and a
    # few microseconds lost where they go parallel below the two-launch threshold)
    serial = _runs_serial(cfg, elements, threads, one_launch=path in ("fused", "fused_short"))
    return KernelPlan(path, shape, threads, forced is not None, serial, rows=rows, seg=seg,
                      group=_ceil_div(cfg.short_group_lanes, max(B, 1)),
                      fused_group=fused_group, span_loop=B < cfg.span_runs_below,
                      elemt_pieces=(_lane_pieces(cfg, shape, cfg.elemt_lanes, False, threads)
                                    if elemt_as_lanes else ()))


# Plans by (shape, threads), for the configuration in force: a dict lookup, where an lru_cache
# keyed on the Config as well would hash its eleven fields on every call. Emptied whenever the
# configuration or the forced path changes (override, forced_path) and when it grows large.
_plans: dict[tuple[tuple[int, ...], int], KernelPlan] = {}


def plan(x: Any, threads: Optional[int] = None) -> KernelPlan:
    """The plan for canonical array ``x`` (or anything of its shape) on ``threads`` threads
    (None: the count in force)."""
    if threads is None:
        threads = current_num_threads()
    key = (x.shape, threads)
    found = _plans.get(key)
    if found is None:
        if len(_plans) >= 256:
            _plans.clear()
        found = _plans[key] = _plan(x.shape, threads, _config, _forced)
    return found
