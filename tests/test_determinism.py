"""Bitwise determinism: every result is identical for num_threads = 1, 2, 3 and 4.

Numba caps the thread count at its pool size (NUMBA_NUM_THREADS, the number of cores by
default), so on a 2-core machine num_threads=3 or 4 would silently run on 2. The comparison
therefore runs in a child process started with NUMBA_NUM_THREADS=4, where 4 threads really
run (oversubscribed if need be; that changes timing, not results). The child computes every
path — backward (train with and without stats, each output mask kind, eval), forward (train,
eval), reduce, elemt, moments, and the fused ReLU + side input variants (bngrad.fused: forward,
backward given the mask or y) — for every dtype on channels-first, channels-last and large-C
shapes whose reductions span several blocks, and reports which differ from num_threads=1.

Calls too small for a parallel launch to pay run serially (``Config.serial_elements``; one
thread always does), which would leave the small shapes comparing serial runs only: each
thread count also runs with every call forced parallel (``serial_elements=0``), and two shapes
sit at the default threshold, serial on 2 threads and parallel on 3 and 4.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import bngrad
from bngrad import kernels
from conftest import bits_of, make_case, run_child

THREADS = (1, 2, 3, 4)
# (threads, serial_elements override or None) compared with num_threads=1 (always serial)
SETTINGS = [(t, None) for t in THREADS[1:]] + [(t, 0) for t in THREADS[1:]]
# 1.7 x the launches' cost in elements: serial on 2 threads (below 2x), parallel on 3 (1.5x)
# and 4; the cost is serial_elements for two launches, half that for a fused path's one
_AT = round(1.7 * kernels.Config().serial_elements)
SHAPES = [
    ("chfirst-8x3x5000", (8, 3, 5000), 1, "contig"),
    ("chlast-50000x4", (50000, 4), 1, "contig"),
    ("largeC-3000x700", (3000, 700), 1, "contig"),
    ("nhwc-8x64x16x16", (8, 64, 16, 16), 1, "chlast"),
    ("smallC-chfirst-4x2x30000", (4, 2, 30000), 1, "contig"),
    # short runs (32 <= B < 256): several channel groups, a 4-row tail; several row blocks
    ("shortrun-6x40x7x7", (6, 40, 7, 7), 1, "contig"),
    ("shortrun-262x3x63", (262, 3, 63), 1, "contig"),
    # runs of 16 in wide rows (C*B >= wide_lanes, few rows): the short kernels, not lanes
    ("wide-shortrun-3x520x16", (3, 520, 16), 1, "contig"),
    # runs >= 256 with C = 8: fused per channel on 1-2 threads (C >= 4 * threads), two passes
    # on 3-4, which must give the same bits
    ("fused-or-not-5x8x300", (5, 8, 300), 1, "contig"),
    # at the serial threshold (see the module's docstring)
    ("threshold-chfirst", (_AT // 2 // 2048, 64, 32), 1, "contig"),
    ("threshold-2d", (_AT // 64, 64), 1, "contig"),
]
VARIANTS = ["float32", "bfloat16-p32", "float64", "float16"]
PATHS = ["backward-train", "backward-nostats", "backward-grads-only", "backward-input-only",
         "backward-eval", "forward-train", "forward-eval", "reduce", "elemt", "moments",
         "fused-forward", "fused-backward-mask", "fused-backward-output"]


def _run_path(path, case, threads):
    """All outputs of one path as a list of arrays (None dropped)."""
    kw = dict(channel_axis=case.channel_axis, num_threads=threads)
    c = case
    if path.startswith("backward"):
        mask, train, mean, invstd = (True, True, True), True, c.save_mean, c.save_invstd
        if path == "backward-nostats":
            mean = invstd = None
        elif path == "backward-grads-only":
            mask = (False, True, True)
        elif path == "backward-input-only":
            mask = (True, False, False)
        elif path == "backward-eval":
            train = False
        out = bngrad.batch_norm_backward(c.grad_out, c.input, c.weight, c.running_mean,
                                         c.running_var, mean, invstd, train, c.eps, mask, **kw)
        return [o for o in out if o is not None]
    if path.startswith("forward"):
        rm, rv = c.running_mean.copy(), c.running_var.copy()
        out = bngrad.batch_norm_forward(c.input, c.weight, c.weight, rm, rv,
                                        path == "forward-train", 0.1, c.eps, **kw)
        return list(out) + [rm, rv]
    if path == "reduce":
        return list(bngrad.batch_norm_backward_reduce(c.grad_out, c.input, c.save_mean,
                                                      c.save_invstd, c.weight, **kw))
    if path == "elemt":
        s_dy, s_dy_xmu, _, _ = bngrad.batch_norm_backward_reduce(
            c.grad_out, c.input, c.save_mean, c.save_invstd, c.weight, **kw)
        count = c.input.size // c.input.shape[c.channel_axis]
        return [bngrad.batch_norm_backward_elemt(c.grad_out, c.input, c.save_mean,
                                                 c.save_invstd, c.weight, s_dy, s_dy_xmu,
                                                 count, **kw)]
    if path == "moments":
        return list(bngrad.batch_norm_moments(c.input, **kw))
    if path.startswith("fused"):  # grad_out doubles as the side input
        rm, rv = c.running_mean.copy(), c.running_var.copy()
        y, mean, invstd, bits = bngrad.batch_norm_relu_forward(
            c.input, c.weight, c.weight, rm, rv, True, 0.1, c.eps, side_input=c.grad_out, **kw)
        if path == "fused-forward":
            return [y, mean, invstd, bits, rm, rv]
        given = {"relu_mask": bits} if path == "fused-backward-mask" else {"output": y}
        return list(bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                    mean, invstd, True, c.eps, **given, **kw))
    raise ValueError(path)


def _differences(variant, shape_id, shape, axis, layout):
    """{path: None if identical for all thread counts, else a description}."""
    case = make_case(shape, axis, variant, "train", True, layouts=(layout, layout), seed=21)
    report = {}
    for path in PATHS:
        base = _run_path(path, case, 1)
        problem = None
        for t, limit in SETTINGS:
            if limit is None:
                result = _run_path(path, case, t)
            else:
                with kernels.override(serial_elements=limit):
                    result = _run_path(path, case, t)
            where = f"num_threads={t}" + ("" if limit is None else " (forced parallel)")
            for i, (a, b) in enumerate(zip(base, result)):
                if a.dtype != b.dtype or a.shape != b.shape:
                    problem = f"output {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape} at {where}"
                elif not np.array_equal(bits_of(a), bits_of(b)):
                    n = int(np.sum(bits_of(a) != bits_of(b)))
                    problem = (f"output {i}: {n} of {a.size} elements differ between "
                               f"num_threads=1 and {where}")
                if problem:
                    break
            if problem:
                break
        report[path] = problem
    return report


def child_main(out_path, variants=VARIANTS):  # runs in a child process (conftest.run_child)
    import numba
    report = {"numba_threads": numba.config.NUMBA_NUM_THREADS, "cases": {},
              "threshold_serial": {}}
    for shape_id, shape, _, _ in SHAPES:
        if shape_id.startswith("threshold"):  # serial on which of 2, 3, 4 threads
            x = np.zeros(shape, np.float32)
            report["threshold_serial"][shape_id] = [
                "(serial)" in bngrad.explain(x, num_threads=t) for t in THREADS[1:]]
    for variant in variants:
        for shape_id, shape, axis, layout in SHAPES:
            for path, problem in _differences(variant, shape_id, shape, axis, layout).items():
                report["cases"][f"{variant}-{shape_id}-{path}"] = problem
    with open(out_path, "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def child_report(tmp_path_factory):
    return run_child("test_determinism", tmp_path_factory.mktemp("determinism"),
                     {**os.environ, "NUMBA_NUM_THREADS": "4"}, timeout=600)


def _ids():
    return [f"{v}-{s[0]}-{p}" for v in VARIANTS for s in SHAPES for p in PATHS]


def test_child_really_had_four_threads(child_report):
    assert child_report["numba_threads"] == 4


def test_threshold_shapes_are_serial_on_two_threads_only(child_report):
    assert child_report["threshold_serial"] == {"threshold-chfirst": [True, False, False],
                                                "threshold-2d": [True, False, False]}


@pytest.mark.parametrize("case_id", _ids())
def test_bitwise_identical_for_any_thread_count(child_report, case_id):
    problem = child_report["cases"][case_id]
    assert problem is None, problem


@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
def test_default_threads_and_repeated_calls_identical(variant):
    """num_threads=None gives the same bits as num_threads=1, and every call the same."""
    case = make_case((8, 3, 5000), 1, variant, "train", True, seed=5)
    one = bngrad.batch_norm_backward(*case.args(), num_threads=1)
    for _ in range(3):
        again = bngrad.batch_norm_backward(*case.args())
        for a, b in zip(one, again):
            assert np.array_equal(bits_of(a), bits_of(b))
