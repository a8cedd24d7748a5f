"""The benchmark behind ``bngrad bench``: cases, contenders, timing, the memory floor, results.

What is measured, per case (one array shape, dtype and memory layout), all in one process with
the same thread count for every contender:

- **bngrad**: :func:`bngrad.batch_norm_backward` (training mode, all three gradients);
- **torch**: ``torch.ops.aten.native_batch_norm_backward`` on tensors sharing the same memory,
  after ``torch.set_num_threads(threads)`` (skipped, with the reason, when PyTorch is missing);
- **reference**: :func:`bngrad.reference.batch_norm_backward`, the float64 NumPy oracle
  (single-threaded and slow: only timed up to a size cap);
- **floor**: one fused parallel elementwise pass ``dx = a[c]*dy + b[c]*x`` over arrays of the
  same shape, dtype and thread count, in the input's memory layout, allocating its output like
  every other contender does. No batch-norm backward that returns a new grad_input can beat
  it: it must read x and dy and write dx too;
- **floor_in_place**: the same pass into one output allocated up front, so the difference to
  ``floor`` is what fresh memory costs (page faults, the kernel zeroing pages).

Contenders are interleaved within each repeat (and their order rotated) so that the machine's
noise falls on all of them alike; figures are medians. Nothing here prints: ``bngrad._cli_bench``
renders progress, tables and plots.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import ml_dtypes
import numba
import numpy as np
from numba import njit, prange, uint64

import bngrad
from bngrad import reference
from bngrad._threads import parallel_region, threading_layer
from bngrad.errors import ArgumentValueError
from bngrad.kernels._elements import as_kernel_array, compute_dtype, from_float, to_float

__all__ = [
    "CONTENDERS", "DTYPES", "LAYOUTS", "SUITES", "Case", "CaseData", "CaseResult", "Options",
    "SuiteResult", "Timing", "Unavailable", "check_repeat", "check_threads", "cores_busy",
    "default_threads", "floor_pass", "geomean", "machine_info", "make_arrays", "make_floor",
    "measure_extra_memory", "measure_startup", "run_case", "run_suite", "select_cases",
]

EPS = 1e-5

DTYPES: Dict[str, np.dtype] = {
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
}
_DTYPE_ALIASES = {"fp64": "float64", "f64": "float64", "double": "float64",
                  "fp32": "float32", "f32": "float32", "float": "float32",
                  "fp16": "float16", "f16": "float16", "half": "float16",
                  "bf16": "bfloat16"}

#: Memory layouts of (grad_out, input), named independently of the number of dimensions.
LAYOUTS: Dict[str, str] = {
    "contiguous": "both C-contiguous (NCHW, NCDHW, (N, C))",
    "channels_last": "both channels-last (NHWC, NDHWC)",
    "mixed": "grad_out channels-last, input C-contiguous",
    "mixed_r": "grad_out C-contiguous, input channels-last",
    "sliced": "input a cropped, non-contiguous view of a larger array",
}
_LAYOUT_ALIASES = {"nchw": "contiguous", "ncdhw": "contiguous", "ncl": "contiguous",
                   "nc": "contiguous", "cf": "contiguous", "channels_first": "contiguous",
                   "nhwc": "channels_last", "ndhwc": "channels_last", "nlc": "channels_last",
                   "cl": "channels_last", "channels-last": "channels_last",
                   "mixed-r": "mixed_r"}


# ---------------------------------------------------------------------------------------------
# cases and suites

@dataclass(frozen=True)
class Case:
    """One benchmark case: a logical shape (channels on axis 1), a dtype and a layout."""

    shape: Tuple[int, ...]
    dtype: str
    layout: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes_per_array(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def layout_name(self) -> str:
        """The layout as people write it for this many dimensions (NCHW, NDHWC, ...)."""
        spatial = {2: "", 3: "L", 4: "HW", 5: "DHW"}.get(len(self.shape), "S")
        first, last = "NC" + spatial, "N" + spatial + "C"
        return {"contiguous": first, "channels_last": last,
                "mixed": f"dy {last}, x {first}", "mixed_r": f"dy {first}, x {last}",
                "sliced": f"{first} sliced"}[self.layout]

    @property
    def shape_text(self) -> str:
        return "x".join(str(n) for n in self.shape)

    @property
    def label(self) -> str:
        return f"{self.shape_text} {self.dtype} {self.layout_name}"


def _cases(shapes: Iterable[Tuple[int, ...]], dtypes: Iterable[str], layouts: Iterable[str]
           ) -> List[Case]:
    return [Case(tuple(s), d, lay) for s in shapes for d in dtypes for lay in layouts]


# ResNet-50's batch-norm inputs (C, H, W) at 224x224, each distinct shape once.
RESNET50_SHAPES = [(64, 112, 112), (64, 56, 56), (128, 56, 56), (256, 56, 56), (128, 28, 28),
                   (256, 28, 28), (512, 28, 28), (256, 14, 14), (512, 14, 14), (1024, 14, 14),
                   (512, 7, 7), (2048, 7, 7)]
_RESNET_ISSUE = [(32, 64, 112, 112), (32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14),
                 (32, 2048, 7, 7)]
_CF_CL = ("contiguous", "channels_last")


def _suite_default() -> List[Case]:
    return (
        _cases(_RESNET_ISSUE, ["float32"], _CF_CL)
        + _cases([(4096, 1024), (65536, 64), (256, 4096)], ["float32"], ["contiguous"])
        + _cases([(64, 2, 224, 224), (64, 3, 224, 224)], ["float32"], ["channels_last"])
        + _cases([(8, 32, 32, 64, 64)], ["float32"], _CF_CL)
        + _cases([(32, 256, 56, 56)], ["bfloat16", "float16"], _CF_CL)
        + _cases([(4096, 1024)], ["bfloat16", "float16"], ["contiguous"])
        + _cases([(64, 3, 224, 224)], ["bfloat16", "float16"], ["channels_last"])
        + _cases([(8, 32, 32, 64, 64)], ["bfloat16"], _CF_CL)
        + _cases([(32, 256, 56, 56)], ["float32"], ["mixed", "mixed_r", "sliced"])
        + _cases([(32, 256, 56, 56)], ["bfloat16"], ["mixed"])
        + _cases([(4096, 1024)], ["float32"], ["sliced"])
        + _cases([(32, 256, 28, 28)], ["float64"], _CF_CL)
    )


def _suite_quick() -> List[Case]:
    return (
        _cases([(32, 64, 56, 56)], ["float32"], _CF_CL)
        + _cases([(4096, 1024)], ["float32"], ["contiguous"])
        + _cases([(64, 3, 112, 112)], ["float32"], ["channels_last"])
        + _cases([(32, 64, 56, 56)], ["bfloat16"], ["channels_last"])
        + _cases([(16, 64, 56, 56)], ["float32"], ["mixed", "sliced"])
    )


def _suite_resnet50() -> List[Case]:
    return _cases([(32,) + s for s in RESNET50_SHAPES], ["float32", "bfloat16"], _CF_CL)


#: suite name -> (cases, default repeat count, one-line description)
SUITES: Dict[str, Tuple[Callable[[], List[Case]], int, str]] = {
    "quick": (_suite_quick, 5, "a handful of mid-sized cases, under a minute"),
    "default": (_suite_default, 7, "ResNet-50, 2-D, small-C, 3-D, half dtypes, mixed and "
                                   "sliced layouts"),
    "resnet50": (_suite_resnet50, 5, "every ResNet-50 batch-norm shape at batch 32, NCHW and "
                                     "channels-last, float32 and bfloat16"),
}


def _parse_names(values: Optional[Sequence[str]], known: Dict[str, Any], aliases: Dict[str, str],
                 what: str) -> Optional[set]:
    if not values:
        return None
    names = set()
    for value in values:
        for item in value.split(","):
            key = item.strip().lower()
            if not key:
                continue
            key = aliases.get(key, key)
            if key not in known:
                raise ArgumentValueError(
                    f"--{what}: unknown {what} {item.strip()!r}; expected one of "
                    f"{', '.join(known)} (or an alias such as "
                    f"{', '.join(sorted(aliases)[:4])})")
            names.add(key)
    return names


def select_cases(suite: str, dtypes: Optional[Sequence[str]] = None,
                 layouts: Optional[Sequence[str]] = None) -> List[Case]:
    """The cases of ``suite`` whose dtype and layout are among those given (None: all).

    ``dtypes`` and ``layouts`` are lists of names, each may be comma-separated; aliases such as
    ``bf16``, ``fp32``, ``nchw`` or ``nhwc`` are accepted. Raises ArgumentValueError for an
    unknown suite or name, or when the filters leave no case.
    """
    if suite not in SUITES:
        raise ArgumentValueError(f"--suite: unknown suite {suite!r}; expected one of "
                                 f"{', '.join(SUITES)}")
    cases = SUITES[suite][0]()
    keep_dtypes = _parse_names(dtypes, DTYPES, _DTYPE_ALIASES, "dtype")
    keep_layouts = _parse_names(layouts, LAYOUTS, _LAYOUT_ALIASES, "layout")
    selected = [c for c in cases
                if (keep_dtypes is None or c.dtype in keep_dtypes)
                and (keep_layouts is None or c.layout in keep_layouts)]
    if not selected:
        have_d = sorted({c.dtype for c in cases})
        have_l = sorted({c.layout for c in cases})
        raise ArgumentValueError(
            f"no case of suite {suite!r} matches the filters; that suite has dtypes "
            f"{', '.join(have_d)} and layouts {', '.join(have_l)}")
    return selected


# ---------------------------------------------------------------------------------------------
# arrays

@dataclass
class CaseData:
    """The arrays of one case; ``floor_dy``/``floor_x`` are dense, in the input's memory order."""

    grad_out: np.ndarray
    input: np.ndarray
    weight: np.ndarray
    save_mean: np.ndarray
    save_invstd: np.ndarray
    floor_dy: np.ndarray
    floor_x: np.ndarray


