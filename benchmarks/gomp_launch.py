"""One kernel on PyTorch's OpenMP team (bngrad._gomp) against the same kernel on Numba's pool.

The kernel is bngrad._gomp's float32 channels-first grad_input pass, ``out = a*dy - b*(x -
mean) - d``; the "prange" variant runs the very same per-item body in a Numba ``prange`` loop
(TBB, as bngrad selects it). Each is timed alone, alternating with ``torch.relu`` on a tensor
of the same size (what happens between PyTorch operators in a model: the two pools compete
for the cores), and on a tiny array (the fixed cost of a launch). ``torch.add(a, b, out=c)``,
with the kernel's memory traffic, is the control: what alternating costs within one pool.
Variants run interleaved in this one process on the same number of threads; every figure is a
median over ``--repeat`` rounds of ``--inner`` calls, with the quartiles.

    python benchmarks/gomp_launch.py                       # (32, 64, 28, 28), torch's threads
    python benchmarks/gomp_launch.py --threads 2 --repeat 50 --shape 16 128 14 14

Results on a busy machine are noisy: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numba
import numpy as np
import torch
from numba import njit, prange

import bngrad  # noqa: F401  (selects Numba's TBB layer before the first parallel kernel)
from bngrad import _gomp


@njit(parallel=True, nogil=True)
def _prange_launch(args, n_items):
    """The launcher seam's other side: the same body, items run by Numba's prange pool."""
    for item in prange(n_items):
        _gomp._elemt_body(item, args)


def _arguments(shape, seg):
    A, C = shape[0], shape[1]
    B = int(np.prod(shape[2:]))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((A, C, B), dtype=np.float32)
    dy = rng.standard_normal((A, C, B), dtype=np.float32)
    out = np.empty_like(x)
    coef = rng.standard_normal((4, C)).astype(np.float32)
    seg = min(seg, B)
    args = np.array([A, C, B, seg, _gomp.address(x), _gomp.address(dy), _gomp.address(out),
                     _gomp.address(coef)], dtype=np.int64)
    n_items = A * C * -(-B // seg)
    # The arrays stay referenced by the closures below while the args hold their addresses.
    gomp = lambda: _gomp.elemt_channels_first(x, dy, out, coef, seg)  # noqa: E731
    tbb = lambda: _prange_launch(args, n_items)  # noqa: E731
    return gomp, tbb, (x, dy, out, coef)


def _time(fns: dict, repeat: int, inner: int) -> dict:
    for fn in fns.values():  # warm up: compile, start the pools, fault the pages in
        for _ in range(3):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():  # interleaved, so that machine noise hits all alike
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - t0) / inner)
    return times


def _row(name, samples):
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    print(f"{name:<34}{med * 1e3:>9.3f}   [{q1 * 1e3:.3f} - {q3 * 1e3:.3f}]"
          f"{min(samples) * 1e3:>10.3f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=30, help="timed rounds per variant")
    parser.add_argument("--inner", type=int, default=10, help="calls per round")
    parser.add_argument("--shape", type=int, nargs="+", default=[32, 64, 28, 28],
                        help="N C H W (or any N C ...)")
    parser.add_argument("--seg", type=int, default=16384, help="elements per work item")
    args = parser.parse_args(argv)
    if not _gomp.available():
        raise SystemExit(f"bngrad._gomp is unavailable: {_gomp.unavailable_reason()}")

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    shape = tuple(args.shape)
    gomp, tbb, _keep = _arguments(shape, args.seg)
    tiny_gomp, tiny_tbb, _keep_tiny = _arguments((1, 2, 8), args.seg)
    t = torch.randn(shape)
    a, b, c = torch.randn(shape), torch.randn(shape), torch.empty(shape)

    def relu():
        torch.relu(t)

    def add():  # control: PyTorch's own kernel with the same traffic (read 2, write 1)
        torch.add(a, b, out=c)

    fns = {
        "relu alone": relu,
        "gomp alone": gomp,
        "prange alone": tbb,
        "torch.add(out=) alone": add,
        "relu + gomp, alternating": lambda: (relu(), gomp()),
        "relu + prange, alternating": lambda: (relu(), tbb()),
        "relu + torch.add, alternating": lambda: (relu(), add()),
        "tiny (1, 2, 8): gomp": tiny_gomp,
        "tiny (1, 2, 8): prange": tiny_tbb,
    }
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs")
    times = _time(fns, args.repeat, args.inner)
    print(f"shape={shape} float32, threads={args.threads} (torch {torch.get_num_threads()}, "
          f"numba {numba.get_num_threads()}, layer {numba.threading_layer()}), "
          f"libgomp {_gomp._load().path}")
    print(f"repeat={args.repeat} x inner={args.inner}; ms per call (per pair when alternating): "
          "median [quartiles] min (on a busy machine the minimum says more)")
    for name, samples in times.items():
        _row(name, samples)
    med = {name: statistics.median(s) for name, s in times.items()}
    pair = {name: med[f"relu + {name}, alternating"] / (med["relu alone"] + med[f"{name} alone"])
            for name in ("gomp", "prange")}
    pair["torch.add"] = med["relu + torch.add, alternating"] / (med["relu alone"]
                                                               + med["torch.add(out=) alone"])
    print("alternating / (relu alone + kernel alone): "
          + ", ".join(f"{name} {ratio:.2f}" for name, ratio in pair.items()))
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
