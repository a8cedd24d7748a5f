"""The NumPy API's backward on each pool, beside PyTorch's, in a process that imported PyTorch.

Since session 29 a NumPy caller's kernels run on PyTorch's OpenMP team once PyTorch is imported
(bngrad._gomp.use_torch_team); before, on Numba's TBB pool. This times, per shape, in
interleaved rounds, each call after a pause of ``--gap`` ms (as the bench's cases follow one
another; PyTorch's team spins a while after its last operator, Numba's workers sleep at once):

- ``torch``: PyTorch's ``native_batch_norm_backward``;
- ``numba pool``: ``bngrad.batch_norm_backward`` on Numba's pool (``set_kernel_pool("numba")``,
  what a process without PyTorch gets);
- ``torch team``: the same call on PyTorch's team (the default here);
- ``serial``: the same call on one thread.

Medians in ms over ``--repeat`` rounds (one timed call each), every contender on ``--threads``.

    .venv/bin/python benchmarks/pool_ab.py
    .venv/bin/python benchmarks/pool_ab.py --shapes 65536,64 4096,1024 --gap 0
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

import bngrad
from bngrad import _gomp

SHAPES = ["65536,64", "256,4096", "4096,1024", "32,2048,7,7", "32,1024,14,14"]


def _contenders(shape: tuple, threads: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    w = torch.rand(shape[1], generator=g) + 0.5
    axes = (0,) + tuple(range(2, len(shape)))
    xn, dyn, wn = x.numpy(), dy.numpy(), w.numpy()
    mean = xn.mean(axes).astype(np.float32)
    invstd = (1 / np.sqrt(xn.var(axes) + 1e-5)).astype(np.float32)
    mean_t, invstd_t = torch.from_numpy(mean), torch.from_numpy(invstd)

    def on(pool: str, n: int):
        def call():
            _gomp.set_kernel_pool(pool)
            bngrad.batch_norm_backward(dyn, xn, wn, None, None, mean, invstd, num_threads=n)
        return call
    return {"torch": lambda: torch.ops.aten.native_batch_norm_backward(
                dy, x, w, None, None, mean_t, invstd_t, True, 1e-5, [True, True, True]),
            "numba pool": on("numba", threads), "torch team": on("torch", threads),
            "serial": on("torch", 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=SHAPES)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--gap", type=float, default=2.0, help="ms of pause before each call")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not _gomp.available():
        raise SystemExit(f"PyTorch's team is unavailable: {_gomp.unavailable_reason()}")
    previous = _gomp.kernel_pool()
    print(f"threads {args.threads}, a {args.gap} ms pause before each call; ms, medians of "
          f"{args.repeat}")
    try:
        for text in args.shapes:
            shape = tuple(int(v) for v in text.split(","))
            fns = _contenders(shape, args.threads)
            times: dict = {name: [] for name in fns}
            for _ in range(args.repeat):
                for name, fn in fns.items():
                    fn()  # warm (and the previous contender's threads go back to waiting)
                    time.sleep(args.gap / 1e3)
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
            print(f"{str(shape):>18} " + "  ".join(
                f"{name} {statistics.median(t):.3f}" for name, t in times.items()))
    finally:
        _gomp.set_kernel_pool("numba" if previous.startswith("numba") else "torch")


if __name__ == "__main__":
    main()
