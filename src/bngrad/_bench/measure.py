"""Timing and memory: samples of back-to-back calls, cores kept busy, peak extra memory, and
PyTorch's thread count held for a run."""

from __future__ import annotations

import ctypes
import gc
import math
import time
import tracemalloc
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from .contenders import Unavailable, import_torch


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


def time_calls(fn: Callable[[], Any], number: int) -> float:
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


def calibrate(fn: Callable[[], Any], min_sample_s: float) -> int:
    """Calls per sample so that a sample lasts about ``min_sample_s``, from a second call."""
    fn()  # compiles, faults pages in
    t = time_calls(fn, 1)
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


def reset_peak_rss() -> bool:
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
    reset = reset_peak_rss() and rss0 is not None
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


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Set PyTorch's (process-global) thread count inside the block, restore it after; nothing
    to do when PyTorch is missing."""
    try:
        torch = import_torch()[0]
    except Unavailable:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
