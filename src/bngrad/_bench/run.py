"""Running cases and suites, and the checks of how to run them.

Contenders are interleaved within each repeat (and their order rotated) so that the machine's
noise falls on all of them alike; figures are medians.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from ..errors import ArgumentValueError
from .arrays import make_arrays
from .cases import Case
from .contenders import SCALED, TORCH_COMPILE, Unavailable, contenders
from .machine import OtherLoad, machine_info, pool_size
from .measure import Timing, calibrate, cores_busy, measure_extra_memory, time_calls, torch_threads
from .results import CaseResult, Options, SuiteResult


def check_threads(threads: int) -> int:
    """``threads`` if it is an int from 1 to Numba's pool size, else ArgumentValueError."""
    limit = pool_size()
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= limit:
        raise ArgumentValueError(f"threads: expected an integer from 1 to {limit} (Numba's pool, "
                                 f"set by NUMBA_NUM_THREADS), got {threads!r}")
    return threads


def check_repeat(repeat: int) -> int:
    """``repeat`` if it is at least 1, else ArgumentValueError."""
    if repeat < 1:
        raise ArgumentValueError(f"repeat: expected at least 1, got {repeat}")
    return repeat


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
    factories = contenders(case.op, opts.torch_compile)
    for name, (factory, _) in factories.items():
        try:
            fns[name] = factory(data, opts.threads, opts)
        except Unavailable as exc:
            result.skipped[name] = str(exc)
    if opts.scaling and opts.threads > 1:
        for name in SCALED:
            if name in fns:
                fns[f"{name}@1"] = factories[name][0](data, 1, opts)

    step(0.05, "warming up")
    numbers = {name: calibrate(fn, opts.min_sample_s) for name, fn in fns.items()}
    if "reference" in numbers:
        numbers["reference"] = 1
    result.max_rel_diff_vs_torch = _agreement(fns, "torch")
    result.max_rel_diff_vs_torch_compile = _agreement(fns, TORCH_COMPILE)
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
            samples[name].append(time_calls(fns[name], numbers[name]))
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


def _agreement(fns: Dict[str, Callable[[], Any]], other: str) -> Optional[float]:
    """max |bngrad dx - other's dx| / max |other's dx|: a guard against timing a wrong answer."""
    if "bngrad" not in fns or other not in fns:
        return None
    ours, theirs = _as_float64(fns["bngrad"]()), _as_float64(fns[other]())
    if not theirs.size:
        return 0.0
    scale = float(np.max(np.abs(theirs)))
    diff = float(np.max(np.abs(ours - theirs)))
    return diff / scale if scale else diff


def run_suite(suite: str, cases: Sequence[Case], opts: Options,
              on_progress: Optional[Callable[[float, str], None]] = None) -> SuiteResult:
    """Measure ``cases`` in order. ``on_progress(cases_done, text)``: fractional count, a label."""
    check_threads(opts.threads)
    check_repeat(opts.repeat)
    report = on_progress or (lambda done, text: None)
    machine = machine_info(opts.threads)  # before we load the machine ourselves
    others = OtherLoad()
    results = []
    with torch_threads(opts.threads):
        for i, case in enumerate(cases):
            def on_step(fraction, what, i=i, case=case):
                report(i + fraction, f"{case.label}: {what}")
            results.append(run_case(case, opts, on_step))
    machine["other_processes_cores"] = others.cores()
    return SuiteResult(suite, opts, machine, results)
