"""Per-layer A/B of two trees of bngrad in one process: the working tree against a git revision.

The host this project is measured on changes speed by tens of percent within minutes, so a
before/after comparison from two runs says little. This script loads the tree of ``--rev``
as a second package, ``bngrad_old`` (its PyTorch operators renamed ``bngrad_old::*``, so that
both register), and times both in alternating rounds, with PyTorch's batch norm as a third
contender. For each shape, NCHW and NHWC, float32, it prints new/old time of

- ``np fwd``: ``bngrad.batch_norm_forward`` in training mode with running statistics;
- ``np bwd``: ``bngrad.batch_norm_backward``, all three gradients, into ``out``;
- ``bt f+b``: ``bngrad.torch.functional.batch_norm`` forward + ``backward()``,

and ``bt f+b`` over PyTorch's ``F.batch_norm`` forward + ``backward()``, new and old.
``--cold`` streams 128 MiB through the caches before each timed call, as the layers around a
batch norm do in a model, where a call's Python costs several times what it does in a loop
(benchmarks/results/2026-12-02-session20.txt).

    .venv/bin/python benchmarks/layer_ab.py --rev HEAD
    .venv/bin/python benchmarks/layer_ab.py --rev c5189fc --shapes 64,64,8,8 16,512,7,7

Measure on an idle machine (no test run beside it).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List

SHAPES = [(16, 128, 28, 28), (16, 256, 14, 14), (16, 512, 7, 7), (16, 64, 56, 56),
          (16, 128, 14, 14), (64, 64, 8, 8)]


def build_old(rev: str, root: str) -> str:
    """The package tree of ``rev`` as ``<dir>/bngrad_old``; returns ``<dir>``."""
    out = tempfile.mkdtemp(prefix="bngrad_old_")
    archive = subprocess.run(["git", "-C", root, "archive", rev, "src/bngrad"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    os.rename(os.path.join(out, "src", "bngrad"), os.path.join(out, "bngrad_old"))
    for folder, _, files in os.walk(os.path.join(out, "bngrad_old")):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                text = f.read()
            text = re.sub(r"^(\s*)import bngrad\b(?! as)", r"\1import bngrad_old as bngrad",
                          text, flags=re.M)
            text = re.sub(r"^(\s*)import bngrad as ", r"\1import bngrad_old as ", text,
                          flags=re.M)
            text = re.sub(r"\bfrom bngrad\b", "from bngrad_old", text)
            text = text.replace('"bngrad::', '"bngrad_old::')
            text = text.replace("torch.ops.bngrad.", "torch.ops.bngrad_old.")
            with open(path, "w") as f:
                f.write(text)
    return out


def _best(fn: Callable[[], Any], calls: int, evict: Callable[[], Any] = lambda: None
          ) -> float:
    best = float("inf")
    for _ in range(calls):
        evict()
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(shape: tuple, channels_last: bool, rounds: int, burst: int, threads: int = 2,
            cold: bool = False) -> Dict[str, float]:
    """Median over rounds of the best of ``burst`` calls, us, for every contender."""
    import numpy as np
    import torch

    import bngrad
    import bngrad.torch as bt
    import bngrad_old  # type: ignore[import-not-found]
    import bngrad_old.torch as bto  # type: ignore[import-not-found]
    from bngrad.torch._convert import to_numpy

    C = shape[1]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).contiguous(memory_format=fmt)
    dy = torch.randn(shape, generator=gen).contiguous(memory_format=fmt)
    w, b = torch.rand(C, generator=gen) + 0.5, torch.randn(C, generator=gen)
    rm, rv = torch.zeros(C), torch.ones(C)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    xn, dyn, wn, bn_ = to_numpy(x), to_numpy(dy), w.numpy(), b.numpy()
    out = np.empty_like(xn)
    _, save_mean, save_invstd = bngrad.batch_norm_forward(xn, wn, bn_, None, None, True)
    fns: Dict[str, Callable[[], Any]] = {}
    for tag, api, layer in (("new", bngrad, bt), ("old", bngrad_old, bto)):
        fns[f"np fwd {tag}"] = lambda api=api: api.batch_norm_forward(
            xn, wn, bn_, rm.numpy(), rv.numpy(), True, 0.1, 1e-5, num_threads=threads, out=out)
        fns[f"np bwd {tag}"] = lambda api=api: api.batch_norm_backward(
            dyn, xn, wn, None, None, save_mean, save_invstd, True, 1e-5, (True, True, True),
            num_threads=threads, out=out)
        fns[f"bt f+b {tag}"] = lambda layer=layer: layer.functional.batch_norm(
            xr, rm, rv, wr, br, True).backward(dy)
    fns["torch f+b"] = lambda: torch.nn.functional.batch_norm(xr, rm, rv, wr, br,
                                                              True).backward(dy)
    for fn in fns.values():  # compile, warm up
        fn()
        fn()
    names = list(fns)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    big = np.ones(16 << 20) if cold else None
    sink = np.empty_like(big) if cold else None
    evict = (lambda: np.copyto(sink, big)) if cold else (lambda: None)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_best(fns[name], burst, evict))
    return {name: statistics.median(v) * 1e6 for name, v in samples.items()}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--shapes", nargs="*", default=None, help="N,C,H,W ...")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--burst", type=int, default=20, help="calls per contender and round")
    parser.add_argument("--cold", action="store_true",
                        help="stream 128 MiB through the caches before each timed call")
    parser.add_argument("--threads", type=int, default=2,
                        help="threads for both trees and PyTorch (torch.set_num_threads)")
    args = parser.parse_args(argv)
    shapes = ([tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes
              else SHAPES)
    sys.path.insert(0, build_old(args.rev, os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    import torch
    torch.set_num_threads(args.threads)
    print("new/old time (np fwd | np bwd | bt f+b); bngrad.torch f+b / PyTorch, new (old)")
    for shape in shapes:
        for channels_last in (True, False):
            m = measure(shape, channels_last, args.rounds, args.burst, args.threads,
                        args.cold)
            ratios = " | ".join(f"{m[k + ' new'] / m[k + ' old']:.2f}"
                                for k in ("np fwd", "np bwd", "bt f+b"))
            print(f"{shape} {'NHWC' if channels_last else 'NCHW'}: {ratios}   "
                  f"{m['bt f+b new'] / m['torch f+b']:.2f} "
                  f"({m['bt f+b old'] / m['torch f+b']:.2f})", flush=True)


if __name__ == "__main__":
    main()