def _random(rng: np.random.Generator, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Standard-normal values drawn in the compute dtype, then rounded to ``dtype``."""
    return rng.standard_normal(shape, dtype=compute_dtype(dtype)).astype(dtype, copy=False)


def _channels_last(rng, shape, dtype) -> np.ndarray:
    """Channels-last memory for the logical (N, C, ...) ``shape`` (plain C order when 2-D)."""
    if len(shape) <= 2:
        return _random(rng, shape, dtype)
    memory = (shape[0],) + tuple(shape[2:]) + (shape[1],)
    return np.moveaxis(_random(rng, memory, dtype), -1, 1)


def _sliced(rng, shape, dtype) -> np.ndarray:
    """A view of ``shape`` cropped out of a C-contiguous array 8 wider on the last axis."""
    pad = 8
    wide = _random(rng, tuple(shape[:-1]) + (shape[-1] + pad,), dtype)
    return wide[..., pad // 2: pad // 2 + shape[-1]]


def _dense_like(array: np.ndarray, template: np.ndarray) -> np.ndarray:
    """``array``'s values in ``template``'s memory order (``array`` itself when it already is)."""
    if array.strides == template.strides:
        return array
    out = np.empty_like(template)  # order 'K': keeps a dense template's strides
    np.copyto(out, array)
    return out


def make_arrays(case: Case, seed: int = 0) -> CaseData:
    """Random arrays for ``case``: standard-normal data, parameters of the usual magnitudes.

    Parameters are float32 for half dtypes (mixed precision, as in autocast training), the
    data's dtype otherwise.
    """
    rng = np.random.default_rng(seed)
    dtype = DTYPES[case.dtype]
    cf = lambda: _random(rng, case.shape, dtype)  # noqa: E731
    cl = lambda: _channels_last(rng, case.shape, dtype)  # noqa: E731
    make_dy, make_x = {
        "contiguous": (cf, cf),
        "channels_last": (cl, cl),
        "mixed": (cl, cf),
        "mixed_r": (cf, cl),
        "sliced": (cf, lambda: _sliced(rng, case.shape, dtype)),
    }[case.layout]
    grad_out, input = make_dy(), make_x()
    C = case.shape[1]
    param_dtype = compute_dtype(dtype)
    weight = rng.uniform(0.5, 1.5, C).astype(param_dtype)
    save_mean = rng.normal(0.0, 0.1, C).astype(param_dtype)
    save_invstd = rng.uniform(0.8, 1.2, C).astype(param_dtype)
    floor_x = input if _dense_order(input) is not None else np.ascontiguousarray(input)
    floor_dy = _dense_like(grad_out, floor_x)
    return CaseData(grad_out, input, weight, save_mean, save_invstd, floor_dy, floor_x)


# ---------------------------------------------------------------------------------------------
# the floor kernel

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


def _dense_order(array: np.ndarray) -> Optional[Tuple[int, ...]]:
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
    order = _dense_order(input)
    if order is None or grad_out.strides != input.strides or grad_out.dtype != input.dtype:
        raise ArgumentValueError("floor: grad_out and input must be dense with equal strides "
                                 "and dtype")
    ct = compute_dtype(input.dtype)
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
        with parallel_region(num_threads):
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
    order = _dense_order(input)
    assert order is not None  # make_floor refuses an input that is not dense
    memory = flat.view(input.dtype).reshape(tuple(input.shape[d] for d in order))
    return memory.transpose(np.argsort(order))


# ---------------------------------------------------------------------------------------------
# contenders

class Unavailable(Exception):
    """A contender cannot run here; the message says why (shown to the user)."""


def _import_torch():
    """(torch, from_numpy) or Unavailable; one place, so tests can pretend torch is missing."""
    try:
        import torch
        from bngrad.torch._convert import from_numpy
    except ImportError as exc:
        raise Unavailable("PyTorch is not installed (pip install '.[torch]' in bngrad's clone "
                          f"to compare against it): {exc}") from None
    return torch, from_numpy


def _bngrad(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    fn, d = bngrad.batch_norm_backward, data
    return lambda: fn(d.grad_out, d.input, d.weight, None, None, d.save_mean, d.save_invstd,
                      True, EPS, (True, True, True), channel_axis=1, num_threads=threads)


def _torch(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    torch, from_numpy = _import_torch()
    dy, x, w, m, s = (from_numpy(a) for a in (data.grad_out, data.input, data.weight,
                                              data.save_mean, data.save_invstd))
    op = torch.ops.aten.native_batch_norm_backward

    def run():
        # torch's thread count is process-global; run_suite sets it, this re-asserts it
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return op(dy, x, w, None, None, m, s, True, EPS, [True, True, True])
    return run


def _reference(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    n = data.input.size
    if n > opts.reference_cap:
        raise Unavailable(f"NumPy reference timed only up to {opts.reference_cap:,} elements "
                          "(--reference-cap)")
    d = data
    return lambda: reference.batch_norm_backward(d.grad_out, d.input, d.weight, None, None,
                                                 d.save_mean, d.save_invstd, True, EPS,
                                                 (True, True, True), channel_axis=1)


def _floor(data: CaseData, threads: int, opts: Options, in_place: bool = False
           ) -> Callable[[], Any]:
    # coefficients of the magnitude a real backward uses: weight*invstd, and a small b
    a = data.weight * data.save_invstd
    b = -0.01 * data.save_invstd
    return make_floor(data.floor_dy, data.floor_x, a, b, threads, in_place=in_place)


def _floor_in_place(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    return _floor(data, threads, opts, in_place=True)


#: contender name -> (factory(data, threads, options) -> callable, one-line description)
CONTENDERS: Dict[str, Tuple[Callable, str]] = {
    "bngrad": (_bngrad, "bngrad.batch_norm_backward"),
    "torch": (_torch, "torch.ops.aten.native_batch_norm_backward"),
    "reference": (_reference, "bngrad.reference (float64 NumPy)"),
    "floor": (_floor, "fused elementwise pass dx = a*dy + b*x into a new array (memory floor)"),
    "floor_in_place": (_floor_in_place, "the same pass into one reused, paged-in array"),
}
# With --scaling, these run on one thread as well, under the name "<name>@1".
_SCALED = ("bngrad", "floor")


# ---------------------------------------------------------------------------------------------
# timing and memory

@dataclass
class Timing:
    """Seconds per call: one sample is the mean over ``number`` back-to-back calls."""

    samples: List[float]
    number: int

    @property
    def median(self) -> float:
        return float(np.median(self.samples))

    @property
    def q1(self) -> float:
        return float(np.percentile(self.samples, 25))

    @property
    def q3(self) -> float:
        return float(np.percentile(self.samples, 75))

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median."""
        return (self.q3 - self.q1) / self.median if self.median > 0 else 0.0

    def to_json(self) -> dict:
        return {"median_ms": self.median * 1e3, "q1_ms": self.q1 * 1e3, "q3_ms": self.q3 * 1e3,
                "min_ms": min(self.samples) * 1e3, "max_ms": max(self.samples) * 1e3,
                "spread": self.spread, "number": self.number,
                "samples_ms": [s * 1e3 for s in self.samples]}


def _time(fn: Callable[[], Any], number: int) -> float:
    t0 = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - t0) / number


