"""bngrad.torch's large results with and without the huge-page advice, beside PyTorch.

bngrad.torch asks for huge pages for results of 4 MiB or more (bngrad.torch._convert.
empty_like): PyTorch's allocator hands every tensor above glibc's mmap threshold (32 MiB)
fresh pages, faulted in 4 KiB at a time on first write. This times ``bngrad.torch.
BatchNorm2d`` forward and backward (a training step's calls, outputs freed as they go) with
the advice and without it (``_convert._madvise`` set to None), alternating in one process,
and ``torch.nn.BatchNorm2d`` the same way; medians in ms.

    .venv/bin/python benchmarks/huge_pages.py 32,256,56,56
    .venv/bin/python benchmarks/huge_pages.py 32,64,112,112 --channels-last --rounds 20

Measure on an idle machine. (Whether the advice takes depends on the kernel:
/sys/kernel/mm/transparent_hugepage/enabled "madvise" or "always".)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import bngrad.torch as bt
from bngrad.torch import _convert


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", help="N,C,H,W, e.g. 32,256,56,56")
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape = tuple(int(s) for s in args.shape.split(","))
    layout = torch.channels_last if args.channels_last else torch.contiguous_format
    x = torch.randn(shape).contiguous(memory_format=layout).requires_grad_()
    grad = torch.randn(shape).contiguous(memory_format=layout)
    advise = _convert._madvise
    variants = {"bngrad, advised": (bt.BatchNorm2d(shape[1]), advise),
                "bngrad, not advised": (bt.BatchNorm2d(shape[1]), None),
                "PyTorch": (torch.nn.BatchNorm2d(shape[1]), advise)}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    try:
        for r in range(args.rounds + 2):
            for name, (module, madvise) in variants.items():
                _convert._madvise = madvise
                x.grad = None
                t0 = time.perf_counter()
                y = module(x)
                t1 = time.perf_counter()
                y.backward(grad)
                t2 = time.perf_counter()
                del y
                if r >= 2:  # warm-up rounds
                    times[name].append((t1 - t0, t2 - t1))
    finally:
        _convert._madvise = advise
    print(f"{shape} float32 {'channels_last' if args.channels_last else 'NCHW'}, "
          f"{torch.get_num_threads()} threads, median of {args.rounds}:")
    for name, pairs in times.items():
        forward = statistics.median(p[0] for p in pairs) * 1e3
        backward = statistics.median(p[1] for p in pairs) * 1e3
        print(f"  {name:<20} forward {forward:8.2f} ms   backward {backward:8.2f} ms")


if __name__ == "__main__":
    main()
