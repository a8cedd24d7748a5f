"""The oracle is checked too: bngrad.reference against PyTorch's CPU kernels, in float64.

bngrad.reference is what every fast path is tested against, so it must itself agree with
``torch.ops.aten.native_batch_norm_backward`` / ``native_batch_norm`` — on PyTorch's own
sample shapes (from its OpInfo tests), NHWC shapes in channels-last memory, every mode,
weight or None, every output_mask, and channels on other axes. The split used by synchronized
BN (reduce + elemt) must compose to the same gradient.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bngrad import reference  # noqa: E402
from conftest import (MASKS, MODES, Case, from_torch, make_case, mask_id,  # noqa: E402
                      to_torch, torch_backward)
from tolerances import assert_close  # noqa: E402

# PyTorch's sample inputs for native_batch_norm (channels on axis 1) and its NHWC shapes.
TORCH_SAMPLE_SHAPES = [(5, 5, 5), (3, 2, 4), (3, 1), (3, 2, 3, 4), (2, 1), (1, 2, 3)]
NHWC_SHAPES = [(4, 8, 10, 10), (4, 1, 9, 9), (4, 9, 1, 1)]
SHAPE_CASES = ([(s, "contig") for s in TORCH_SAMPLE_SHAPES]
               + [(s, "chlast") for s in NHWC_SHAPES])


def _shape_id(shape_layout):
    shape, layout = shape_layout
    return "x".join(map(str, shape)) + ("-nhwc" if layout == "chlast" else "")


def _torch_stats(case: Case):
    """save_mean / save_invstd as PyTorch's forward computes them (for train-nostats)."""
    x = to_torch(np.moveaxis(case.input, case.channel_axis, 1))
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, None, None, None, None, True, 0.1,
                                                       case.eps)
    return from_torch(mean), from_torch(invstd)


@pytest.mark.parametrize("with_weight", [True, False], ids=["w", "noweight"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape_layout", SHAPE_CASES, ids=_shape_id)
def test_backward_matches_torch(shape_layout, mode, with_weight):
    shape, layout = shape_layout
    for i, mask in enumerate(MASKS):
        case = make_case(shape, 1, "float64", mode, with_weight, mask, (layout, layout), seed=i)
        ref = reference.batch_norm_backward(*case.args(), **case.kwargs())
        torch_case = case
        if mode == "train-nostats":  # PyTorch needs the statistics: give it its own
            mean, invstd = _torch_stats(case)
            torch_case = make_case(shape, 1, "float64", mode, with_weight, mask,
                                   (layout, layout), seed=i)
            torch_case.save_mean, torch_case.save_invstd = mean, invstd
        expected = torch_backward(torch_case)
        scales = case.scales()
        for name, r, t, on in zip(("grad_input", "grad_weight", "grad_bias"), ref, expected,
                                  mask):
            if not on:
                assert r is None, f"{mask_id(mask)}: {name} should be None"
                continue
            assert r.dtype == np.float64
            assert_close(r, t, np.float64, f"{mask_id(mask)} {name}", scale=scales[name])


@pytest.mark.parametrize("axis", [0, 2, -1], ids=lambda a: f"ax{a}")
@pytest.mark.parametrize("mode", MODES)
def test_backward_channel_axis_matches_torch(axis, mode):
    """Channels on any axis: the same as moving that axis to 1 and asking PyTorch."""
    case = make_case((3, 4, 5, 2), axis, "float64", mode, True, seed=7)
    ref = reference.batch_norm_backward(*case.args(), **case.kwargs())
    if mode == "train-nostats":
        case.save_mean, case.save_invstd = _torch_stats(case)
    expected = torch_backward(case)
    scales = case.scales()
    for name, r, t in zip(("grad_input", "grad_weight", "grad_bias"), ref, expected):
        assert_close(r, t, np.float64, name, scale=scales[name])


@pytest.mark.parametrize("momentum", [0.1, 0.0, 1.0])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("with_params", [True, False], ids=["params", "noparams"])
@pytest.mark.parametrize("shape_layout", SHAPE_CASES, ids=_shape_id)
def test_forward_matches_torch(shape_layout, with_params, mode, momentum):
    shape, layout = shape_layout
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape) * 1.5 + 0.25
    x = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1) if layout == "chlast" else x
    n_channels = shape[1]
    w = rng.uniform(-1.5, 1.5, n_channels) if with_params else None
    b = rng.standard_normal(n_channels) if with_params else None
    rm, rv = rng.standard_normal(n_channels), rng.uniform(0.5, 2.0, n_channels)
    train = mode == "train"
    eps = 1e-3
    out, mean, invstd, new_rm, new_rv = reference.batch_norm_forward(
        x, w, b, rm.copy(), rv.copy(), train, momentum, eps)
    t_rm, t_rv = torch.from_numpy(rm.copy()), torch.from_numpy(rv.copy())
    t_out, t_mean, t_invstd = torch.ops.aten.native_batch_norm(
        to_torch(x), to_torch(w), to_torch(b), t_rm, t_rv, train, momentum, eps)
    assert_close(out, from_torch(t_out), np.float64, "output")
    assert mean.shape == tuple(t_mean.shape) and invstd.shape == tuple(t_invstd.shape)
    assert_close(mean, from_torch(t_mean), np.float64, "save_mean")
    assert_close(invstd, from_torch(t_invstd), np.float64, "save_invstd")
    if train:
        assert_close(new_rm, t_rm.numpy(), np.float64, "running_mean")
        assert_close(new_rv, t_rv.numpy(), np.float64, "running_var")
    else:
        assert new_rm is None and new_rv is None