def cores_busy(fn: Callable[[], Any], min_s: float = 0.5) -> float:
    """Process CPU time (all threads) / wall time over back-to-back calls for ``min_s``.

    How many cores the calls keep busy (spin-waiting counts as busy). The window is long
    because CPU clocks can advance in scheduler ticks of several milliseconds.
    """
    calls = 0
    c0, t0 = time.process_time(), time.perf_counter()
    while calls == 0 or time.perf_counter() - t0 < min_s:
        fn()
        calls += 1
    t1, c1 = time.perf_counter(), time.process_time()
    return (c1 - c0) / (t1 - t0)


def _calibrate(fn: Callable[[], Any], min_sample_s: float) -> int:
    """Calls per sample so that a sample lasts about ``min_sample_s``, from a second call."""
    fn()  # compiles, faults pages in
    t = _time(fn, 1)
    return int(min(100, max(1, math.ceil(min_sample_s / max(t, 1e-9)))))


def _read_status_kib(field_name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to clear_refs); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    # Give freed heap pages back to the OS, so a temporary that reuses them shows in the RSS.
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_extra_memory(fn: Callable[[], Any], output_bytes: int) -> Dict[str, Optional[int]]:
    """Peak memory one call of ``fn`` needs beyond the ``output_bytes`` it returns.

    ``rss_extra``: peak resident-set growth during the call minus ``output_bytes`` (counts every
    allocator: NumPy, Numba, PyTorch; Linux only, None elsewhere). ``numpy_traced_peak``: peak
    of the allocations tracemalloc sees (NumPy's), output included.
    """
    gc.collect()
    _malloc_trim()
    rss0 = _read_status_kib("VmRSS")
    reset = _reset_peak_rss() and rss0 is not None
    tracemalloc.start()
    try:
        result = fn()
        _, traced_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    hwm = _read_status_kib("VmHWM")
    del result
    rss_extra = None
    if reset and rss0 is not None and hwm is not None:
        rss_extra = max(0, (hwm - rss0) * 1024 - output_bytes)
    return {"rss_extra": rss_extra, "numpy_traced_peak": traced_peak}


