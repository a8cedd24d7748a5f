"""Re-measure a tuning constant of bngrad.kernels (or compare kernel paths) on one shape.

Times one operation on one array, alternating between settings in the same process (the way
every figure in docs/internals.md's "Tuning constants" was taken: "same process", minimum
over rounds), for each value of one constant (``--set name=v1,v2``) or each forced path
(``--path fused,short``). Examples:

    .venv/bin/python benchmarks/tuning.py 32,2048,7,7 --op reduce --set short_group_lanes=1024,1536
    .venv/bin/python benchmarks/tuning.py 32,64,28,28 --op backward --path fused,short
    .venv/bin/python benchmarks/tuning.py 131072,256 --op reduce --set fold_lanes=256,4096
    .venv/bin/python benchmarks/tuning.py 64,64,8,8 --nhwc --cold --set fold_lanes=512,4096

``--cold`` streams 128 MiB through the caches before each timed call, so that x and dy come
from memory, as in a model, where the layers around a batch norm have evicted them; it prints
the median as well as the minimum (cold calls vary more). The copy is PyTorch's, on its
OpenMP team, where bngrad's calls then run too (bngrad._gomp), as in a model: a NumPy copy
would leave the pool's threads asleep, and the figures would measure their waking.

Results depend on the machine and its load: measure on an idle machine, several times.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import bngrad
from bngrad import _dtypes, kernels

OPS = ("backward", "forward", "reduce", "elemt", "eval")


def _call(op, x, dy, stats, out, threads):
    mean, invstd = stats
    kw = dict(num_threads=threads)
    if op == "backward":
        bngrad.batch_norm_backward(dy, x, None, None, None, mean, invstd, out=out, **kw)
    elif op == "eval":
        bngrad.batch_norm_backward(dy, x, None, mean, 1 / invstd**2, train=False, out=out, **kw)
    elif op == "forward":
        bngrad.batch_norm_forward(x, out=out, **kw)
    elif op == "reduce":
        bngrad.batch_norm_backward_reduce(dy, x, mean, invstd, **kw)
    else:
        bngrad.batch_norm_backward_elemt(dy, x, mean, invstd, None, mean, mean, 10, out=out,
                                         **kw)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", help="comma-separated, channels on axis 1, e.g. 32,256,14,14")
    parser.add_argument("--op", choices=OPS, default="backward")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--nhwc", action="store_true", help="channels-last memory layout")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=30, help="rounds (default 30)")
    parser.add_argument("--cold", action="store_true",
                        help="evict the caches before each timed call")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--set", metavar="NAME=V1,V2,...", help="values of one constant")
    group.add_argument("--path", metavar="P1,P2,...", help="kernel paths to force")
    args = parser.parse_args(argv)

    shape = tuple(int(n) for n in args.shape.split(","))
    dtype = _dtypes.by_alias(args.dtype)
    if dtype is None:
        parser.error(f"unknown dtype {args.dtype!r}")
    rng = np.random.default_rng(0)
    x, dy = (rng.standard_normal(shape).astype(dtype.numpy) for _ in range(2))
    if args.nhwc and len(shape) > 2:
        order = (0,) + tuple(range(2, len(shape))) + (1,)
        x, dy = (np.ascontiguousarray(a.transpose(order)).transpose(np.argsort(order))
                 for a in (x, dy))
    mean, var = bngrad.batch_norm_moments(x)
    stats = (mean.astype(dtype.stat), (1 / np.sqrt(var + 1e-5)).astype(dtype.stat))
    out = np.empty_like(x)

    if args.set:
        name, values = args.set.split("=")
        settings = {f"{name}={v}": lambda v=int(v): kernels.override(**{name: v})
                    for v in values.split(",")}
    else:
        settings = {p: lambda p=p: kernels.forced_path(p) for p in args.path.split(",")}
    times: dict[str, list[float]] = {label: [] for label in settings}
    if args.cold:
        import torch
        big, sink = torch.ones(16 << 20, dtype=torch.float64), torch.empty(16 << 20,
                                                                             dtype=torch.float64)
        if args.threads:
            torch.set_num_threads(args.threads)
    for setting in settings.values():  # compile and warm every setting first
        with setting():
            _call(args.op, x, dy, stats, out, args.threads)
    for _ in range(args.repeat):
        for label, setting in settings.items():
            with setting():
                if args.cold:
                    sink.copy_(big)
                start = time.perf_counter()
                _call(args.op, x, dy, stats, out, args.threads)
                times[label].append(time.perf_counter() - start)
    with next(iter(settings.values()))():
        print(bngrad.explain(x, dy, num_threads=args.threads))
    for label, seconds in times.items():
        median = f"  {np.median(seconds) * 1e3:8.3f} ms (median)" if args.cold else ""
        print(f"{args.op} {shape} {dtype.name}: {label:>28}  {min(seconds) * 1e3:8.3f} ms (min)"
              + median)


if __name__ == "__main__":
    main()
