"""bngrad.torch's kernels on PyTorch's OpenMP team against the same kernels on Numba's pool.

A ``bngrad.torch.batch_norm`` training forward (and, with ``--backward``, forward + backward)
at one shape, its kernels on each pool (``bngrad.torch.set_kernel_pool``: "torch" is
PyTorch's own OpenMP team, "numba" Numba's TBB pool), timed alone and alternating with
``torch.relu`` on a tensor of the same size (what happens between PyTorch operators in a
model: two pools compete for the cores, one does not); ``torch.add(a, b, out=c)`` is the
control, what alternating costs within PyTorch's pool. Variants run interleaved in this one
process on the same number of threads; every figure is a median over ``--repeat`` rounds of
``--inner`` calls, with the quartiles and the minimum.

    python benchmarks/gomp_launch.py                       # (32, 64, 28, 28), torch's threads
    python benchmarks/gomp_launch.py --threads 2 --repeat 50 --shape 16 128 14 14 --backward

Results on a busy machine are noisy: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numba
import torch

import bngrad.torch as bt


def _time(fns: dict, repeat: int, inner: int) -> dict:
    for fn in fns.values():  # warm up: compile, start the pools, fault the pages in
        for _ in range(3):
            fn()
    times: dict = {name: [] for name in fns}
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
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward instead of the forward")
    args = parser.parse_args(argv)
    previous = bt.kernel_pool()
    bt.set_kernel_pool("torch")
    if bt.kernel_pool() != "torch":
        raise SystemExit(f"PyTorch's team cannot be used: {bt.kernel_pool()}")

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    shape = tuple(args.shape)
    C = shape[1]
    x = torch.randn(shape, requires_grad=args.backward)
    grad = torch.randn(shape)
    weight, bias = torch.ones(C, requires_grad=args.backward), torch.zeros(C)
    running_mean, running_var = torch.zeros(C), torch.ones(C)
    t = torch.randn(shape)
    a, b, c = torch.randn(shape), torch.randn(shape), torch.empty(shape)

    def bn():
        y = bt.batch_norm(x, running_mean, running_var, weight, bias, training=True)
        if args.backward:
            y.backward(grad)

    def on(pool):
        def call():
            bt.set_kernel_pool(pool)
            bn()
        return call

    def relu():
        torch.relu(t)

    def add():  # control: PyTorch's own kernel with the traffic of a normalize pass
        torch.add(a, b, out=c)

    team, tbb = on("torch"), on("numba")
    fns = {
        "relu alone": relu,
        "bngrad, torch's team alone": team,
        "bngrad, numba's pool alone": tbb,
        "torch.add(out=) alone": add,
        "relu + bngrad on team": lambda: (relu(), team()),
        "relu + bngrad on numba": lambda: (relu(), tbb()),
        "relu + torch.add": lambda: (relu(), add()),
    }
    print(f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}, "
          f"{os.cpu_count()} CPUs")
    try:
        times = _time(fns, args.repeat, args.inner)
    finally:
        bt.set_kernel_pool("numba" if previous.startswith("numba") else "torch")
    what = "forward + backward" if args.backward else "training forward"
    print(f"shape={shape} float32 {what}, threads={args.threads} (torch "
          f"{torch.get_num_threads()}, numba {numba.get_num_threads()}, layer "
          f"{numba.threading_layer()})")
    print(f"repeat={args.repeat} x inner={args.inner}; ms per call (per pair when alternating): "
          "median [quartiles] min")
    for name, samples in times.items():
        _row(name, samples)
    med = {name: statistics.median(s) for name, s in times.items()}
    ratios = {
        "team": med["relu + bngrad on team"] / (med["relu alone"]
                                                + med["bngrad, torch's team alone"]),
        "numba": med["relu + bngrad on numba"] / (med["relu alone"]
                                                  + med["bngrad, numba's pool alone"]),
        "torch.add": med["relu + torch.add"] / (med["relu alone"]
                                                + med["torch.add(out=) alone"]),
    }
    print("alternating / (relu alone + other alone): "
          + ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items()))
    print(f"alternating pair, numba's pool / torch's team: "
          f"{med['relu + bngrad on numba'] / med['relu + bngrad on team']:.2f}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