# ---------------------------------------------------------------------------------------------
# running

@dataclass
class Options:
    """How to run: thread count, repeats, caps. Defaults suit an interactive run."""

    threads: int
    repeat: int = 7
    reference_cap: int = 1 << 22
    reference_repeat: int = 3
    scaling: bool = False
    memory: bool = True
    min_sample_s: float = 0.01
    gap_s: float = 0.002
    seed: int = 0


@dataclass
class CaseResult:
    """Everything measured for one case; ratios are derived from the medians."""

    case: Case
    timings: Dict[str, Timing] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    extra_memory: Dict[str, Dict[str, Optional[int]]] = field(default_factory=dict)
    max_rel_diff_vs_torch: Optional[float] = None
    deterministic_across_threads: Optional[bool] = None
    cores_busy: Optional[float] = None
    threads: int = 1

    def median(self, name: str) -> Optional[float]:
        t = self.timings.get(name)
        return None if t is None else t.median

    def _ratio(self, num: str, den: str) -> Optional[float]:
        a, b = self.median(num), self.median(den)
        return None if a is None or b is None or b == 0 else a / b

    @property
    def speedup_vs_torch(self) -> Optional[float]:
        return self._ratio("torch", "bngrad")

    @property
    def ratio_to_floor(self) -> Optional[float]:
        return self._ratio("bngrad", "floor")

    @property
    def scaling(self) -> Optional[float]:
        """bngrad's speedup on ``threads`` threads over one thread."""
        return self._ratio("bngrad@1", "bngrad")

    @property
    def floor_scaling(self) -> Optional[float]:
        return self._ratio("floor@1", "floor")

    @property
    def fresh_memory_share(self) -> Optional[float]:
        """Share of the floor's time that fresh output memory costs: 1 - in-place / fresh."""
        ratio = self._ratio("floor_in_place", "floor")
        return None if not ratio else 1 - ratio

    def gbps(self, name: str = "bngrad") -> Optional[float]:
        """Traffic of three arrays (read x, dy; write dx) per second, in GB/s."""
        t = self.median(name)
        return None if not t else 3 * self.case.bytes_per_array / t / 1e9

    def to_json(self) -> dict:
        c = self.case
        return {
            "shape": list(c.shape), "dtype": c.dtype, "layout": c.layout,
            "layout_name": c.layout_name, "bytes_per_array": c.bytes_per_array,
            "threads": self.threads,
            "timings": {k: v.to_json() for k, v in self.timings.items()},
            "skipped": self.skipped,
            "speedup_vs_torch": self.speedup_vs_torch, "ratio_to_floor": self.ratio_to_floor,
            "gbps": self.gbps(), "floor_gbps": self.gbps("floor"),
            "scaling_1_to_n": self.scaling, "floor_scaling_1_to_n": self.floor_scaling,
            "cores_busy": self.cores_busy,
            "extra_memory": self.extra_memory,
            "max_rel_diff_vs_torch": self.max_rel_diff_vs_torch,
            "deterministic_across_threads": self.deterministic_across_threads,
        }


