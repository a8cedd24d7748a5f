"""bngrad.batch_norm_backward: the kernel-path matrix against bngrad.reference and PyTorch.

The main matrix is the full product of dtype variant x mode x layout pair x ndim x
channel_axis (every kernel signature); weight-or-None x output_mask (16 combinations) are
dealt round-robin within each (dtype, mode), so each of the 16 meets every dtype and mode
several times and every layout, ndim and axis more than once. Ids read e.g.
``float16-p32-train-chlast/contig-4d-ax-1-w-mask101``.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import bngrad
from bngrad import reference
from conftest import (BF16, DTYPE_VARIANT, DTYPE_VARIANTS, F16, F32, F64, HALF, LAYOUT_PAIRS,
                      MASKS, MODES, SHAPES, Case, channel_axes, check_backward, make_case,
                      mask_id, torch_backward)
from tolerances import assert_close, assert_dtype

WEIGHT_MASKS = list(itertools.product((True, False), MASKS))


def _matrix():
    cases = []
    for vi, v in enumerate(DTYPE_VARIANTS):
        for mi, mode in enumerate(MODES):
            inner = [(pair, nd, axid, ax) for pair in LAYOUT_PAIRS for nd in SHAPES
                     for axid, ax in channel_axes(nd)]
            for i, (pair, nd, axid, ax) in enumerate(inner):
                with_weight, mask = WEIGHT_MASKS[(i + 5 * vi + 3 * mi) % len(WEIGHT_MASKS)]
                ident = (f"{v.id}-{mode}-{pair[0]}-{nd}d-{axid}-{'w' if with_weight else 'now'}"
                         f"-{mask_id(mask)}")
                cases.append(pytest.param(v.id, mode, pair[1:], nd, ax, with_weight, mask,
                                          id=ident))
    return cases


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


@pytest.mark.parametrize("variant,mode,layouts,ndim,axis,with_weight,mask", _matrix())
def test_backward_matches_reference(variant, mode, layouts, ndim, axis, with_weight, mask):
    case = make_case(SHAPES[ndim], axis, variant, mode, with_weight, mask, layouts,
                     seed=_seed(variant, mode, layouts, ndim, axis))
    check_backward(case)


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
def test_every_mask_every_mode(variant, mode, mask):
    """All 8 output masks for every dtype and mode, weight None, on an NCHW and an NHWC array."""
    for layouts in (("contig", "contig"), ("chlast", "chlast")):
        case = make_case((3, 4, 2, 5), 1, variant, mode, False, mask, layouts, seed=1)
        check_backward(case)


# --------------------------------------------------------------------------- PyTorch as 2nd oracle

TORCH_SAMPLE_SHAPES = [(5, 5, 5), (3, 2, 4), (3, 1), (3, 2, 3, 4), (2, 1), (1, 2, 3)]
NHWC_SHAPES = [(4, 8, 10, 10), (4, 1, 9, 9), (4, 9, 1, 1)]
TORCH_SHAPES = ([pytest.param(s, "contig", id="x".join(map(str, s))) for s in TORCH_SAMPLE_SHAPES]
                + [pytest.param(s, "chlast", id="x".join(map(str, s)) + "-nhwc")
                   for s in NHWC_SHAPES])


def _torch_stats(case: Case):
    """save_mean / save_invstd from PyTorch's own forward (for the train-nostats mode)."""
    import torch
    from conftest import from_torch, to_torch
    x = to_torch(np.moveaxis(case.input, case.channel_axis, 1))
    w = to_torch(case.weight)
    _, mean, invstd = torch.ops.aten.native_batch_norm(x, w, w, None, None, True, 0.1, case.eps)
    return from_torch(mean), from_torch(invstd)