def test_forward_without_running_stats_matches_torch():
    x = np.random.default_rng(1).standard_normal((3, 2, 4))
    out, mean, invstd, new_rm, new_rv = reference.batch_norm_forward(x, None, None, None, None)
    t_out, t_mean, t_invstd = torch.ops.aten.native_batch_norm(
        to_torch(x), None, None, None, None, True, 0.1, 1e-5)
    assert_close(out, t_out.numpy(), np.float64, "output")
    assert_close(mean, t_mean.numpy(), np.float64, "save_mean")
    assert_close(invstd, t_invstd.numpy(), np.float64, "save_invstd")
    assert new_rm is None and new_rv is None


def test_forward_running_var_with_one_element_per_channel_matches_torch():
    """Count 1: the unbiased variance is 0/0. PyTorch's running_var becomes NaN; mirror it."""
    x = np.random.default_rng(2).standard_normal((1, 3, 1, 1))
    rm, rv = np.zeros(3), np.ones(3)
    *_, new_rm, new_rv = reference.batch_norm_forward(x, None, None, rm, rv, True, 0.1, 1e-5)
    t_rm, t_rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    torch.ops.aten.native_batch_norm(to_torch(x), None, None, t_rm, t_rv, True, 0.1, 1e-5)
    assert_close(new_rm, t_rm.numpy(), np.float64, "running_mean")
    np.testing.assert_array_equal(new_rv, t_rv.numpy(), err_msg="running_var (count 1)")


@pytest.mark.parametrize("axis", [1, -1, 0])
def test_moments_match_torch(axis):
    x = np.random.default_rng(4).standard_normal((4, 3, 5)) * 3 + 1
    mean, var = reference.batch_norm_moments(x, channel_axis=axis)
    dims = [d for d in range(3) if d != axis % 3]
    t_var, t_mean = torch.var_mean(torch.from_numpy(x), dim=dims, unbiased=False)
    assert_close(mean, t_mean.numpy(), np.float64, "mean")
    assert_close(var, t_var.numpy(), np.float64, "var")


@pytest.mark.parametrize("with_weight", [True, False], ids=["w", "noweight"])
@pytest.mark.parametrize("axis", [1, -1])
def test_reduce_then_elemt_is_backward(axis, with_weight):
    """The synchronized-BN split composes to the train-mode gradient, also over 'ranks'."""
    case = make_case((6, 3, 4), axis, "float64", "train", with_weight, seed=5)
    gi, gw, gb = reference.batch_norm_backward(*case.args(), **case.kwargs())
    sum_dy, sum_dy_xmu, rw, rb = reference.batch_norm_backward_reduce(
        case.grad_out, case.input, case.save_mean, case.save_invstd, case.weight,
        channel_axis=axis)
    assert_close(rw, gw, np.float64, "grad_weight")
    assert_close(rb, gb, np.float64, "grad_bias")
    count = case.input.size // case.input.shape[axis]
    dx = reference.batch_norm_backward_elemt(case.grad_out, case.input, case.save_mean,
                                             case.save_invstd, case.weight, sum_dy, sum_dy_xmu,
                                             count, channel_axis=axis)
    assert_close(dx, gi, np.float64, "grad_input")
    # Two "ranks" holding halves of the batch: sums add, counts add.
    halves = [slice(0, 2), slice(2, 6)]
    parts = [reference.batch_norm_backward_reduce(case.grad_out[h], case.input[h],
                                                  case.save_mean, case.save_invstd, case.weight,
                                                  channel_axis=axis) for h in halves]
    total_dy = sum(p[0] for p in parts)
    total_dy_xmu = sum(p[1] for p in parts)
    counts = np.array([case.input[h].size // case.input.shape[axis] for h in halves])
    for h in halves:
        dx_h = reference.batch_norm_backward_elemt(case.grad_out[h], case.input[h],
                                                   case.save_mean, case.save_invstd,
                                                   case.weight, total_dy, total_dy_xmu, counts,
                                                   channel_axis=axis)
        assert_close(dx_h, gi[h], np.float64, "grad_input (two ranks)")


@pytest.mark.parametrize("flags", list(itertools.product((True, False), repeat=3)),
                         ids=lambda f: mask_id(f).replace("mask", "g"))
def test_reduce_flags(flags):
    case = make_case((4, 3, 2), 1, "float64", "train", True, seed=6)
    out = reference.batch_norm_backward_reduce(case.grad_out, case.input, case.save_mean,
                                               case.save_invstd, case.weight, *flags)
    input_g, weight_g, bias_g = flags
    for value, on in zip(out, (input_g, input_g, weight_g, bias_g)):
        assert (value is None) == (not on)
