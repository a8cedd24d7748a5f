"""Record, or compare against a record, the exact bits of every bngrad result on a matrix of
cases that reaches every kernel path.

A kernel refactoring must not change a single bit. Run this once before the change
(``--record before.json``) and after every step (``--compare before.json``): it prints the
cases whose sha256 (of the output bytes, in C order) differs and exits 1 if any does.

The matrix: forward (train/eval, weight or None), backward (train with saved statistics, train
computing them, eval; weight or None; every output_mask), reduce and elemt, the fused ReLU +
side input variants (bngrad.fused: forward, backward given the bits mask), over shapes that
reach every path (2-D narrow rows that fold and wide rows that span several column groups;
channels-first runs < 32, 32..255, >= 256 with and without enough channels to fuse, runs longer
than a tile; NHWC, a grad_out in another layout than input, sliced input), every dtype variant
(float64/32/16, bfloat16, half data with float32 parameters), on 1, 2 and 4 threads. The
process sets NUMBA_NUM_THREADS=4 before importing Numba so that 4 threads really run.

    .venv/bin/python benchmarks/bitwise_matrix.py --record /tmp/bits-before.json
    .venv/bin/python benchmarks/bitwise_matrix.py --compare /tmp/bits-before.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import sys

os.environ.setdefault("NUMBA_NUM_THREADS", "4")

import numpy as np  # noqa: E402

import bngrad  # noqa: E402
from bngrad import _dtypes  # noqa: E402

THREADS = (1, 2, 4)

# (id, shape, channel axis, input layout, grad_out layout)
SHAPES = [
    ("2d-narrow-300x3", (300, 3), 1, "contig", "contig"),            # folded lanes + tail rows
    ("2d-blocks-2000x64", (2000, 64), 1, "contig", "contig"),        # several row blocks
    ("2d-wide-20x9000", (20, 9000), 1, "contig", "contig"),          # > one column group
    ("runs-lt32-6x5x7x3", (6, 5, 7, 3), 1, "contig", "contig"),      # B = 21: lanes
    ("short-6x40x7x7", (6, 40, 7, 7), 1, "contig", "contig"),        # B = 49: short kernels
    ("short-262x3x63", (262, 3, 63), 1, "contig", "contig"),         # short, several blocks
    ("runs-5x3x300", (5, 3, 300), 1, "contig", "contig"),            # B >= 256, C too small
    ("fused-3x20x300", (3, 20, 300), 1, "contig", "contig"),         # B >= 256, fuses (C>=16)
    ("fused-5x8x300", (5, 8, 300), 1, "contig", "contig"),           # fuses on 1-2 threads
    ("longrun-2x2x20000", (2, 2, 20000), 1, "contig", "contig"),     # runs > one tile
    ("nhwc-4x8x6x6", (4, 8, 6, 6), 1, "chlast", "chlast"),           # channels-last lanes
    ("nhwc-2x300x5x5", (2, 300, 5, 5), 1, "chlast", "chlast"),       # channels-last, wide C
    ("mixed-4x6x20x20", (4, 6, 20, 20), 1, "contig", "chlast"),      # grad_out transposed
    ("mixed-4x20x17x17", (4, 20, 17, 17), 1, "chlast", "contig"),    # input NHWC, dy NCHW
    ("sliced-6x4x300", (6, 4, 300), 1, "sliced", "contig"),          # input copied
    ("axis-last-40x7x5", (40, 7, 5), -1, "contig", "contig"),        # channel_axis=-1
    # (new cases go last: a case's seed is its index)
    ("wide-3x520x4x4", (3, 520, 4, 4), 1, "contig", "contig"),       # B = 16, 8320 lanes: short
]

MASKS = [m for m in itertools.product((False, True), repeat=3)]


def _variants():
    out = []
    for spec in _dtypes.DTYPES:
        out.append((spec.name, spec.numpy, spec.numpy))
        if spec.is_half:
            out.append((f"{spec.name}-p32", spec.numpy, np.dtype(np.float32)))
    return out


def _layout(a: np.ndarray, kind: str, axis: int) -> np.ndarray:
    if kind == "contig":
        return np.ascontiguousarray(a)
    if kind == "chlast":
        order = [i for i in range(a.ndim) if i != axis] + [axis]
        return np.transpose(np.ascontiguousarray(np.transpose(a, order)), np.argsort(order))
    if kind == "sliced":
        big = np.zeros((2 * a.shape[0] + 1,) + a.shape[1:-1] + (2 * a.shape[-1] + 1,), a.dtype)
        view = big[1::2, ..., 1::2]
        view[...] = a
        return view
    raise ValueError(kind)


def _case(shape, axis, lay_x, lay_dy, data, param, seed):
    rng = np.random.default_rng(seed)
    ax = axis % len(shape)
    C = shape[ax]
    bshape = [1] * len(shape)
    bshape[ax] = C
    x64 = rng.standard_normal(shape) * 2.0 + rng.uniform(-3, 3, C).reshape(bshape)
    dy64 = rng.standard_normal(shape) + 0.5
    x = _layout(x64.astype(data), lay_x, ax)
    dy = _layout(dy64.astype(data), lay_dy, ax)
    xr = np.asarray(x, np.float64)
    red = tuple(i for i in range(len(shape)) if i != ax)
    mean, var = xr.mean(axis=red), xr.var(axis=red)
    return dict(
        x=x, dy=dy,
        weight=rng.uniform(0.5, 1.5, C).astype(param),
        bias=rng.uniform(-0.5, 0.5, C).astype(param),
        save_mean=mean.astype(param),
        save_invstd=(1.0 / np.sqrt(var + 1e-5)).astype(param),
        running_mean=(mean + 0.1).astype(param),
        running_var=(var * 1.1 + 0.01).astype(param),
        count=xr.size // C, axis=axis)


def _digest(results) -> str:
    h = hashlib.sha256()
    for r in results:
        if r is None:
            h.update(b"None")
            continue
        r = np.ascontiguousarray(r)
        h.update(f"{r.dtype.name}{r.shape}".encode())
        h.update(r.tobytes())
    return h.hexdigest()


def _calls(c):
    """(name, thunk(threads) -> list of outputs) for every operation of one case."""
    kw = dict(channel_axis=c["axis"])
    for w_id, w in (("w", c["weight"]), ("now", None)):
        for train in (True, False):
            def fwd(t, w=w, train=train):
                rm, rv = c["running_mean"].copy(), c["running_var"].copy()
                out = bngrad.batch_norm_forward(c["x"], w, None if w is None else c["bias"],
                                                rm, rv, train, 0.1, 1e-5, num_threads=t, **kw)
                return list(out) + [rm, rv]
            yield f"forward-{'train' if train else 'eval'}-{w_id}", fwd
        for mode in ("train", "nostats", "eval"):
            for mask in MASKS:
                def bwd(t, w=w, mode=mode, mask=mask):
                    stats = ((None, None) if mode == "nostats"
                             else (c["save_mean"], c["save_invstd"]))
                    return list(bngrad.batch_norm_backward(
                        c["dy"], c["x"], w, c["running_mean"], c["running_var"], *stats,
                        mode != "eval", 1e-5, mask, num_threads=t, **kw))
                tag = "".join("1" if m else "0" for m in mask)
                yield f"backward-{mode}-{tag}-{w_id}", bwd

        def elemt(t, w=w):
            s_dy, s_dy_xmu, _, _ = bngrad.batch_norm_backward_reduce(
                c["dy"], c["x"], c["save_mean"], c["save_invstd"], w, num_threads=t, **kw)
            return [bngrad.batch_norm_backward_elemt(
                c["dy"], c["x"], c["save_mean"], c["save_invstd"], w, s_dy, s_dy_xmu,
                c["count"], num_threads=t, **kw)]
        yield f"elemt-{w_id}", elemt

    def red(t):
        return list(bngrad.batch_norm_backward_reduce(c["dy"], c["x"], c["save_mean"],
                                                      c["save_invstd"], c["weight"],
                                                      num_threads=t, **kw))
    yield "reduce", red

    def moments(t):
        return list(bngrad.batch_norm_moments(c["x"], num_threads=t, **kw))
    yield "moments", moments

    # the fused variants, with dy doubling as the side input
    fused = dict(side_input=c["dy"], **kw)

    def fused_forward(t):
        rm, rv = c["running_mean"].copy(), c["running_var"].copy()
        out = bngrad.batch_norm_relu_forward(c["x"], c["weight"], c["bias"], rm, rv, True, 0.1,
                                             1e-5, num_threads=t, **fused)
        return list(out) + [rm, rv]
    yield "fused-forward", fused_forward

    def fused_backward(t):
        _, mean, invstd, bits = bngrad.batch_norm_relu_forward(c["x"], c["weight"], c["bias"],
                                                               num_threads=1, **fused)
        return list(bngrad.batch_norm_relu_backward(c["dy"], c["x"], c["weight"], None, None,
                                                    mean, invstd, relu_mask=bits,
                                                    num_threads=t, **kw))
    yield "fused-backward", fused_backward


def matrix() -> dict[str, str]:
    hashes = {}
    for seed, (shape_id, shape, axis, lay_x, lay_dy) in enumerate(SHAPES):
        for variant, data, param in _variants():
            c = _case(shape, axis, lay_x, lay_dy, data, param, seed)
            for name, call in _calls(c):
                for t in THREADS:
                    hashes[f"{shape_id}/{variant}/{name}/t{t}"] = _digest(call(t))
    return hashes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--record", metavar="JSON", help="write the hashes to this file")
    group.add_argument("--compare", metavar="JSON", help="compare the hashes with this file")
    args = parser.parse_args(argv)
    hashes = matrix()
    if args.record:
        with open(args.record, "w") as f:
            json.dump(hashes, f, indent=0, sort_keys=True)
        print(f"recorded {len(hashes)} cases to {args.record}")
        return 0
    with open(args.compare) as f:
        before = json.load(f)
    missing = sorted(set(before) - set(hashes))
    changed = sorted(k for k in before if k in hashes and before[k] != hashes[k])
    for k in changed:
        print("CHANGED", k)
    for k in missing:
        print("MISSING", k)
    print(f"{len(hashes)} cases, {len(changed)} changed, {len(missing)} missing, "
          f"{len(set(hashes) - set(before))} new")
    return 1 if changed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
