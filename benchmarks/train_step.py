"""One training step of a ResNet-style block with PyTorch's batch norm and with bngrad's.

The block is conv3x3 - BN - ReLU - conv3x3 - BN, plus the identity, then ReLU; a step is
zero_grad, forward, a mean-square loss, backward and an SGD update. Both variants are the same
model (same weights, ``bngrad.torch.convert`` applied to a copy), run interleaved in this one
process on the same number of threads (torch's intra-op pool and Numba's), and reported as
medians and as the ratio bngrad / torch (< 1: bngrad faster). The batch norms alone (forward
and backward of both layers of the block, same inputs) are timed the same way, so that their
share of the step is visible.

    python benchmarks/train_step.py                    # default shapes, all cores
    python benchmarks/train_step.py --threads 1 --repeat 30 --layout channels_last
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numba
import torch
from torch import nn

import bngrad.torch as bt

SHAPES = [(32, 64, 28, 28), (16, 128, 14, 14), (64, 32, 32, 32)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


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
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():  # interleaved, so that machine noise hits both alike
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def run(shapes, dtype, layout, threads, repeat):
    torch.set_num_threads(threads)
    numba.set_num_threads(threads)
    memory_format = torch.channels_last if layout == "channels_last" else torch.contiguous_format
    print(f"threads={threads} (torch {torch.get_num_threads()}, numba {numba.get_num_threads()}), "
          f"dtype={dtype}, layout={layout}, repeat={repeat}; medians in ms")
    header = f"{'shape (N, C, H, W)':<22}{'what':<10}{'torch':>10}{'bngrad':>10}{'ratio':>8}"
    print(header)
    print("-" * len(header))
    rows = []
    for shape in shapes:
        torch.manual_seed(0)
        block = BasicBlock(shape[1]).to(DTYPES[dtype]).to(memory_format=memory_format)
        ours = bt.convert(copy.deepcopy(block))
        x = torch.randn(shape, dtype=DTYPES[dtype]).to(memory_format=memory_format)
        for what, make in (("step", _step_fn), ("bn only", _bn_only_fn)):
            t = _time_interleaved({"torch": make(block, x), "bngrad": make(ours, x)}, repeat)
            ratio = t["bngrad"] / t["torch"]
            rows.append((shape, what, t["torch"], t["bngrad"], ratio))
            print(f"{str(shape):<22}{what:<10}{t['torch'] * 1e3:>10.2f}{t['bngrad'] * 1e3:>10.2f}"
                  f"{ratio:>8.2f}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads for both torch and bngrad (default: torch's default)")
    parser.add_argument("--repeat", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="dtype of the whole block")
    parser.add_argument("--layout", choices=["contiguous", "channels_last"], default="contiguous")
    parser.add_argument("--shape", type=int, nargs=4, action="append", metavar=("N", "C", "H", "W"),
                        help="input shape (repeatable; default: a few ResNet stages)")
    args = parser.parse_args(argv)
    run(args.shape or SHAPES, args.dtype, args.layout, args.threads, args.repeat)


if __name__ == "__main__":
    main()
