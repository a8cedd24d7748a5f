"""Where bngrad.torch's time goes inside a training step, beside its kernels (issue 12).

Two measurements, both in one process, interleaved:

``--mode step`` (default): ResNet-20 (benchmarks/models.py) steps with three batch norms:
PyTorch's own module (``native``), a Python ``torch.autograd.Function`` that calls PyTorch's
own kernels (``aten.native_batch_norm`` and its backward: ``python-fn``), and
``bngrad.torch.convert`` (``bngrad``). ``python-fn`` differs from ``native`` only by the
Python layer, so its step ratio is what a Python autograd.Function costs in a real step.
Also printed: each layer's kernel call as timed inside the step (PyTorch's aten call in
``python-fn``; the NumPy API call in ``bngrad``), medians per channel count.

``--mode phases``: one (64, 64, 8, 8) float32 bngrad.torch backward (``--shape`` to change),
split at the points bngrad's code can see: the autograd engine until the Function's backward
starts, the torch layer until the NumPy API, the API until the kernel launch, the kernel, and
back; with the caches warm (forward just before) or cold (128 MiB streamed through them
first, as the rest of a step does), beside PyTorch's whole module backward.

    python benchmarks/step_overhead.py --threads 2 --rounds 15
    python benchmarks/step_overhead.py --mode phases --threads 1
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import statistics
import sys
import time

import numpy as np
import torch

import bngrad
import bngrad.kernels as kernels
import bngrad.torch as bt
from bngrad.torch import _eager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402  (benchmarks/models.py)

P = time.perf_counter
TIMES: dict = collections.defaultdict(list)


def _timed(name, fn, key):
    def wrapper(*args, **kwargs):
        t0 = P()
        result = fn(*args, **kwargs)
        TIMES[(name, key(args))].append(P() - t0)
        return result
    return wrapper


class _AtenBatchNorm(torch.autograd.Function):
    """PyTorch's own batch-norm kernels behind a Python autograd.Function."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var):
        t0 = P()
        y, mean, invstd = torch.ops.aten.native_batch_norm(x, weight, bias, running_mean,
                                                           running_var, True, 0.1, 1e-5)
        TIMES[("python-fn forward", x.shape[1])].append(P() - t0)
        ctx.save_for_backward(x, weight, running_mean, running_var, mean, invstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, running_mean, running_var, mean, invstd = ctx.saved_tensors
        t0 = P()
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad, x, weight, running_mean, running_var, mean, invstd, True, 1e-5,
            [True, True, True])
        TIMES[("python-fn backward", x.shape[1])].append(P() - t0)
        return gx, gw, gb, None, None


class _PythonFnBatchNorm2d(torch.nn.BatchNorm2d):
    def forward(self, x):
        return _AtenBatchNorm.apply(x, self.weight, self.bias, self.running_mean,
                                    self.running_var)


def _python_fn(model):
    for name, child in model.named_children():
        if type(child) is torch.nn.BatchNorm2d:
            new = _PythonFnBatchNorm2d(child.num_features)
            new.load_state_dict(child.state_dict())
            setattr(model, name, new)
        else:
            _python_fn(child)
    return model


def run_step(rounds: int) -> None:
    torch.manual_seed(0)
    native = models.resnet20()
    variants = {"native": native, "python-fn": _python_fn(copy.deepcopy(native)),
                "bngrad": bt.convert(copy.deepcopy(native))}
    bngrad_api = (bngrad.batch_norm_forward, bngrad.batch_norm_backward)
    _eager.bngrad.batch_norm_forward = _timed("bngrad forward", bngrad_api[0],
                                              lambda a: a[0].shape[1])
    _eager.bngrad.batch_norm_backward = _timed("bngrad backward", bngrad_api[1],
                                               lambda a: a[0].shape[1])
    x = torch.randn(64, 3, 32, 32)
    labels = torch.randint(0, 10, (64,))

    def stepper(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), labels).backward()
            opt.step()
        return step

    steps = {name: stepper(m) for name, m in variants.items()}
    for step in steps.values():
        for _ in range(3):
            step()
    TIMES.clear()
    times: dict = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = P()
            step()
            times[name].append(P() - t0)
    base = statistics.median(times["native"])
    for name, ts in times.items():
        ratios = [t / n for t, n in zip(ts, times["native"])]
        print(f"  {name:10s} step {statistics.median(ts) * 1e3:8.1f} ms   / native "
              f"{statistics.median(ratios):.3f} (median of the rounds' ratios; medians "
              f"{statistics.median(ts) / base:.3f})")
    print("  kernel calls inside the step, median us per call, by channel count:")
    for (name, channels), ts in sorted(TIMES.items()):
        print(f"    {name:20s} C={channels:<4d} {statistics.median(ts) * 1e6:8.0f}")
    bngrad.batch_norm_forward, bngrad.batch_norm_backward = bngrad_api
    _eager.bngrad.batch_norm_forward, _eager.bngrad.batch_norm_backward = bngrad_api


def run_phases(shape: tuple, rounds: int) -> None:
    stamps: dict = {}

    def stamped(fn, start, end):
        def wrapper(*args, **kwargs):
            stamps[start] = P()
            result = fn(*args, **kwargs)
            stamps[end] = P()
            return result
        return wrapper

    saved = (kernels.backward_train, bngrad.batch_norm_backward, _eager._BatchNorm.backward)
    kernels.backward_train = stamped(saved[0], "k0", "k1")
    _eager.bngrad.batch_norm_backward = stamped(saved[1], "a0", "a1")
    _eager._BatchNorm.backward = staticmethod(stamped(saved[2], "f0", "f1"))
    x = torch.randn(shape, requires_grad=True)
    grad = torch.randn(shape)
    ours, theirs = bt.BatchNorm2d(shape[1]), torch.nn.BatchNorm2d(shape[1])
    big = np.ones(16 << 20)
    sink = np.empty_like(big)
    phases = [("engine until the Function", None, "f0"), ("torch layer", "f0", "a0"),
              ("API until the kernel", "a0", "k0"), ("kernel", "k0", "k1"),
              ("API after", "k1", "a1"), ("torch layer after", "a1", "f1"),
              ("engine after", "f1", None)]
    for mode in ("warm", "cold"):
        rows: dict = collections.defaultdict(list)
        for _ in range(rounds):
            for name, module in (("bngrad", ours), ("PyTorch", theirs)):
                y = module(x)
                x.grad = module.weight.grad = module.bias.grad = None
                stamps.clear()
                if mode == "cold":
                    np.copyto(sink, big)
                t0 = P()
                y.backward(grad)
                t1 = P()
                rows[f"{name} whole backward"].append(t1 - t0)
                if name == "bngrad":
                    marks = {None: t0, **stamps}
                    marks_end = {None: t1, **stamps}
                    for phase, a, b in phases:   # (the one-call path has no separate launch)
                        if a in marks and b in marks_end:
                            rows[phase].append(marks_end[b] - marks[a])
        print(f"  {mode}: " + ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}"
                                        for k, v in rows.items() if len(v) > rounds // 2)
              + " (us)")
    kernels.backward_train, _eager.bngrad.batch_norm_backward = saved[:2]
    _eager._BatchNorm.backward = staticmethod(saved[2])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("step", "phases"), default="step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--shape", default="64,64,8,8", help="phases: N,C,H,W")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, load average {os.getloadavg()[0]:.2f} "
          "(measure on an idle machine)")
    if args.mode == "step":
        run_step(args.rounds)
    else:
        run_phases(tuple(int(s) for s in args.shape.split(",")), max(args.rounds, 20))


if __name__ == "__main__":
    main()
