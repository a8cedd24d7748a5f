"""bngrad's NumPy forward and backward against PyTorch's native ops on the batch-norm shapes of
ResNet-20 (CIFAR, batch 64) and ResNet-18 (112x112, batch 16), NCHW and channels_last: where a
training step's remaining gap comes from (issues 12 and 14). Prints medians in ms and the
ratio bngrad / torch (below 1: bngrad faster).

    python benchmarks/model_shapes.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import bngrad

SHAPES = [(64, 16, 32, 32), (64, 32, 16, 16), (64, 64, 8, 8),  # ResNet-20
          (16, 64, 56, 56), (16, 128, 28, 28), (16, 256, 14, 14), (16, 512, 7, 7)]  # ResNet-18


def median_ms(call, rounds: int = 30) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1e3


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as an (N, C, H, W) view (channels_last stays channels-last)."""
    return t.permute(0, 2, 3, 1).numpy().transpose(0, 3, 1, 2)


def one_case(shape, channels_last: bool, threads: int) -> str:
    C = shape[1]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape).contiguous(memory_format=fmt)
    dy = torch.randn(shape).contiguous(memory_format=fmt)
    w, b, rm, rv = torch.ones(C), torch.zeros(C), torch.zeros(C), torch.ones(C)
    _, mean, invstd = torch.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    torch_fwd = median_ms(lambda: torch.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5))
    torch_bwd = median_ms(lambda: torch.ops.aten.native_batch_norm_backward(
        dy, x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True]))
    xn, dyn = as_numpy(x), as_numpy(dy)
    wn, bn, rmn, rvn = w.numpy(), b.numpy(), rm.numpy().copy(), rv.numpy().copy()
    out, grad_input = np.empty_like(xn), np.empty_like(xn)
    ours_fwd = median_ms(lambda: bngrad.batch_norm_forward(
        xn, wn, bn, rmn, rvn, True, num_threads=threads, out=out))
    _, m, s = bngrad.batch_norm_forward(xn, wn, bn, rmn, rvn, True)
    ours_bwd = median_ms(lambda: bngrad.batch_norm_backward(
        dyn, xn, wn, None, None, m, s, num_threads=threads, out=grad_input))
    layout = "channels_last" if channels_last else "NCHW"
    return (f"| {shape} {layout} | {torch_fwd:.3f} | {ours_fwd:.3f} | {ours_fwd / torch_fwd:.2f} "
            f"| {torch_bwd:.3f} | {ours_bwd:.3f} | {ours_bwd / torch_bwd:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}, float32, ms medians")
    print("| shape | torch fwd | bngrad fwd | ratio | torch bwd | bngrad bwd | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for shape in SHAPES:
        for channels_last in (False, True):
            print(one_case(shape, channels_last, args.threads), flush=True)


if __name__ == "__main__":
    main()
