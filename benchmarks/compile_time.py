"""CPU time Numba spends compiling bngrad's kernels for a fresh process's first calls.

Most of a cold test run (and of CI) is Numba compiling kernels; this measures that work on a
fixed set of first calls, so that a change to how the kernels are written can be judged by
it. It runs in a child process with an empty ``NUMBA_CACHE_DIR`` (nothing comes from the disk
cache) and makes, for each dtype, the first calls of a training forward, a backward, a fused
forward with a side input and a fused backward given the mask bits, on a small (3, 4, 2, 5)
array on one thread. It prints the CPU seconds per dtype and in all, and with ``--functions``
the compile time of each Numba function (nested: a function's time includes the functions it
compiled on the way, from Numba's compile events).

    .venv/bin/python benchmarks/compile_time.py
    .venv/bin/python benchmarks/compile_time.py --dtypes float16 --functions
    PYTHONPATH=/tmp/before/src .venv/bin/python benchmarks/compile_time.py   # another tree

Run it on an idle machine; a second process compiling at the same time slows both.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

_CHILD = r"""
import collections, sys, time
from numba.core import event
import numpy as np
import bngrad
from bngrad import _dtypes

compile_time, compiles = collections.defaultdict(float), collections.Counter()


class Listener(event.Listener):
    def __init__(self):
        self.started = {}

    def on_start(self, ev):
        self.started[id(ev.data["dispatcher"]), str(ev.data["args"])] = time.process_time()

    def on_end(self, ev):
        d = ev.data["dispatcher"]
        name = getattr(d, "__name__", None) or d.py_func.__name__
        start = self.started.pop((id(d), str(ev.data["args"])))
        compile_time[name] += time.process_time() - start
        compiles[name] += 1


event.register("numba:compile", Listener())
total = time.process_time()
for name in sys.argv[2:]:
    dtype = _dtypes.spec(name).numpy
    param = _dtypes.stat_dtype(dtype)
    x = np.random.default_rng(0).standard_normal((3, 4, 2, 5)).astype(dtype)
    dy, w = x.copy(), np.ones(4, param)
    start = time.process_time()
    _, mean, invstd = bngrad.batch_norm_forward(x, w, w, None, None, True, num_threads=1)
    bngrad.batch_norm_backward(dy, x, w, None, None, mean, invstd, True, num_threads=1)
    _, mean, invstd, bits = bngrad.batch_norm_relu_forward(x, w, w, None, None, True,
                                                           side_input=dy, num_threads=1)
    bngrad.batch_norm_relu_backward(dy, x, w, None, None, mean, invstd, True, relu_mask=bits,
                                    num_threads=1)
    print(f"{name:9s} {time.process_time() - start:7.1f} s CPU")
print(f"{'all':9s} {time.process_time() - total:7.1f} s CPU (bngrad from "
      f"{bngrad.__file__.rsplit('/', 2)[0]})")
if sys.argv[1] == "functions":
    print("compile time per function, nested (s CPU, compilations):")
    for name, seconds in sorted(compile_time.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {seconds:7.1f} {compiles[name]:4d}  {name}")
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="*", default=["float16", "float32"],
                        choices=["float64", "float32", "float16", "bfloat16"])
    parser.add_argument("--functions", action="store_true",
                        help="also print each Numba function's compile time")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        mode = "functions" if args.functions else "total"
        return subprocess.run([sys.executable, "-c", _CHILD, mode, *args.dtypes],
                              env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
