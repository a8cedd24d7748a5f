"""One training step with PyTorch's batch norm and with bngrad's: a ResNet block or a whole ResNet.

``--model block`` (default): ResNet's basic block, conv3x3 - BN - ReLU - conv3x3 - BN, plus the
identity, then ReLU, at a few stage shapes; a step is zero_grad, forward, a mean-square loss,
backward and an SGD update. The batch norms alone (forward and backward of both layers of the
block, same inputs) are timed the same way, so that their share of the step is visible.

``--model resnet18`` (ImageNet layout, 112x112, batch 16) and ``--model resnet20`` (CIFAR,
32x32, batch 64), from ``benchmarks/models.py``: a step is zero_grad, forward, cross-entropy
on fixed labels, backward and SGD. Both memory layouts by default. Printed per layout:

- the step time of each variant and the ratio bngrad / torch (medians over the rounds, with
  quartiles; the ratio's median and quartiles are those of the per-round ratios);
- the batch norms alone: every BN layer's forward + backward on the input it sees in the
  model (captured once) and a random output gradient, summed over the layers;
- the batch norms' share of the step: "alone" is the line above over the step, "in step" is
  torch.profiler's time in the batch-norm calls (forward and backward nodes) over the wall
  time of a few profiled steps (profiling inflates small operations: indicative only).

Both variants are the same model (same weights, ``bngrad.torch.convert`` applied to a copy),
run interleaved in this one process on the same number of threads (torch's intra-op pool and
Numba's), and reported as ratios bngrad / torch (< 1: bngrad faster).

``--fuse`` adds a third variant, ``bngrad.torch.convert(copy, fuse=True)`` (BN→ReLU and
BN→add→ReLU fused), timed in the same rounds: its step and its ratio to torch's step, and its
share of the step in the fused calls (which also do the ReLU and the add that torch's share
does not count).

    python benchmarks/train_step.py                    # the block, default shapes, all cores
    python benchmarks/train_step.py --threads 1 --repeat 30 --layout channels_last
    python benchmarks/train_step.py --model resnet18 --threads 2 --repeat 20
    python benchmarks/train_step.py --model resnet20 --layout contiguous --batch 128
    python benchmarks/train_step.py --model resnet20 --fuse --repeat 20
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import numba
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import bngrad.torch as bt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402  (benchmarks/models.py)

SHAPES = [(32, 64, 28, 28), (16, 128, 14, 14), (64, 32, 32, 32)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
# name: (builder, classes, default batch, default image size)
MODELS = {"resnet18": (models.resnet18, 1000, 16, 112), "resnet20": (models.resnet20, 10, 64, 32)}
# Names of the batch-norm calls in torch.profiler's tables: PyTorch's forward op and autograd
# node, and bngrad.torch's eager autograd.Functions (forward) and their backward nodes (the fused
# model also has unfused batch norms, e.g. ResNet-18's shortcuts).
BN_EVENTS = {"torch": ("aten::batch_norm", "NativeBatchNormBackward0"),
             "bngrad": ("_BatchNorm", "_BatchNormBackward"),
             "fused": ("_BatchNorm", "_BatchNormBackward", "_BatchNormReLU",
                       "_BatchNormReLUBackward")}


class BasicBlock(nn.Module):
    """ResNet's basic block (He et al. 2016), stride 1, no downsampling."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + x)


def _step_fn(model, x):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
    return step


def _bn_only_fn(model, x):
    bns = [model.bn1, model.bn2]
    inputs = [x.detach().clone().requires_grad_() for _ in bns]
    grads = [torch.randn_like(x) for _ in bns]

    def step():
        for bn, inp, g in zip(bns, inputs, grads):
            inp.grad = None
            bn(inp).backward(g)
    return step


