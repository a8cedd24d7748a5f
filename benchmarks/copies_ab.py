"""A/B of the backwards that must copy: the working tree against a git revision, one process.

grad_out in another layout than input (x NCHW / dy NHWC and the reverse) and sliced arrays,
which ``bngrad.batch_norm_backward`` must copy (docs/internals.md, "grad_out, into
grad_input's buffer"), with a same-layout case as the control. Loads ``--rev`` as
``bngrad_old`` (benchmarks/layer_ab.py), checks that both give the same bits, and prints the
median of ``--rounds`` alternating calls of each, new/old.

    .venv/bin/python benchmarks/copies_ab.py --rev HEAD --out

Measure on an idle machine (no test run beside it).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layer_ab  # noqa: E402

CASES = [((32, 256, 56, 56), np.float32, "x NCHW, dy NHWC"),
         ((32, 256, 56, 56), np.float32, "x NHWC, dy NCHW"),
         ((32, 256, 56, 56), ml_dtypes.bfloat16, "x NCHW, dy NHWC"),
         ((32, 256, 56, 56), np.float32, "x sliced"),
         ((32, 256, 56, 56), np.float32, "both sliced"),
         ((16, 64, 56, 56), np.float32, "x NCHW, dy NHWC"),
         ((16, 64, 56, 56), np.float32, "x sliced"),
         ((4096, 1024), np.float32, "x sliced"),
         ((32, 256, 56, 56), np.float32, "same")]


def _arrays(shape: tuple, dtype: type, kind: str, rng: np.random.Generator):
    def channels_last(a):
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)

    def sliced(a):  # a crop of an array 8 wider on the last axis
        return np.pad(a, ((0, 0),) * (a.ndim - 1) + ((0, 8),))[..., :shape[-1]]
    x, dy = (rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(2))
    if kind == "x NCHW, dy NHWC":
        dy = channels_last(dy)
    elif kind == "x NHWC, dy NCHW":
        x = channels_last(x)
    elif kind == "x sliced":
        x = sliced(x)
    elif kind == "both sliced":
        x, dy = sliced(x), sliced(dy)
    return x, dy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD", help="the git revision to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", action="store_true", help="pass out= (an NCHW array)")
    args = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, layer_ab.build_old(args.rev, root))
    import bngrad
    import bngrad_old  # type: ignore[import-not-found]

    rng = np.random.default_rng(0)
    print(f"new: working tree, old: {args.rev}; out= {'NCHW' if args.out else 'not given'}")
    for shape, dtype, kind in CASES:
        x, dy = _arrays(shape, dtype, kind, rng)
        C = shape[1]
        weight, mean, invstd = (np.ones(C, np.float32) for _ in range(3))
        out = np.empty(shape, dtype) if args.out else None
        calls = {name: functools.partial(module.batch_norm_backward, dy, x, weight,
                                         save_mean=mean, save_invstd=invstd, out=out)
                 for name, module in (("new", bngrad), ("old", bngrad_old))}
        same = all(a.tobytes() == b.tobytes() for a, b in zip(calls["new"](), calls["old"]()))
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        new, old = (float(np.median(times[name])) * 1e3 for name in ("new", "old"))
        print(f"{str(shape):18} {np.dtype(dtype).name:9} {kind:16} new {new:7.2f} ms  "
              f"old {old:7.2f} ms  new/old {new / old:.2f}  same bits: {same}", flush=True)


if __name__ == "__main__":
    main()
