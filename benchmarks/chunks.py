"""Arrays copied a chunk of rows at a time against one whole copy (kernels.Config.
copy_chunk_bytes; docs/internals.md, "Copies, a chunk of rows at a time").

For each case (mixed layouts and sliced inputs, forward and backward with ``out=`` given, so
that only the temporaries are allocated) and each chunk budget, prints the median time over
interleaved rounds (every budget once per round, in one process) and the peak of the memory
allocated during one call (tracemalloc: NumPy reports its buffers to it). Measure on an idle
machine.

    .venv/bin/python benchmarks/chunks.py
    .venv/bin/python benchmarks/chunks.py --budgets 0,2097152,8388608 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

import bngrad
from bngrad import kernels


def _channels_last(a: np.ndarray) -> np.ndarray:
    perm = (0,) + tuple(range(2, a.ndim)) + (1,)
    return np.ascontiguousarray(a.transpose(perm)).transpose(np.argsort(perm))


def _sliced(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    big = rng.standard_normal(shape[:-1] + (shape[-1] + 8,), dtype=np.float32)
    return big[..., 4:shape[-1] + 4]


def _cases(threads: int) -> dict:
    rng = np.random.default_rng(0)
    shape, flat = (32, 256, 56, 56), (24576, 1024)
    x, g = (rng.standard_normal(shape, dtype=np.float32) for _ in range(2))
    xh, gh, xs = _channels_last(x), _channels_last(g), _sliced(rng, shape)
    x2, g2 = (rng.standard_normal(flat, dtype=np.float32) for _ in range(2))
    x2s = _sliced(rng, flat)
    w, b, w2 = np.ones(256, np.float32), np.zeros(256, np.float32), np.ones(1024, np.float32)
    _, m, s = bngrad.batch_norm_forward(x, w, b, None, None, True)
    _, m2, s2 = bngrad.batch_norm_forward(x2, w2, None, None, None, True)
    out, out_h, out2 = np.empty_like(x), np.empty_like(xh), np.empty_like(x2)
    kw = dict(num_threads=threads)
    return {
        "backward, x NCHW, dy NHWC": lambda: bngrad.batch_norm_backward(
            gh, x, w, None, None, m, s, True, out=out, **kw),
        "backward, x NHWC, dy NCHW": lambda: bngrad.batch_norm_backward(
            g, xh, w, None, None, m, s, True, out=out_h, **kw),
        "backward, x sliced": lambda: bngrad.batch_norm_backward(
            g, xs, w, None, None, m, s, True, out=out, **kw),
        "forward, x sliced": lambda: bngrad.batch_norm_forward(
            xs, w, b, None, None, True, out=out, **kw),
        "backward, 2-D x sliced": lambda: bngrad.batch_norm_backward(
            g2, x2s, w2, None, None, m2, s2, True, out=out2, **kw),
        "forward, 2-D x sliced": lambda: bngrad.batch_norm_forward(
            x2s, w2, None, None, None, True, out=out2, **kw),
    }


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0,8388608,33554432",
                        help="copy_chunk_bytes values, comma-separated (0: whole copies)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    budgets = [int(v) or 1 << 60 for v in args.budgets.split(",")]
    names = ["whole" if v == 1 << 60 else f"{v / 2**20:g} MiB" for v in budgets]
    cases = _cases(args.threads)
    times: dict = {(c, v): [] for c in cases for v in budgets}
    for _ in range(args.rounds):
        for case, fn in cases.items():
            for v in budgets:
                with kernels.override(copy_chunk_bytes=v):
                    t0 = time.perf_counter()
                    fn()
                    times[case, v].append(time.perf_counter() - t0)
    print(f"(32, 256, 56, 56) and (24576, 1024) float32, {args.rounds} rounds; "
          "median ms / peak MiB allocated during a call")
    print(f"{'case':<28}" + "".join(f"{n:>22}" for n in names))
    for case, fn in cases.items():
        line = f"{case:<28}"
        for v in budgets:
            with kernels.override(copy_chunk_bytes=v):
                peak = _peak(fn) / 2**20
            line += f"{statistics.median(times[case, v]) * 1e3:>9.1f} ms {peak:>6.1f} MiB"
        print(line)


if __name__ == "__main__":
    main()