def _time_interleaved(fns: dict, repeat: int, warmup: int = 3) -> dict:
    """{name: [seconds per call, one per round]}, the functions called in turn each round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():  # interleaved, so that machine noise hits both alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def _medians(times: dict) -> dict:
    return {name: statistics.median(t) for name, t in times.items()}


def run(shapes, dtype, layout, threads, repeat, fuse=False):
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    memory_format = LAYOUTS[layout]
    print(f"threads={threads} (torch {torch.get_num_threads()}, numba {numba.get_num_threads()}), "
          f"dtype={dtype}, layout={layout}, repeat={repeat}; medians in ms")
    header = f"{'shape (N, C, H, W)':<22}{'what':<10}{'torch':>10}{'bngrad':>10}{'ratio':>8}"
    if fuse:
        header += f"{'fused':>10}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    rows = []
    for shape in shapes:
        torch.manual_seed(0)
        block = BasicBlock(shape[1]).to(DTYPES[dtype]).to(memory_format=memory_format)
        ours = bt.convert(copy.deepcopy(block))
        fused = bt.convert(copy.deepcopy(block), fuse=True) if fuse else None
        x = torch.randn(shape, dtype=DTYPES[dtype]).to(memory_format=memory_format)
        for what, make in (("step", _step_fn), ("bn only", _bn_only_fn)):
            fns = {"torch": make(block, x), "bngrad": make(ours, x)}
            if fused is not None and what == "step":  # the fused layers take other arguments
                fns["fused"] = make(fused, x)
            t = _medians(_time_interleaved(fns, repeat))
            ratio = t["bngrad"] / t["torch"]
            rows.append((shape, what, t["torch"], t["bngrad"], ratio, t.get("fused")))
            line = (f"{str(shape):<22}{what:<10}{t['torch'] * 1e3:>10.2f}"
                    f"{t['bngrad'] * 1e3:>10.2f}{ratio:>8.2f}")
            if "fused" in t:
                line += f"{t['fused'] * 1e3:>10.2f}{t['fused'] / t['torch']:>8.2f}"
            print(line)
    return rows


# --- whole models -----------------------------------------------------------------------------

def _model_step_fn(model, x, labels):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x).float(), labels)
        loss.backward()
        opt.step()
    return step


def _batch_norms(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _bn_inputs(model, x):
    """The input each batch norm of ``model`` sees in a forward pass of ``x``, in order."""
    seen = []
    hooks = [bn.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
             for bn in _batch_norms(model)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _bns_alone_fn(bns, inputs):
    """Forward + backward of every batch norm on its own input and a random gradient."""
    leaves = [i.clone().requires_grad_() for i in inputs]
    grads = [torch.randn_like(i) for i in inputs]

    def step():
        for bn, leaf, g in zip(bns, leaves, grads):
            leaf.grad = None
            bn(leaf).backward(g)
    return step


def _bn_share_in_step(step, variant: str, steps: int) -> float:
    """Share of the step's wall time spent in batch-norm calls, by torch.profiler."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    names = BN_EVENTS[variant]
    found = [e for e in prof.key_averages() if e.key in names]
    if not found:
        print(f"  (profiler: no events named {names} for {variant}; the share is not measured)")
        return float("nan")
    return sum(e.cpu_time_total for e in found) * 1e-6 / wall


def _spread(samples, scale=1e3, fmt=".2f") -> str:
    if len(samples) == 1:
        samples = samples * 2
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return f"{med * scale:{fmt}} [{q1 * scale:{fmt}}-{q3 * scale:{fmt}}]"