def _compare_with_torch(case: Case):
    pytest.importorskip("torch")
    ours = bngrad.batch_norm_backward(*case.args(), **case.kwargs())
    torch_case = case
    if case.train and case.save_mean is None:
        torch_case = Case(**{**case.__dict__})
        torch_case.save_mean, torch_case.save_invstd = _torch_stats(case)
    theirs = torch_backward(torch_case)
    scales = case.scales()
    for name, a, t, on in zip(("grad_input", "grad_weight", "grad_bias"), ours, theirs,
                              case.output_mask):
        if not on:
            assert a is None
            continue
        assert a.dtype == t.dtype, f"{name}: dtype {a.dtype}, PyTorch gives {t.dtype}"
        scale = scales[name] if (case.train or name != "grad_input") else None
        # PyTorch as a second oracle checks semantics; accuracy is judged against the reference.
        # For half data PyTorch's float32 grad_weight/grad_bias can carry half-level error
        # (its bfloat16 channels-last and strided paths round partial sums to bfloat16), so
        # the comparison uses the data dtype's tolerance, twice (both sides may be off).
        tol_dtype = case.input.dtype if case.input.dtype in HALF else a.dtype
        assert_close(a, t, tol_dtype, f"{name} vs PyTorch", scale=scale, factor=2)


