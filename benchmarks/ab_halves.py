"""Half dtypes per byte against float32: the time of a half-precision call over the float32
call's, same shape and layout, interleaved in one process (ratios survive a host whose
speed drifts between processes; 0.5 is the ratio of the bytes).

Two measures: the channels-last and 2-D reduce (``batch_norm_backward_reduce``) on one
thread in cache, where the arithmetic shows, and the training backward with ``out=`` on
large arrays, all threads. Run before and after a change to the half-precision sums
(docs/internals.md, ``_LANE_BLOCK_ROWS``):

    .venv/bin/python benchmarks/ab_halves.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import bngrad
from bngrad import _dtypes

DTYPES = ("float32", "bfloat16", "float16")


def _arrays(shape, layout, name, rng):
    dt = _dtypes.spec(name).numpy
    x, dy = (rng.standard_normal(shape).astype(np.float32).astype(dt) for _ in range(2))
    if layout == "nhwc":  # same values, channels innermost in memory
        x, dy = (np.moveaxis(np.ascontiguousarray(np.moveaxis(a, 1, -1)), -1, 1)
                 for a in (x, dy))
    return x, dy


def _ratios(cases, op, threads, rounds):
    rng = np.random.default_rng(0)
    out = []
    for shape, layout in cases:
        calls = {}
        for name in DTYPES:
            x, dy = _arrays(shape, layout, name, rng)
            C = shape[1]
            w, m, iv = np.ones(C, np.float32), np.zeros(C, np.float32), np.ones(C, np.float32)
            o = np.empty_like(x)
            if op == "reduce":
                calls[name] = (lambda x=x, dy=dy, m=m, iv=iv, w=w:
                               bngrad.batch_norm_backward_reduce(dy, x, m, iv, w,
                                                                 num_threads=threads))
            else:
                calls[name] = (lambda x=x, dy=dy, m=m, iv=iv, w=w, o=o:
                               bngrad.batch_norm_backward(dy, x, w, None, None, m, iv, True,
                                                          out=o, num_threads=threads))
            calls[name]()
        times: dict = {name: [] for name in calls}
        for _ in range(rounds):
            for name, call in calls.items():
                t = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t)
        med = {name: float(np.median(v)) for name, v in times.items()}
        f32 = med["float32"]
        out.append(f"{'x'.join(map(str, shape))} {layout}: bfloat16 {med['bfloat16'] / f32:.2f}"
                   f" float16 {med['float16'] / f32:.2f}"
                   f" (float32 {1e3 * f32:.3f} ms)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="for the backward (default: all)")
    args = parser.parse_args()
    print("reduce, 1 thread, in cache: time / float32's")
    for line in _ratios([((4, 64, 32, 32), "nhwc"), ((4, 64, 32, 32), "nchw"), ((1024, 256), "nc")],
                        "reduce", 1, 600):
        print("  " + line)
    print(f"training backward with out=, {args.threads or 'all'} threads: time / float32's")
    for line in _ratios([((32, 64, 56, 56), "nhwc"), ((4096, 1024), "nc"), ((256, 4096), "nc")],
                        "backward", args.threads, 25):
        print("  " + line)


if __name__ == "__main__":
    main()
