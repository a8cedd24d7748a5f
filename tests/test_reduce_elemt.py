"""The synchronized-BN split: batch_norm_backward_reduce and batch_norm_backward_elemt.

Each half against bngrad.reference over dtype variant x layout pair x (ndim, channel_axis),
with flags / weight dealt round-robin; and the two composed — locally, and over "ranks" that
each hold part of the batch (sums added, counts given as an array) — against the one-call
backward.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import bngrad
from bngrad import reference
from conftest import (DTYPE_VARIANTS, F32, HALF, LAYOUT_PAIRS, SHAPES,
                      assert_output_layout, make_case, mask_id)
from tolerances import assert_close, assert_dtype, backward_scales

GEOMETRIES = [(2, 1), (2, 0), (3, 1), (3, -1), (4, 1), (4, -1), (4, 2), (5, 1)]
FLAGS_WEIGHT = list(itertools.product(itertools.product((True, False), repeat=3), (True, False)))


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _ids(variant, pair, ndim, axis):
    return f"{variant}-{pair[0]}-{ndim}d-ax{axis}"


def _grad_dtype(input_dtype, weight, mean):
    if weight is not None:
        return weight.dtype
    if input_dtype in HALF and mean.dtype not in HALF:
        return F32
    return input_dtype


def _reduce_matrix():
    out = []
    for vi, v in enumerate(DTYPE_VARIANTS):
        for i, (pair, (nd, ax)) in enumerate(itertools.product(LAYOUT_PAIRS, GEOMETRIES)):
            flags, with_weight = FLAGS_WEIGHT[(i + 3 * vi) % len(FLAGS_WEIGHT)]
            ident = (_ids(v.id, pair, nd, ax) + "-" + mask_id(flags).replace("mask", "g")
                     + ("-w" if with_weight else "-now"))
            out.append(pytest.param(v.id, pair[1:], nd, ax, flags, with_weight, id=ident))
    return out


@pytest.mark.parametrize("variant,layouts,ndim,axis,flags,with_weight", _reduce_matrix())
def test_reduce_matches_reference(variant, layouts, ndim, axis, flags, with_weight):
    case = make_case(SHAPES[ndim], axis, variant, "train", with_weight, layouts=layouts,
                     seed=_seed(variant, ndim, axis))
    mean, invstd = case.save_mean, case.save_invstd
    result = bngrad.batch_norm_backward_reduce(case.grad_out, case.input, mean, invstd,
                                               case.weight, *flags, channel_axis=axis)
    expected = reference.batch_norm_backward_reduce(case.grad_out, case.input, mean, invstd,
                                                    case.weight, *flags, channel_axis=axis)
    assert isinstance(result, tuple) and len(result) == 4
    scales = case.scales()
    input_g, weight_g, bias_g = flags
    n_channels = case.input.shape[axis]
    for name, got, ref, on in zip(("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), result,
                                  expected, (input_g, input_g, weight_g, bias_g)):
        if not on:
            assert got is None, f"{name}: not asked for, expected None"
            continue
        dtype = mean.dtype if name.startswith("sum") else _grad_dtype(case.input.dtype,
                                                                      case.weight, mean)
        assert_dtype(got, dtype, name)
        assert got.shape == (n_channels,)
        assert_close(got, ref, got.dtype, name, scale=scales[name])


def _elemt_matrix():
    out = []
    for vi, v in enumerate(DTYPE_VARIANTS):
        for i, (pair, (nd, ax)) in enumerate(itertools.product(LAYOUT_PAIRS, GEOMETRIES)):
            with_weight = (i + vi) % 2 == 0
            ident = _ids(v.id, pair, nd, ax) + ("-w" if with_weight else "-now")
            out.append(pytest.param(v.id, pair[1:], nd, ax, with_weight, id=ident))
    return out


def _f64_sums(case):
    """sum_dy / sum_dy_xmu in float64 (as an all-reduce in float64 would deliver them)."""
    s_dy, s_dy_xmu, _, _ = reference.batch_norm_backward_reduce(
        case.grad_out, case.input, case.save_mean, case.save_invstd, case.weight,
        channel_axis=case.channel_axis)
    return s_dy, s_dy_xmu


@pytest.mark.parametrize("variant,layouts,ndim,axis,with_weight", _elemt_matrix())
def test_elemt_matches_reference(variant, layouts, ndim, axis, with_weight):
    case = make_case(SHAPES[ndim], axis, variant, "train", with_weight, layouts=layouts,
                     seed=_seed(variant, ndim, axis, "elemt"))
    s_dy, s_dy_xmu = _f64_sums(case)
    sums_dtype = case.save_mean.dtype
    s_dy, s_dy_xmu = s_dy.astype(sums_dtype), s_dy_xmu.astype(sums_dtype)
    count = case.input.size // case.input.shape[axis]
    args = (case.grad_out, case.input, case.save_mean, case.save_invstd, case.weight, s_dy,
            s_dy_xmu)
    expected = reference.batch_norm_backward_elemt(*args, count, channel_axis=axis)
    scale = backward_scales(case.grad_out, case.input, case.weight, case.save_mean,
                            case.save_invstd, axis)["grad_input"]
    for count_arg in (count, float(count), np.array([count]), np.int64(count)):
        got = bngrad.batch_norm_backward_elemt(*args, count_arg, channel_axis=axis)
        assert_dtype(got, case.input.dtype, "grad_input")
        assert got.shape == case.input.shape
        assert_output_layout(got, case.input)
        assert_close(got, expected, got.dtype, f"grad_input (count {count_arg!r})", scale=scale)


@pytest.mark.parametrize("with_weight", [True, False], ids=["w", "now"])
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
@pytest.mark.parametrize("shape,axis", [((6, 3, 4), 1), ((6, 4, 4, 3), -1), ((30, 5), 1)],
                         ids=["ncl", "nhwc", "2d"])
def test_split_composes_to_backward(shape, axis, variant, with_weight):
    """reduce on each of two ranks, sums added, elemt with the per-rank counts == backward."""
    case = make_case(shape, axis, variant, "train", with_weight, seed=8)
    full = bngrad.batch_norm_backward(*case.args(), **case.kwargs())
    expected = reference.batch_norm_backward(*case.args(), **case.kwargs())
    scales = case.scales()
    halves = [slice(0, 2), slice(2, None)]
    parts = [bngrad.batch_norm_backward_reduce(case.grad_out[h], case.input[h], case.save_mean,
                                               case.save_invstd, case.weight,
                                               channel_axis=axis) for h in halves]
    # the all-reduce, in float64 (a float32 all-reduce would add one more rounding)
    total_dy = sum(p[0].astype(np.float64) for p in parts)
    total_dy_xmu = sum(p[1].astype(np.float64) for p in parts)
    assert_close(sum(p[3].astype(np.float64) for p in parts), expected[2],
                 full[2].dtype, "grad_bias (sum over ranks)", scale=2 * scales["grad_bias"])
    counts = np.array([case.input[h].size // case.input.shape[axis] for h in halves])
    sums_dtype = case.save_mean.dtype
    pieces = [bngrad.batch_norm_backward_elemt(case.grad_out[h], case.input[h], case.save_mean,
                                               case.save_invstd, case.weight,
                                               total_dy.astype(sums_dtype),
                                               total_dy_xmu.astype(sums_dtype), counts,
                                               channel_axis=axis) for h in halves]
    grad_input = np.concatenate(pieces, axis=0)
    assert grad_input.dtype == case.input.dtype
    # sums rounded to the stats dtype (half for pure-half variants) add that dtype's error
    tol_dtype = sums_dtype if sums_dtype in HALF else case.input.dtype
    assert_close(grad_input, expected[0], tol_dtype, "grad_input (two ranks)",
                 scale=scales["grad_input"], factor=2)
    assert_close(grad_input, full[0], tol_dtype, "grad_input (two ranks) vs one call",
                 scale=scales["grad_input"], factor=2)


@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
def test_reduce_empty_batch(variant):
    case = make_case((0, 3, 4), 1, variant, "train", True)
    mean, invstd = np.zeros(3, case.save_mean.dtype), np.ones(3, case.save_mean.dtype)
    s_dy, s_dy_xmu, gw, gb = bngrad.batch_norm_backward_reduce(case.grad_out, case.input, mean,
                                                               invstd, case.weight)
    for name, a in (("sum_dy", s_dy), ("sum_dy_xmu", s_dy_xmu), ("grad_weight", gw),
                    ("grad_bias", gb)):
        assert a.shape == (3,) and np.all(a.astype(np.float64) == 0), name


def test_elemt_out_may_hold_the_weight():
    """The coefficients are made before grad_out is copied into ``out`` (a grad_out in another
    layout than input is), so a weight living in out's memory is read first, as
    batch_norm_backward reads it; the result was wrong by up to ~5."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 5)).astype(F32)
    dy = np.asfortranarray(rng.standard_normal((4, 3, 5)).astype(F32))  # copied into out
    mean, invstd = x.mean((0, 2)), (1 / np.sqrt(x.var((0, 2)) + 1e-5)).astype(F32)
    w = np.array([0.5, 1.5, 2.0], F32)
    sums = bngrad.batch_norm_backward_reduce(dy, x, mean, invstd, w)[:2]
    expected = reference.batch_norm_backward_elemt(dy, x, mean, invstd, w, *sums, 20)
    out = np.zeros_like(x)
    weight = out.reshape(-1)[7:10]
    weight[:] = w
    got = bngrad.batch_norm_backward_elemt(dy, x, mean, invstd, weight, *sums, 20, out=out)
    assert_close(got, expected, F32, "grad_input", scale=float(np.abs(expected).max()))