def _as_float64(result: Any) -> np.ndarray:
    """grad_input of a contender's result as float64 NumPy (torch tensors converted)."""
    dx = result[0]
    if not isinstance(dx, np.ndarray):
        dx = dx.float().numpy()
    return np.asarray(dx, dtype=np.float64)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.dtype.itemsize}")


def run_case(case: Case, opts: Options,
             on_step: Optional[Callable[[float, str], None]] = None) -> CaseResult:
    """Measure one case. ``on_step(fraction_done, what)`` reports progress within the case."""
    step = on_step or (lambda fraction, what: None)
    result = CaseResult(case, threads=opts.threads)
    step(0.0, "allocating")
    data = make_arrays(case, opts.seed)
    fns: Dict[str, Callable[[], Any]] = {}
    for name, (factory, _) in CONTENDERS.items():
        try:
            fns[name] = factory(data, opts.threads, opts)
        except Unavailable as exc:
            result.skipped[name] = str(exc)
    if opts.scaling and opts.threads > 1:
        for name in _SCALED:
            if name in fns:
                fns[f"{name}@1"] = CONTENDERS[name][0](data, 1, opts)

    step(0.05, "warming up")
    numbers = {name: _calibrate(fn, opts.min_sample_s) for name, fn in fns.items()}
    if "reference" in numbers:
        numbers["reference"] = 1
    result.max_rel_diff_vs_torch = _agreement(fns)
    if "bngrad@1" in fns:
        one, many = fns["bngrad@1"](), fns["bngrad"]()
        result.deterministic_across_threads = all(
            np.array_equal(_bits(np.asarray(p)), _bits(np.asarray(q)))
            for p, q in zip(one, many) if p is not None)
        del one, many

    samples: Dict[str, List[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(opts.repeat):
        step(0.15 + 0.75 * r / opts.repeat, f"repeat {r + 1}/{opts.repeat}")
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate: nobody always follows the same contender
            if name == "reference" and len(samples[name]) >= opts.reference_repeat:
                continue
            # let the previous contender's spinning pool threads (OpenMP, TBB) fall asleep
            time.sleep(opts.gap_s)
            samples[name].append(_time(fns[name], numbers[name]))
    result.timings = {n: Timing(s, numbers[n]) for n, s in samples.items() if s}
    if opts.scaling and "bngrad" in fns:
        time.sleep(opts.gap_s)
        result.cores_busy = cores_busy(fns["bngrad"])

    if opts.memory:
        step(0.92, "measuring memory")
        out_bytes = case.bytes_per_array
        for name in ("bngrad", "torch"):
            if name in fns:
                result.extra_memory[name] = measure_extra_memory(fns[name], out_bytes)
    step(1.0, "done")
    del fns, data
    gc.collect()
    return result


def geomean(values: Iterable[Optional[float]]) -> Optional[float]:
    """Geometric mean of the positive values (None and zeros left out); None when there are none."""
    positive = [v for v in values if v is not None and v > 0]
    return float(np.exp(np.mean(np.log(positive)))) if positive else None


def _agreement(fns: Dict[str, Callable[[], Any]]) -> Optional[float]:
    """max |bngrad dx - torch dx| / max |torch dx|: a guard against timing a wrong answer."""
    if "bngrad" not in fns or "torch" not in fns:
        return None
    ours, theirs = _as_float64(fns["bngrad"]()), _as_float64(fns["torch"]())
    if not theirs.size:
        return 0.0
    scale = float(np.max(np.abs(theirs)))
    diff = float(np.max(np.abs(ours - theirs)))
    return diff / scale if scale else diff


@dataclass
class SuiteResult:
    """A whole run: per-case results, the machine, the options, optional start-up figures."""

    suite: str
    options: Options
    machine: dict
    cases: List[CaseResult]
    startup: Optional[dict] = None

    def summary(self) -> dict:
        """Geometric means and the aggregates the performance targets are stated in."""
        cs = self.cases
        speedups = [(c.speedup_vs_torch, c) for c in cs if c.speedup_vs_torch is not None]
        slowest = min(speedups, key=lambda p: p[0]) if speedups else None
        big = [c.ratio_to_floor for c in cs
               if c.case.dtype == "float32" and c.case.layout in _CF_CL
               and c.case.bytes_per_array >= 64 << 20 and c.ratio_to_floor is not None]
        per_byte = {}
        for dtype in DTYPES:
            rates = [c.gbps() for c in cs if c.case.dtype == dtype and c.gbps()]
            if rates:
                per_byte[dtype] = geomean(rates)
        rss_extras = [c.extra_memory.get("bngrad", {}).get("rss_extra") for c in cs]
        extras = [e for e in rss_extras if e is not None]
        diffs = [(c.max_rel_diff_vs_torch, c) for c in cs if c.max_rel_diff_vs_torch is not None]
        largest_diff = max(diffs, key=lambda p: p[0]) if diffs else None
        det = [c.deterministic_across_threads for c in cs
               if c.deterministic_across_threads is not None]
        return {
            "geomean_speedup_vs_torch": geomean(s for s, _ in speedups),
            "min_speedup_vs_torch": slowest[0] if slowest else None,
            "min_speedup_case": slowest[1].case.label if slowest else None,
            "geomean_ratio_to_floor": geomean(c.ratio_to_floor for c in cs),
            "median_ratio_to_floor_fp32_ge_64mib": float(np.median(big)) if big else None,
            "fp32_ge_64mib_cases": len(big),
            "geomean_gbps_by_dtype": per_byte,
            "geomean_scaling_1_to_n": geomean(c.scaling for c in cs),
            "max_bngrad_extra_bytes": max(extras) if extras else None,
            "max_rel_diff_vs_torch": largest_diff[0] if largest_diff else None,
            "max_rel_diff_case": largest_diff[1].case.label if largest_diff else None,
            "deterministic_across_threads": all(det) if det else None,
        }

    def median_fresh_memory_share(self) -> Optional[float]:
        """Median of the cases' :attr:`CaseResult.fresh_memory_share` (the upper middle one of
        an even count); None when no case has both floors."""
        shares = sorted(c.fresh_memory_share for c in self.cases
                        if c.fresh_memory_share is not None)
        return shares[len(shares) // 2] if shares else None

    def to_json(self) -> dict:
        opts = self.options
        return {
            "suite": self.suite, "machine": self.machine,
            "options": {"threads": opts.threads, "repeat": opts.repeat,
                        "reference_cap": opts.reference_cap, "scaling": opts.scaling,
                        "memory": opts.memory, "min_sample_s": opts.min_sample_s,
                        "gap_s": opts.gap_s,
                        "seed": opts.seed},
            "contenders": {k: v[1] for k, v in CONTENDERS.items()},
            "summary": self.summary(),
            "cases": [c.to_json() for c in self.cases],
            "startup": self.startup,
        }

    @classmethod
    def from_json(cls, data: dict) -> SuiteResult:
        """Rebuild a result from :meth:`to_json`'s output (to re-render a saved run)."""
        o = data["options"]
        opts = Options(threads=o["threads"], repeat=o["repeat"], reference_cap=o["reference_cap"],
                       scaling=o["scaling"], memory=o["memory"], min_sample_s=o["min_sample_s"],
                       gap_s=o.get("gap_s", 0.0), seed=o["seed"])
        cases = []
        for c in data["cases"]:
            timings = {name: Timing([v / 1e3 for v in t["samples_ms"]], t["number"])
                       for name, t in c["timings"].items()}
            cases.append(CaseResult(
                Case(tuple(c["shape"]), c["dtype"], c["layout"]), timings, dict(c["skipped"]),
                dict(c["extra_memory"]), c["max_rel_diff_vs_torch"],
                c["deterministic_across_threads"], c.get("cores_busy"), c["threads"]))
        return cls(data["suite"], opts, dict(data["machine"]), cases, data.get("startup"))

    @classmethod
    def read_json(cls, path: str) -> SuiteResult:
        with open(path) as f:
            return cls.from_json(json.load(f))

    def write_json(self, path: str) -> None:
        """Write :meth:`to_json` as strict JSON (a NaN or infinity becomes null)."""
        with open(path, "w") as f:
            json.dump(_finite(self.to_json()), f, indent=1, allow_nan=False)
            f.write("\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class _TorchThreads:
    """Set torch's (process-global) thread count for the run, restore it afterwards."""

    def __init__(self, threads: int):
        self.threads = threads
        self.previous: Optional[int] = None
        self.torch: Any = None  # the torch module, once imported

    def __enter__(self):
        try:
            self.torch = _import_torch()[0]
        except Unavailable:
            return self
        self.previous = self.torch.get_num_threads()
        self.torch.set_num_threads(self.threads)
        return self

    def __exit__(self, *exc):
        if self.torch is not None:
            self.torch.set_num_threads(self.previous)


def default_threads() -> int:
    """Every core this process may run on (capped at Numba's pool size)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, numba.config.NUMBA_NUM_THREADS))


def check_threads(threads: int) -> int:
    limit = numba.config.NUMBA_NUM_THREADS
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= limit:
        raise ArgumentValueError(f"--threads must be an integer from 1 to {limit} (Numba's pool, "
                                 f"set by NUMBA_NUM_THREADS), got {threads!r}")
    return threads


def check_repeat(repeat: int) -> int:
    if repeat < 1:
        raise ArgumentValueError(f"--repeat must be at least 1, got {repeat}")
    return repeat


def run_suite(suite: str, cases: Sequence[Case], opts: Options,
              on_progress: Optional[Callable[[float, str], None]] = None) -> SuiteResult:
    """Measure ``cases`` in order. ``on_progress(cases_done, text)``: fractional count, a label."""
    check_threads(opts.threads)
    check_repeat(opts.repeat)
    report = on_progress or (lambda done, text: None)
    machine = machine_info(opts.threads)  # before we load the machine ourselves
    others = _OtherLoad()
    results = []
    with _TorchThreads(opts.threads):
        for i, case in enumerate(cases):
            def on_step(fraction, what, i=i, case=case):
                report(i + fraction, f"{case.label}: {what}")
            results.append(run_case(case, opts, on_step))
    machine["other_processes_cores"] = others.cores()
    return SuiteResult(suite, opts, machine, results)


class _OtherLoad:
    """How many cores other processes kept busy, on average, since construction (Linux).

    All CPU time the system spent (``/proc/stat``) minus this process's own CPU time, over the
    wall time: a direct measure of the noise under the figures (None where unavailable).
    """

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> Optional[Tuple[float, float, float]]:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
            tick = os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, AttributeError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        busy_s = (sum(fields[:8]) - idle) / tick  # user..steal; guest is counted in user
        own = os.times()
        return time.perf_counter(), busy_s, own.user + own.system

    def cores(self) -> Optional[float]:
        end = self._sample()
        if self.start is None or end is None or end[0] <= self.start[0]:
            return None
        wall = end[0] - self.start[0]
        other = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return max(0.0, other / wall)


# ---------------------------------------------------------------------------------------------
# the machine, and the first call in a fresh process

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> dict:
    try:
        torch_version = _import_torch()[0].__version__
    except Unavailable:
        torch_version = None
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        pages = None
    return {
        "cpu_model": _cpu_model(), "cores": os.cpu_count(), "threads": threads,
        "memory_bytes": pages, "platform": platform.platform(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "bngrad": bngrad.__version__,
        "numpy": np.__version__, "numba": numba.__version__, "torch": torch_version,
        "threading_layer": threading_layer(),
        # other processes' load at the start: the figures are noisy when it is high
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


#: first calls timed in a fresh process, in this order: (label, shape, dtype, layout)
STARTUP_CALLS = [("float32 NCHW", (8, 16, 8, 8), "float32", "contiguous"),
                 ("float32 NHWC", (8, 16, 8, 8), "float32", "channels_last"),
                 ("bfloat16 NCHW", (8, 16, 8, 8), "bfloat16", "contiguous"),
                 ("float16 NHWC", (8, 16, 8, 8), "float16", "channels_last")]

_STARTUP_SCRIPT = r"""
import json, sys, time
t0 = time.perf_counter()
import bngrad
t1 = time.perf_counter()
from bngrad.bench import Case, make_arrays
out = {"import_s": t1 - t0, "first_call_s": {}}
for label, shape, dtype, layout in json.loads(sys.argv[1]):
    d = make_arrays(Case(tuple(shape), dtype, layout))
    t = time.perf_counter()
    bngrad.batch_norm_backward(d.grad_out, d.input, d.weight, None, None, d.save_mean,
                               d.save_invstd, True, 1e-5, (True, True, True))
    out["first_call_s"][label] = time.perf_counter() - t
print(json.dumps(out))
"""


def _startup_once(env: dict, calls: list) -> dict:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _STARTUP_SCRIPT, json.dumps(calls)], env=env,
                          capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"start-up probe failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    figures["process_s"] = wall
    return figures


def measure_startup(calls: Optional[list] = None, warm_runs: int = 2) -> dict:
    """First-call times in fresh processes: ``cold`` (empty kernel cache: compiles) then ``warm``.

    Each probe is ``python -c 'import bngrad; call batch_norm_backward once per config'`` with
    ``NUMBA_CACHE_DIR`` pointing at a new temporary directory, so the user's own cache is neither
    used nor touched. ``warm`` keeps the fastest of ``warm_runs`` probes per figure.
    """
    calls = [list(c) for c in (calls or STARTUP_CALLS)]
    with tempfile.TemporaryDirectory(prefix="bngrad-bench-cache-") as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        cold = _startup_once(env, calls)
        warms = [_startup_once(env, calls) for _ in range(max(1, warm_runs))]
    warm = {"import_s": min(w["import_s"] for w in warms),
            "process_s": min(w["process_s"] for w in warms),
            "first_call_s": {k: min(w["first_call_s"][k] for w in warms)
                             for k in warms[0]["first_call_s"]}}
    return {"cold": cold, "warm": warm, "calls": [c[0] for c in calls]}