def run_model(name, dtype, layouts, threads, repeat, batch=None, size=None, profile_steps=3,
              fuse=False):
    """Time ``name`` (a key of MODELS) with each batch norm, one layout after the other."""
    torch.set_num_threads(threads)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    build, classes, default_batch, default_size = MODELS[name]
    batch, size = batch or default_batch, size or default_size
    print(f"{name}, input ({batch}, 3, {size}, {size}), dtype={dtype}, threads={threads} "
          f"(torch {torch.get_num_threads()}, numba {numba.get_num_threads()}), repeat={repeat}; "
          f"ms, median [quartiles]")
    results = {}
    for layout in layouts:
        memory_format = LAYOUTS[layout]
        torch.manual_seed(0)
        model = build(classes).to(DTYPES[dtype]).to(memory_format=memory_format)
        ours = bt.convert(copy.deepcopy(model))
        x = torch.randn(batch, 3, size, size, dtype=DTYPES[dtype]).to(memory_format=memory_format)
        labels = torch.randint(0, classes, (batch,))
        steps = {"torch": _model_step_fn(model, x, labels),
                 "bngrad": _model_step_fn(ours, x, labels)}
        if fuse:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", bt.FusionWarning)
                fused = bt.convert(copy.deepcopy(model), fuse=True)
            steps["fused"] = _model_step_fn(fused, x, labels)
        inputs = _bn_inputs(model, x)
        alone = {"torch": _bns_alone_fn(_batch_norms(model), inputs),
                 "bngrad": _bns_alone_fn(_batch_norms(ours), inputs)}
        t = _time_interleaved({**{("step", k): f for k, f in steps.items()},
                               **{("bn", k): f for k, f in alone.items()}}, repeat)
        share = {k: _bn_share_in_step(steps[k], k, profile_steps) for k in steps}
        step_ratio = [b / a for a, b in zip(t["step", "torch"], t["step", "bngrad"])]
        bn_ratio = [b / a for a, b in zip(t["bn", "torch"], t["bn", "bngrad"])]
        med = _medians(t)
        print(f"  {layout} ({len(inputs)} batch norms)")
        print(f"    {'':<26}{'torch':>26}{'bngrad':>26}{'bngrad / torch':>26}")
        print(f"    {'step':<26}{_spread(t['step', 'torch']):>26}{_spread(t['step', 'bngrad']):>26}"
              f"{_spread(step_ratio, 1, '.3f'):>26}")
        print(f"    {'BN fwd+bwd alone':<26}{_spread(t['bn', 'torch']):>26}"
              f"{_spread(t['bn', 'bngrad']):>26}{_spread(bn_ratio, 1, '.3f'):>26}")
        alone_share = {k: med["bn", k] / med["step", k] for k in alone}
        print(f"    {'BN share: alone / step':<26}{alone_share['torch']:>26.1%}"
              f"{alone_share['bngrad']:>26.1%}")
        print(f"    {'BN share: in step (prof)':<26}{share['torch']:>26.1%}"
              f"{share['bngrad']:>26.1%}")
        results[layout] = {"step_ratio": statistics.median(step_ratio),
                           "bn_ratio": statistics.median(bn_ratio), "medians": med,
                           "share_alone": alone_share, "share_profiled": share}
        if fuse:
            fused_ratio = [b / a for a, b in zip(t["step", "torch"], t["step", "fused"])]
            n_fused = len(fused.bngrad_fusion_report.fused)
            label = f"step, fused ({n_fused} BN)"
            print(f"    {label:<26}{'':>26}{_spread(t['step', 'fused']):>26}"
                  f"{_spread(fused_ratio, 1, '.3f'):>26}")
            print(f"    {'fused share in step (prof)':<26}{'':>26}{share['fused']:>26.1%}")
            results[layout]["fused_step_ratio"] = statistics.median(fused_ratio)
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["block", *MODELS], default="block",
                        help="a ResNet basic block at a few shapes (default), or a whole ResNet")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads for both torch and bngrad (default: torch's default)")
    parser.add_argument("--repeat", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="dtype of the whole model")
    parser.add_argument("--layout", choices=[*LAYOUTS, "both"], default=None,
                        help="memory layout (default: contiguous for the block, both for models)")
    parser.add_argument("--shape", type=int, nargs=4, action="append", metavar=("N", "C", "H", "W"),
                        help="block only: input shape (repeatable; default: a few ResNet stages)")
    parser.add_argument("--fuse", action="store_true",
                        help="also time bngrad.torch.convert(model, fuse=True)")
    parser.add_argument("--batch", type=int, help="models only: batch size (default 16 / 64)")
    parser.add_argument("--size", type=int, help="models only: image size (default 112 / 32)")
    args = parser.parse_args(argv)
    if args.model == "block":
        if args.batch or args.size:
            parser.error("--batch and --size are for --model resnet18|resnet20")
        layouts = list(LAYOUTS) if args.layout == "both" else [args.layout or "contiguous"]
        for layout in layouts:
            run(args.shape or SHAPES, args.dtype, layout, args.threads, args.repeat, args.fuse)
    else:
        if args.shape:
            parser.error("--shape is for --model block (use --batch and --size)")
        layouts = list(LAYOUTS) if args.layout in (None, "both") else [args.layout]
        run_model(args.model, args.dtype, layouts, args.threads, args.repeat, args.batch, args.size,
                  fuse=args.fuse)


if __name__ == "__main__":
    main()
