"""Accuracy of bngrad and PyTorch against the float64 reference, side by side.

For each dtype (float32; float16 and bfloat16 with float32 parameters and statistics, as in
mixed-precision training; and pure float16/bfloat16), shape and memory layout, both libraries
get the same low-precision inputs; ``bngrad.reference`` computes the exact answer for those
inputs in float64. Reported: the norm-wise relative error, max |result - reference| /
max |reference|, of grad_input, grad_weight and grad_bias (backward, train mode, with
save_mean / save_invstd given), and of the forward output and save_invstd.

Run:  .venv/bin/python benchmarks/accuracy.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import ml_dtypes
import numpy as np
import torch

import bngrad
from bngrad import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

# (label, shape, layout): "nchw" = C order, "nhwc" = channels-last strides,
# "mixed" = input channels-last, grad_out C order
CASES = [
    ("NCHW 32x64x28x28", (32, 64, 28, 28), "nchw"),
    ("NHWC 32x64x28x28", (32, 64, 28, 28), "nhwc"),
    ("NHWC x, NCHW dy 32x64x28x28", (32, 64, 28, 28), "mixed"),
    ("2-D 65536x256", (65536, 256), "nchw"),
    ("NCL 4x4x1048576 (large M)", (4, 4, 1 << 20), "nchw"),
]
QUICK_CASES = [
    ("NCHW 8x16x28x28", (8, 16, 28, 28), "nchw"),
    ("NHWC 8x16x28x28", (8, 16, 28, 28), "nhwc"),
    ("NHWC x, NCHW dy 8x16x28x28", (8, 16, 28, 28), "mixed"),
    ("2-D 16384x64", (16384, 64), "nchw"),
]
# (label, data dtype, parameter/statistics dtype)
DTYPES = [
    ("float32", F32, F32),
    ("float16 (+f32 params)", F16, F32),
    ("bfloat16 (+f32 params)", BF16, F32),
    ("float16 (pure)", F16, F16),
    ("bfloat16 (pure)", BF16, BF16),
]


def to_torch(a):
    if a is None:
        return None
    if a.dtype == BF16:
        if a.flags.c_contiguous or a.ndim != 4:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        # channels-last NCHW: transpose to NHWC (C order), convert, permute back
        t = torch.from_numpy(np.ascontiguousarray(a.transpose(0, 2, 3, 1)).view(np.int16))
        return t.view(torch.bfloat16).permute(0, 3, 1, 2)
    return torch.from_numpy(a)


def from_torch(t):
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def rel_err(got, ref) -> float:
    got = np.asarray(got).astype(np.float64)
    denom = np.max(np.abs(ref)) or 1.0
    return float(np.max(np.abs(got - ref)) / denom)


def layout(a, kind):
    if kind in ("nhwc", "mixed") and a.ndim == 4:
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(a)


def measure(shape, kind, data, param, rng):
    c = shape[1]
    x64 = rng.standard_normal(shape)  # drawn before the per-channel spread, as ever
    x64 = x64 * rng.uniform(0.5, 2, c).reshape((1, c) + (1,) * (len(shape) - 2)) + 0.5
    dy64 = rng.standard_normal(shape)
    x = layout(x64.astype(data), kind)
    dy = layout(dy64.astype(data), "nchw" if kind == "mixed" else kind)
    w = rng.uniform(0.5, 1.5, c).astype(param)
    b = rng.standard_normal(c).astype(param)
    mean, var = reference.batch_norm_moments(x)
    eps = 1e-5
    save_mean = mean.astype(param)
    save_invstd = (1 / np.sqrt(var + eps)).astype(param)

    ref = reference.batch_norm_backward(dy, x, w, None, None, save_mean, save_invstd, True, eps)
    ours = bngrad.batch_norm_backward(dy, x, w, None, None, save_mean, save_invstd, True, eps)
    theirs = [from_torch(t) for t in torch.ops.aten.native_batch_norm_backward(
        to_torch(dy), to_torch(x), to_torch(w), None, None, to_torch(save_mean),
        to_torch(save_invstd), True, eps, [True, True, True])]
    ref_f = reference.batch_norm_forward(x, w, b, None, None, True, 0.1, eps)
    ours_f = bngrad.batch_norm_forward(x, w, b, None, None, True, 0.1, eps)
    theirs_f = [from_torch(t) for t in torch.ops.aten.native_batch_norm(
        to_torch(x), to_torch(w), to_torch(b), None, None, True, 0.1, eps)]
    row = {}
    for i, name in enumerate(("grad_input", "grad_weight", "grad_bias")):
        row[name] = (rel_err(ours[i], ref[i]), rel_err(theirs[i], ref[i]))
    row["output"] = (rel_err(ours_f[0], ref_f[0]), rel_err(theirs_f[0], ref_f[0]))
    row["save_invstd"] = (rel_err(ours_f[2], ref_f[2]), rel_err(theirs_f[2], ref_f[2]))
    return row


def stall_contrast():
    """2^25 float32 ones, 2-D: grad_bias from bngrad and from PyTorch on one thread."""
    ones = np.ones((1 << 25, 1), np.float32)
    zero, one = np.zeros(1, np.float32), np.ones(1, np.float32)
    ours = bngrad.batch_norm_backward(ones, ones, None, None, None, zero, one, True, 1e-5,
                                      (False, False, True))[2][0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t = torch.from_numpy(ones)
        theirs = torch.ops.aten.native_batch_norm_backward(
            t, t, None, None, None, torch.zeros(1), torch.ones(1), True, 1e-5,
            [False, False, True])[2][0].item()
    finally:
        torch.set_num_threads(threads)
    return float(ours), float(theirs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes only")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    cases = QUICK_CASES if args.quick else CASES
    outputs = ("grad_input", "grad_weight", "grad_bias", "output", "save_invstd")
    results = []
    t0 = time.perf_counter()
    print(f"bngrad {bngrad.__version__}, torch {torch.__version__}; norm-wise relative error "
          "max|x - ref| / max|ref| vs the float64 reference; cells: bngrad / torch\n")
    print("| dtype | case | " + " | ".join(outputs) + " |")
    print("|---|---|" + "---|" * len(outputs))
    for dlabel, data, param in DTYPES:
        for clabel, shape, kind in cases:
            row = measure(shape, kind, data, param, rng)
            results.append({"dtype": dlabel, "case": clabel, **row})
            cells = " | ".join(f"{row[o][0]:.1e} / {row[o][1]:.1e}" for o in outputs)
            print(f"| {dlabel} | {clabel} | {cells} |", flush=True)
    print("\nmax over cases, per dtype (bngrad / torch):")
    print("| dtype | " + " | ".join(outputs) + " |")
    print("|---|" + "---|" * len(outputs))
    for dlabel, _, _ in DTYPES:
        rows = [r for r in results if r["dtype"] == dlabel]
        cells = " | ".join(f"{max(r[o][0] for r in rows):.1e} / {max(r[o][1] for r in rows):.1e}"
                           for o in outputs)
        print(f"| {dlabel} | {cells} |")
    ours, theirs = stall_contrast()
    print(f"\n2^25 float32 ones, (2^25, 1): grad_bias bngrad {ours:.0f}, torch (1 thread) "
          f"{theirs:.0f}, exact {2 ** 25}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "stall": {"bngrad": ours, "torch_1_thread": theirs}},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
