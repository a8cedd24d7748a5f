"""Compile every kernel ahead of use (``bngrad precompile``), so that no first call waits for it.

Numba compiles a kernel for each combination of argument types the first time it sees it and
keeps the machine code in its on-disk cache (``cache=True``; ``NUMBA_CACHE_DIR`` moves it). A
fresh install therefore spends seconds on the first call of each dtype and layout. This module
makes those first calls on tiny arrays, once, through the public API: every dtype, every
canonical path (2-D and narrow channels-last rows, short, medium and long channels-first runs,
the fused per-channel kernels, mixed layouts and sliced inputs), training and eval, forward and
backward, the moments and the split reduce/elemt pair; with ``fused`` (``--fused``) the fused
forms' too (BN+ReLU, BN+add+ReLU), which take 3-4 times as long again and which not every
user needs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Dict, Iterable, Optional

import numpy as np

from . import _dtypes

DTYPES = _dtypes.NAMES

# (shape, how to lay it out) covering each kernel path of bngrad.kernels: 2-D rows of lanes,
# channels-first runs shorter than SHORT_RUN, short runs, long runs (fused where there are
# enough channels per thread), channels-last images (one of several work items: a launch of
# one item runs it on the calling thread, which compiles no parallel launcher for it), mixed
# layouts (a tiled transpose) and slices (a row copy).
_CASES = (((64, 8), "dense"), ((4, 8, 3, 3), "dense"), ((2, 8, 6, 6), "dense"),
          ((2, 8, 20, 20), "dense"), ((2, 2, 20, 20), "dense"), ((2, 8, 6, 6), "channels_last"),
          ((8, 64, 12, 12), "channels_last"), ((2, 8, 6, 6), "mixed"), ((2, 8, 6, 12), "sliced"))


def _arrays(shape, how, dtype, rng):
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    if how == "channels_last":
        x, dy = (np.ascontiguousarray(np.moveaxis(a, 1, -1)) for a in (x, dy))
        x, dy = (np.moveaxis(a, -1, 1) for a in (x, dy))
    elif how == "mixed":
        dy = np.moveaxis(np.ascontiguousarray(np.moveaxis(dy, 1, -1)), -1, 1)
    elif how == "sliced":
        x, dy = x[..., ::2], dy[..., ::2]
    return x, dy


def _operands(dtype: np.dtype, read_only: bool):
    """Each case of _CASES as (x, dy, weight, bias, running_mean, running_var)."""
    rng = np.random.default_rng(0)
    param = _dtypes.stat_dtype(dtype)
    for shape, how in _CASES:
        x, dy = _arrays(shape, how, dtype, rng)
        x.flags.writeable = dy.flags.writeable = not read_only
        C = shape[1]
        yield x, dy, np.ones(C, param), np.zeros(C, param), np.zeros(C, param), np.ones(C, param)


def _exercise(dtype: np.dtype, num_threads: Optional[int], read_only: bool) -> None:
    import bngrad

    for x, dy, w, b, rm, rv in _operands(dtype, read_only):
        _, mean, invstd = bngrad.batch_norm_forward(x, w, b, rm, rv, True, num_threads=num_threads)
        bngrad.batch_norm_forward(x, w, b, rm, rv, False, num_threads=num_threads)
        bngrad.batch_norm_backward(dy, x, w, rm, rv, mean, invstd, True, num_threads=num_threads)
        bngrad.batch_norm_backward(dy, x, w, rm, rv, None, None, False, num_threads=num_threads)
        bngrad.batch_norm_backward(dy, x, w, rm, rv, mean, invstd, True,
                                   output_mask=(False, True, True), num_threads=num_threads)
        bngrad.batch_norm_moments(x, num_threads=num_threads)  # (the training forward may fuse)
        sums = bngrad.batch_norm_backward_reduce(dy, x, mean, invstd, w, num_threads=num_threads)
        bngrad.batch_norm_backward_elemt(dy, x, mean, invstd, w, sums[0], sums[1],
                                         x.size // w.size, num_threads=num_threads)


# The fused forms' variants: (side input: None, in input's layout or C order; activation; the
# forward's ReLU record), each backward with every output mask of _FUSED_MASKS: all, without
# grad_side_input (bngrad.torch's layer without a residual), without grad_input too.
_FUSED = [(side, "relu", record) for side in (None, "like", "c")
          for record in ("bits", "bytes", None)] + [("like", "none", None)]
_FUSED_MASKS = ((True,) * 4, (True, True, True, False), (False, True, True, False))


def _exercise_fused(dtype: np.dtype, num_threads: Optional[int], read_only: bool) -> None:
    """The fused forms' kernels (bngrad.fused; bngrad.torch's fused layers call the same):
    _FUSED's variants, in training and eval."""
    from . import fused

    for x, dy, w, b, rm, rv in _operands(dtype, read_only):
        sides = {None: None, "like": np.empty_like(x), "c": np.empty(x.shape, x.dtype)}
        for side in sides.values():
            if side is not None:
                side[...] = dy
                side.flags.writeable = not read_only
        for train in (True, False):
            for side, activation, record in _FUSED:
                y, mean, invstd, mask = fused.batch_norm_relu_forward(
                    x, w, b, rm, rv, train, side_input=sides[side], activation=activation,
                    mask_format=record, num_threads=num_threads)
                relu = activation == "relu"
                for output_mask in _FUSED_MASKS:
                    fused.batch_norm_relu_backward(
                        dy, x, w, rm, rv, mean if train else None, invstd if train else None,
                        train, output_mask=output_mask, activation=activation,
                        num_threads=num_threads, relu_mask=mask if relu else None,
                        output=y if relu and mask is None else None)


