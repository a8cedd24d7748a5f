"""Fused batch norm + ReLU (+ side input) against bngrad's plain batch norm, same process.

For each shape, dtype and layout, times the plain forward and backward and the fused variants
(bngrad.fused) in interleaved rounds (every case once per round, so that drifts in the
machine's speed hit all cases alike) and prints medians and each case's ratio to the plain
call of the same direction. Every call writes into a reused ``out=`` buffer; grad_side_input
has no ``out=`` and is a fresh array each call (its page faults are part of its cost).

Cases: forward ``relu-bytes`` / ``relu-bits`` (mask format) and ``add-relu-bits`` (side
input); backward given the mask bytes, the bits, or y (``relu-*``: output_mask (T, T, T, F),
BN -> ReLU) and with grad_side_input (``add-relu-bits``: (T, T, T, T), BN -> add -> ReLU).

    .venv/bin/python benchmarks/fused_bench.py
    .venv/bin/python benchmarks/fused_bench.py --shapes 32,256,56,56 --dtypes float32 --rounds 9

Measure on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import bngrad
from bngrad import _dtypes


def _arrays(shape, dtype, layout, rng):
    def make(a):
        a = a.astype(dtype)
        if layout == "nhwc":  # channels-last memory, NCHW shape
            return np.ascontiguousarray(np.moveaxis(a, 1, -1)).transpose(
                0, a.ndim - 1, *range(1, a.ndim - 1))
        return a
    x = make(rng.standard_normal(shape, dtype=np.float32))
    dy = make(rng.standard_normal(shape, dtype=np.float32))
    z = make(rng.standard_normal(shape, dtype=np.float32))
    return x, dy, z


def _cases(x, dy, z):
    """{direction: {name: thunk}} with the plain call first."""
    C = x.shape[1]
    w, b = np.ones(C, np.float32), np.zeros(C, np.float32)
    out = np.empty_like(x)
    y, mean, invstd, bits = bngrad.batch_norm_relu_forward(x, w, b, side_input=z)
    y_relu, _, _, bits_relu = bngrad.batch_norm_relu_forward(x, w, b)
    mask_bytes = bngrad.batch_norm_relu_forward(x, w, b, mask_format="bytes")[3]

    def fwd(**kw):
        return lambda: bngrad.batch_norm_relu_forward(x, w, b, out=out, **kw)

    def bwd(output_mask, **kw):
        return lambda: bngrad.batch_norm_relu_backward(dy, x, w, None, None, mean, invstd,
                                                       output_mask=output_mask, out=out, **kw)
    bn_relu = (True, True, True, False)
    return {
        "forward": {
            "plain": lambda: bngrad.batch_norm_forward(x, w, b, out=out),
            "relu-bytes": fwd(mask_format="bytes"),
            "relu-bits": fwd(mask_format="bits"),
            "add-relu-bits": fwd(side_input=z, mask_format="bits"),
        },
        "backward": {
            "plain": lambda: bngrad.batch_norm_backward(dy, x, w, None, None, mean, invstd,
                                                        out=out),
            "relu-bytes": bwd(bn_relu, relu_mask=mask_bytes),
            "relu-bits": bwd(bn_relu, relu_mask=bits_relu),
            "relu-y": bwd(bn_relu, output=y_relu),
            "add-relu-bits": bwd((True,) * 4, relu_mask=bits),
        },
    }


def _measure(cases, rounds):
    for thunk in cases.values():  # warm-up: compilation, first-touch of the buffers
        thunk()
        thunk()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, thunk in cases.items():
            t0 = time.perf_counter()
            thunk()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["32,256,56,56", "4096,1024"],
                        help="comma-separated shapes (default: %(default)s)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--layouts", nargs="+", default=["nchw", "nhwc"],
                        help="nhwc: channels-last memory (2-D shapes take nchw only)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"median ms over {args.rounds} interleaved rounds (ratio to plain, same direction)")
    for text in args.shapes:
        shape = tuple(int(n) for n in text.split(","))
        for dtype_name in args.dtypes:
            found = _dtypes.by_alias(dtype_name)
            if found is None:
                parser.error(f"unknown dtype {dtype_name!r}")
            dtype = found.numpy
            for layout in (args.layouts if len(shape) > 2 else ["nchw"]):
                x, dy, z = _arrays(shape, dtype, layout, rng)
                for direction, cases in _cases(x, dy, z).items():
                    ms = _measure(cases, args.rounds)
                    cells = "  ".join(f"{name} {t:7.2f} ({t / ms['plain']:.2f}x)"
                                      for name, t in ms.items())
                    print(f"{text:>14} {dtype_name:>8} {layout:4} {direction:8} {cells}",
                          flush=True)
                del x, dy, z
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
