"""The machine a run measures on, other processes' load during it, and the first call of
bngrad in a fresh process (cold and warm kernel cache)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Optional, Tuple

import numba
import numpy as np

import bngrad
from bngrad import _gomp
from bngrad._threads import threading_layer

from .contenders import Unavailable, import_torch


def pool_size() -> int:
    """Threads in Numba's pool (``NUMBA_NUM_THREADS``): the most any run can use."""
    return int(numba.config.NUMBA_NUM_THREADS)


def default_threads() -> int:
    """Every core this process may run on (capped at Numba's pool size)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, pool_size()))


class OtherLoad:
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
        torch_version = import_torch()[0].__version__
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
        # where bngrad's kernels run in this process (PyTorch's team once it is imported)
        "kernel_pool": "torch" if _gomp.use_torch_team() else "numba",
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
from bngrad._bench import Case, make_arrays
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