@pytest.mark.parametrize("with_weight", [True, False], ids=["w", "now"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
@pytest.mark.parametrize("shape,layout", TORCH_SHAPES)
def test_backward_matches_torch(shape, layout, variant, mode, with_weight):
    mask = MASKS[_seed(shape, variant, mode, with_weight) % 8]
    case = make_case(shape, 1, variant, mode, with_weight, mask, (layout, layout),
                     seed=_seed(shape, variant))
    _compare_with_torch(case)


@pytest.mark.parametrize("pair", LAYOUT_PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
@pytest.mark.parametrize("axis", [1, -1, 2])
def test_backward_layouts_match_torch(pair, variant, axis):
    case = make_case((3, 4, 5, 6), axis, variant, "train", True, (True, True, True), pair[1:],
                     seed=3)
    _compare_with_torch(case)


# --------------------------------------------------------------------------- mixed precision

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data", [F16, BF16], ids=["float16", "bfloat16"])
def test_mixed_precision_dtypes(data, mode):
    """Half data + float32 parameters: float32 grad_weight/grad_bias, grad_input in input's
    dtype."""
    case = make_case((4, 3, 5), 1, DTYPE_VARIANT[f"{np.dtype(data).name}-p32"], mode, True)
    gi, gw, gb = check_backward(case)
    assert_dtype(gi, data, "grad_input")
    assert_dtype(gw, F32, "grad_weight")
    assert_dtype(gb, F32, "grad_bias")


@pytest.mark.parametrize("data", [F16, BF16], ids=["float16", "bfloat16"])
def test_half_input_float32_stats_no_weight(data):
    """No weight but float32 save stats (what the forward returns for half input): float32 grads,
    as PyTorch does."""
    case = make_case((4, 3, 5), 1, DTYPE_VARIANT[f"{np.dtype(data).name}-p32"], "train", False)
    gi, gw, gb = check_backward(case)
    assert_dtype(gw, F32, "grad_weight")
    assert_dtype(gb, F32, "grad_bias")


# --------------------------------------------------------------------------- empty sizes

EMPTY_SHAPES = [
    pytest.param((0, 3, 4), 1, id="N0"),
    pytest.param((2, 3, 0), 1, id="spatial0"),
    pytest.param((0, 3), 1, id="N0-2d"),
    pytest.param((0, 2, 3, 3), -1, id="N0-nhwc"),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
@pytest.mark.parametrize("shape,axis", EMPTY_SHAPES)
def test_zero_elements_per_channel(shape, axis, variant, mode):
    """N = 0 (or any reduced size 0): empty grad_input, zero grad_weight / grad_bias."""
    case = make_case(shape, axis, variant, mode, True)
    gi, gw, gb = check_backward(case)
    assert gi.shape == shape and gi.size == 0
    n_channels = shape[axis]
    assert np.array_equal(gw.astype(np.float64), np.zeros(n_channels))
    assert np.array_equal(gb.astype(np.float64), np.zeros(n_channels))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
@pytest.mark.parametrize("shape,axis", [((4, 0, 5), 1), ((4, 0), 1), ((2, 3, 0), -1)],
                         ids=["C0", "C0-2d", "C0-last"])
def test_zero_channels(shape, axis, variant, mode):
    """C = 0: empty outputs of the right shapes and dtypes."""
    case = make_case(shape, axis, variant, mode, True)
    gi, gw, gb = check_backward(case)
    assert gi.shape == shape and gw.shape == (0,) and gb.shape == (0,)


# --------------------------------------------------------------------------- accumulation

@pytest.mark.parametrize("shape,axis", [((2 ** 25, 1), 1), ((1, 1, 2 ** 25), 1)],
                         ids=["2d-(2^25,1)", "chfirst-(1,1,2^25)"])
def test_float32_sums_do_not_stall_at_2_24(shape, axis, record_property):
    """2^25 float32 ones: grad_bias must be exactly 2^25.

    Contrast (documented, not asserted): PyTorch 2.13 on one thread returns 16777216 = 2^24
    for the 2-D case, because its float32 running sum stops growing at 2^24.
    """
    ones = np.ones(shape, dtype=np.float32)
    _, gw, gb = bngrad.batch_norm_backward(
        ones, ones, None, None, None, np.zeros(1, np.float32), np.ones(1, np.float32), True,
        1e-5, (False, True, True), channel_axis=axis)
    assert gb.dtype == np.float32 and gw.dtype == np.float32
    assert gb[0] == 2.0 ** 25, f"grad_bias {gb[0]!r}, expected 2^25 = {2 ** 25}"
    assert gw[0] == 2.0 ** 25, f"grad_weight {gw[0]!r}, expected 2^25 = {2 ** 25}"
    try:  # the contrast, for the record only
        import torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            t = torch.from_numpy(ones)
            _, _, tgb = torch.ops.aten.native_batch_norm_backward(
                t, t, None, None, None, torch.zeros(1), torch.ones(1), True, 1e-5,
                [False, True, True])
            record_property("torch_single_thread_grad_bias", float(tgb[0]))
        finally:
            torch.set_num_threads(threads)
    except ImportError:
        pass


@pytest.mark.parametrize("layout", ["2d", "chfirst"])
@pytest.mark.parametrize("data", [F16, BF16], ids=["float16", "bfloat16"])
def test_half_sums_accumulate_in_float32_or_wider(data, layout):
    """70000 half ones: exact sums need >= float32 accumulation (float16 stalls at 2048,
    bfloat16 at 256). float32 params make grad_bias float32, so 70000 is representable."""
    shape = (70000, 1) if layout == "2d" else (1, 1, 70000)
    ones = np.ones(shape, dtype=data)
    zero, one = np.zeros(1, np.float32), np.ones(1, np.float32)
    gi, gw, gb = bngrad.batch_norm_backward(ones, ones, one, None, None, zero, one, True, 1e-5)
    assert gb.dtype == np.float32 and gb[0] == 70000.0, f"grad_bias {gb[0]!r}, expected 70000"
    assert gw[0] == 70000.0, f"grad_weight {gw[0]!r}, expected 70000"
    # dx = (1 - 70000/70000 - 1 * 70000/70000) * 1 * 1 = -1 everywhere
    assert np.all(gi.astype(np.float64) == -1.0), np.unique(gi.astype(np.float64))[:5]
    sum_dy, sum_dy_xmu, _, _ = bngrad.batch_norm_backward_reduce(ones, ones, zero, one)
    assert float(sum_dy[0]) == 70000.0 and float(sum_dy_xmu[0]) == 70000.0


@pytest.mark.parametrize("variant", ["float32", "float16-p32", "bfloat16-p32"])
@pytest.mark.parametrize("shape,axis", [((8, 3, 5000), 1), ((50000, 4), 1), ((3000, 70), 1)],
                         ids=["chfirst-8x3x5000", "2d-50000x4", "2d-3000x70"])
def test_many_blocks_accuracy(shape, axis, variant):
    """Shapes whose reductions span many blocks, every mode, against the reference."""
    for mode in MODES:
        check_backward(make_case(shape, axis, variant, mode, True, seed=11))


# --------------------------------------------------------------------------- special values

@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf - inf in the reference
@pytest.mark.parametrize("where", ["input-nan", "grad_out-nan", "grad_out-inf", "input-inf"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("variant", ["float64", "float32", "bfloat16-p32"])
def test_nan_inf_propagate_like_torch(where, mode, variant):
    """NaN/Inf in the data are not an error; they propagate as PyTorch's do."""
    torch = pytest.importorskip("torch")  # noqa: F841
    case = make_case((3, 2, 4), 1, variant, mode, True, seed=2)
    target = case.input if where.startswith("input") else case.grad_out
    target[1, 0, 2] = np.nan if where.endswith("nan") else np.inf
    ours = bngrad.batch_norm_backward(*case.args())
    theirs = torch_backward(case)
    expected = reference.batch_norm_backward(*case.args())
    for name, a, t, r in zip(("grad_input", "grad_weight", "grad_bias"), ours, theirs, expected):
        a64, t64 = a.astype(np.float64), t.astype(np.float64)
        assert np.array_equal(np.isnan(a64), np.isnan(t64)), f"{name}: NaNs differ from PyTorch"
        assert np.array_equal(np.isinf(a64), np.isinf(t64)), f"{name}: infs differ from PyTorch"
        assert np.array_equal(a64[np.isinf(a64)], t64[np.isinf(t64)]), f"{name}: inf signs"
        finite = np.isfinite(r)
        assert_close(a64[finite], r[finite], a.dtype, name, scale=np.max(np.abs(r[finite]),
                                                                          initial=1.0))


# --------------------------------------------------------------------------- odd strides

@pytest.mark.parametrize("variant", ["float32", "float16"])
def test_broadcast_grad_out(variant):
    """grad_out with zero strides (the gradient of a sum: ones broadcast to input's shape)."""
    case = make_case((4, 3, 5), 1, variant, "train", True, seed=4)
    case.grad_out = np.broadcast_to(np.ones((1, 1, 1), dtype=case.input.dtype), case.input.shape)
    check_backward(case)


@pytest.mark.parametrize("axis", [1, -1])
def test_size_one_axes_and_single_channel(axis):
    for shape in [(1, 1, 1, 7), (5, 1), (1, 4, 1, 1), (2, 1, 3, 1)]:
        for mode in MODES:
            check_backward(make_case(shape, axis, "float32", mode, True, seed=9))


def test_channels_last_view_made_by_transpose():
    """An NHWC array handed over as a transposed NCHW view (what x.permute gives in PyTorch)."""
    rng = np.random.default_rng(0)
    nhwc = rng.standard_normal((2, 5, 6, 3)).astype(np.float32)
    dy = rng.standard_normal((2, 5, 6, 3)).astype(np.float32)
    x = nhwc.transpose(0, 3, 1, 2)
    case = make_case((2, 3, 5, 6), 1, "float32", "train-nostats", True)
    case.input, case.grad_out = x, dy.transpose(0, 3, 1, 2)
    gi, _, _ = check_backward(case)
    assert gi.transpose(0, 2, 3, 1).flags.c_contiguous


@pytest.mark.parametrize("weight_dtype", [F32, F64], ids=["w32", "w64"])
def test_float64_weight_with_half_input(weight_dtype):
    """The dtype mixes bngrad accepts beyond PyTorch: documented by this test."""
    case = make_case((4, 3, 5), 1, "float16", "train", True)
    case.weight = case.weight.astype(weight_dtype)
    gi, gw, gb = check_backward(case)
    assert gw.dtype == weight_dtype and gb.dtype == weight_dtype