def precompile(dtypes: Optional[Iterable[str]] = None,
               progress: Optional[Callable[[str, float], None]] = None,
               fused: bool = False) -> Dict[str, float]:
    """Compile (or load from Numba's cache) the kernels bngrad runs, for the given dtypes: every
    kernel of the plain functions, and with ``fused`` those of the fused forms.

    Parameters
    ----------
    dtypes : iterable of str, optional
        Any of "float64", "float32", "float16", "bfloat16" (default: all four).
    progress : callable, optional
        Called as ``progress(dtype, seconds)`` after each dtype.
    fused : bool
        Also the kernels of the fused forms (BN+ReLU, BN+add+ReLU: bngrad.fused, and
        bngrad.torch's fused layers and ``convert(fuse=True)``): 3-4 times as long again (float32
        on a 2-core AMD EPYC, empty cache: 58 s without, 268 s with).

    Returns
    -------
    dict
        Seconds spent per dtype (small where the cache was already warm).
    """
    from . import kernels
    from .errors import ArgumentValueError

    chosen = []
    for name in DTYPES if dtypes is None else dtypes:
        if name not in DTYPES:
            raise ArgumentValueError(f"dtypes: expected names among {', '.join(DTYPES)}, "
                                     f"got {name!r}")
        chosen.append(_dtypes.spec(name).numpy)
    spent = {}
    for dtype in chosen:
        t = time.perf_counter()
        # One thread and all threads: whether the fused channels-first kernels run depends on
        # the channels per thread, so both paths get compiled whatever the machine's cores.
        # Read-only inputs (np.broadcast_to, read-only memory maps) are another Numba type.
        # These tiny calls run serially (kernels._plan.runs_serial), so on all threads they
        # run a second time forced parallel, which compiles the parallel launchers.
        for exercise in (_exercise, _exercise_fused) if fused else (_exercise,):
            for num_threads, read_only in ((1, False), (None, False), (None, True)):
                exercise(dtype, num_threads, read_only)
                if num_threads is None:
                    with kernels.override(serial_elements=0):
                        exercise(dtype, num_threads, read_only)
        spent[dtype.name] = time.perf_counter() - t
        if progress is not None:
            progress(dtype.name, spent[dtype.name])
    return spent


# ---------------------------------------------------------------------------------------------
# the `bngrad precompile` command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", action="append", choices=DTYPES, metavar="NAME",
                        help="only this dtype (repeatable; default: all of "
                             + ", ".join(DTYPES) + ")")
    parser.add_argument("--fused", action="store_true",
                        help="also the fused forms' kernels (BN+ReLU, BN+add+ReLU: "
                             "bngrad.fused, bngrad.torch's fused layers and "
                             "convert(fuse=True)); 3-4 times as long again")


def run(args: argparse.Namespace) -> int:
    from numba.core.config import CACHE_DIR

    where = CACHE_DIR or "next to bngrad's kernel sources (__pycache__)"
    print(f"compiling bngrad's kernels into Numba's cache ({where}) ...", flush=True)
    spent = precompile(args.dtype, lambda name, s: print(f"  {name:9s} {s:6.1f} s", flush=True),
                       fused=args.fused)
    print(f"done in {sum(spent.values()):.1f} s; the first call of each dtype and layout now "
          "loads compiled code instead of compiling it")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: bngrad precompile")
