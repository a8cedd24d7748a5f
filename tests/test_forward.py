"""bngrad.batch_norm_forward against bngrad.reference and PyTorch's native_batch_norm.

Matrix: dtype variant x mode x input layout x ndim x channel_axis (full product), with
affine parameters and running statistics given or not dealt round-robin. Checked: output
values and dtype, save_mean / save_invstd (float32 for half inputs, always, and accurate to
float32), the in-place running-stat update (unbiased variance), inputs left untouched.
"""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import bngrad
from bngrad import kernels, reference
from conftest import (BF16, DTYPE_VARIANT, DTYPE_VARIANTS, F16, F32, F64, HALF, LAYOUTS, SHAPES,
                      channel_axes, from_torch, is_dense, make_data,
                      memory_order, quantize, to_layout, to_torch)
from tolerances import assert_bitwise_equal, assert_close, assert_dtype

PARAM_OPTIONS = list(itertools.product((True, False), (True, False)))  # (affine, running stats)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def stat_dtype(data_dtype) -> np.dtype:
    return F32 if np.dtype(data_dtype) in HALF else np.dtype(data_dtype)


def make_forward_case(shape, axis, variant, affine, running, layout="contig", seed=0):
    v = DTYPE_VARIANT[variant]
    rng = np.random.default_rng(seed)
    n_channels = shape[axis % len(shape)]
    _, x = make_data(shape, axis, rng, v.data, offset=2.0)
    x = to_layout(x, layout, axis % len(shape))
    w = quantize(rng.uniform(-1.5, 1.5, n_channels), v.param) if affine else None
    b = quantize(rng.standard_normal(n_channels), v.param) if affine else None
    rm = quantize(rng.normal(0, 0.5, n_channels), v.param) if running else None
    rv = quantize(rng.uniform(0.5, 2.0, n_channels), v.param) if running else None
    return x, w, b, rm, rv


def check_forward(x, w, b, rm, rv, train, momentum=0.1, eps=1e-5, axis=1, num_threads=None):
    """Run bngrad.batch_norm_forward and hold it to the reference; returns its result."""
    args_before = [None if a is None else a.copy() for a in (x, w, b)]
    rm_before = None if rm is None else rm.copy()
    rv_before = None if rv is None else rv.copy()
    ref_out, ref_mean, ref_invstd, ref_rm, ref_rv = reference.batch_norm_forward(
        x, w, b, rm, rv, train, momentum, eps, channel_axis=axis)
    result = bngrad.batch_norm_forward(x, w, b, rm, rv, train, momentum, eps, channel_axis=axis,
                                       num_threads=num_threads)
    assert isinstance(result, tuple) and len(result) == 3
    out, mean, invstd = result
    for a, before in zip((x, w, b), args_before):
        if a is not None:
            assert np.array_equal(a, before, equal_nan=True), "an argument was modified"
    assert_dtype(out, x.dtype, "output")
    assert out.shape == x.shape
    if is_dense(x):
        assert memory_order(out) == memory_order(x), (
            f"output: axis order {memory_order(out)}, input's {memory_order(x)}")
    assert_close(out, ref_out, out.dtype, "output")
    sdt = stat_dtype(x.dtype)
    assert_dtype(mean, sdt, "save_mean")
    assert_dtype(invstd, sdt, "save_invstd")
    if train:
        x_ch = np.moveaxis(x.astype(np.float64), axis, -1).reshape(-1, x.shape[axis])
        mean_scale = np.abs(x_ch).mean(axis=0) if x_ch.shape[0] else 1.0
        assert_close(mean, ref_mean, sdt, "save_mean", scale=mean_scale)
        assert_close(invstd, ref_invstd, sdt, "save_invstd", scale=np.abs(ref_invstd))
        for name, got, before, ref in (("running_mean", rm, rm_before, ref_rm),
                                       ("running_var", rv, rv_before, ref_rv)):
            if got is not None:
                # tolerance of the stored dtype; the update is 2 terms of comparable size
                scale = np.abs((1 - momentum) * before.astype(np.float64)) + np.abs(ref)
                assert_close(got, ref, got.dtype, f"{name} (updated in place)", scale=scale)
    else:
        assert mean.shape == (0,) and invstd.shape == (0,), "eval: save stats must be empty"
        for name, got, before in (("running_mean", rm, rm_before), ("running_var", rv, rv_before)):
            assert np.array_equal(got, before), f"{name}: changed in eval mode"
    return result


def _matrix():
    cases = []
    for vi, v in enumerate(DTYPE_VARIANTS):
        for train in (True, False):
            inner = [(layout, nd, axid, ax) for layout in LAYOUTS for nd in SHAPES
                     for axid, ax in channel_axes(nd)]
            for i, (layout, nd, axid, ax) in enumerate(inner):
                affine, running = PARAM_OPTIONS[(i + vi + 2 * train) % 4]
                if not train:
                    running = True  # eval needs running stats (the error is tested elsewhere)
                ident = (f"{v.id}-{'train' if train else 'eval'}-{layout}-{nd}d-{axid}-"
                         f"{'affine' if affine else 'noaffine'}-"
                         f"{'running' if running else 'norunning'}")
                cases.append(pytest.param(v.id, train, layout, nd, ax, affine, running,
                                          id=ident))
    return cases


@pytest.mark.parametrize("variant,train,layout,ndim,axis,affine,running", _matrix())
def test_forward_matches_reference(variant, train, layout, ndim, axis, affine, running):
    x, w, b, rm, rv = make_forward_case(SHAPES[ndim], axis, variant, affine, running, layout,
                                        seed=_seed(variant, layout, ndim, axis))
    check_forward(x, w, b, rm, rv, train, axis=axis)


@pytest.mark.parametrize("momentum", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("variant", ["float64", "float32", "bfloat16-p32"])
def test_running_stats_momentum(variant, momentum):
    x, w, b, rm, rv = make_forward_case((6, 3, 4), 1, variant, True, True, seed=3)
    rm_id, rv_id = id(rm), id(rv)
    check_forward(x, w, b, rm, rv, True, momentum=momentum)
    assert id(rm) == rm_id and id(rv) == rv_id


def test_running_stats_strided_views_updated_in_place():
    """Running stats that are views (every other element of a buffer) are updated in place."""
    x, w, b, _, _ = make_forward_case((6, 3, 4), 1, "float32", True, False, seed=4)
    buf_m = np.zeros(6, np.float32)
    buf_v = np.ones(6, np.float32)
    rm, rv = buf_m[::2], buf_v[::2]
    check_forward(x, w, b, rm, rv, True)
    assert np.all(buf_m[1::2] == 0) and np.all(buf_v[1::2] == 1), "neighbours were touched"
    assert not np.all(buf_m[::2] == 0), "running_mean view not updated"


# --------------------------------------------------------------------------- statistics accuracy

@pytest.mark.parametrize("data,offset,shape", [
    (F16, 1000.0, (20000, 2)),
    (F16, 1000.0, (2, 2, 10000)),
    (BF16, 100.0, (20000, 2)),
    (BF16, 100.0, (2, 2, 10000)),
    (F32, 1e4, (50000, 2)),
    (F32, 1e4, (2, 2, 25000)),
], ids=["float16-2d", "float16-chfirst", "bfloat16-2d", "bfloat16-chfirst", "float32-2d",
        "float32-chfirst"])
def test_save_stats_accurate_with_large_mean(data, offset, shape):
    """mean >> std: one-pass E[x^2] - E[x]^2 or half/float32 accumulation would fail this.
    save_mean/save_invstd must be float32 for half inputs and accurate to float32."""
    rng = np.random.default_rng(0)
    x = quantize(offset + rng.standard_normal(shape), data)
    _, mean, invstd = bngrad.batch_norm_forward(x)
    _, ref_mean, ref_invstd, _, _ = reference.batch_norm_forward(x)
    assert_dtype(mean, stat_dtype(data), "save_mean")
    assert_dtype(invstd, stat_dtype(data), "save_invstd")
    assert_close(mean, ref_mean, mean.dtype, "save_mean")
    assert_close(invstd, ref_invstd, invstd.dtype, "save_invstd")
    m, v = bngrad.batch_norm_moments(x)
    ref_m, ref_v = reference.batch_norm_moments(x)
    assert_dtype(m, F64, "moments mean")
    assert_close(m, ref_m, F64, "moments mean", scale=offset, factor=1e3)  # float64 sums
    assert_close(v, ref_v, F32, "moments var")


# --------------------------------------------------------------------------- edge sizes

def test_running_var_with_one_element_per_channel_matches_torch():
    """count 1: the unbiased variance is 0/0 and PyTorch's running_var becomes NaN."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(2).standard_normal((1, 3, 1, 1)).astype(np.float32)
    rm, rv = np.zeros(3, np.float32), np.ones(3, np.float32)
    bngrad.batch_norm_forward(x, None, None, rm, rv, True, 0.1, 1e-5)
    t_rm, t_rv = torch.zeros(3), torch.ones(3)
    torch.ops.aten.native_batch_norm(torch.from_numpy(x), None, None, t_rm, t_rv, True, 0.1, 1e-5)
    assert_close(rm, t_rm.numpy(), F32, "running_mean")
    np.testing.assert_array_equal(rv, t_rv.numpy(), err_msg="running_var with count 1")


@pytest.mark.parametrize("variant", ["float32", "float16-p32"])
@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 3, 0), (0, 3)], ids=["N0", "spatial0", "N0-2d"])
def test_forward_zero_elements(shape, variant):
    """No elements per channel (PyTorch raises): empty output, no crash, running stats kept."""
    x, w, b, rm, rv = make_forward_case(shape, 1, variant, True, True)
    rm0, rv0 = rm.copy(), rv.copy()
    out, mean, invstd = bngrad.batch_norm_forward(x, w, b, rm, rv, True)
    assert out.shape == shape and out.dtype == x.dtype
    assert mean.shape == (3,) and invstd.shape == (3,)
    assert np.array_equal(rm, rm0) and np.array_equal(rv, rv0), "running stats changed by N=0"
    out, mean, invstd = bngrad.batch_norm_forward(x, w, b, rm, rv, False)
    assert out.shape == shape and mean.shape == (0,)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_forward_zero_channels(train):
    x, w, b, rm, rv = make_forward_case((4, 0, 5), 1, "float32", True, True)
    out, mean, invstd = bngrad.batch_norm_forward(x, w, b, rm, rv, train)
    assert out.shape == (4, 0, 5) and mean.shape == (0,) and invstd.shape == (0,)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("where", ["nan", "inf"])
def test_forward_nan_inf_propagate_like_torch(where):
    torch = pytest.importorskip("torch")
    x, w, b, _, _ = make_forward_case((3, 2, 4), 1, "float32", True, False, seed=2)
    x[1, 0, 2] = np.nan if where == "nan" else np.inf
    out, mean, invstd = bngrad.batch_norm_forward(x, w, b)
    t_out, t_mean, t_invstd = torch.ops.aten.native_batch_norm(
        torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b), None, None, True, 0.1,
        1e-5)
    for name, a, t in (("output", out, t_out), ("save_mean", mean, t_mean),
                       ("save_invstd", invstd, t_invstd)):
        t = t.numpy()
        assert np.array_equal(np.isnan(a), np.isnan(t)), f"{name}: NaNs differ from PyTorch"
        assert np.array_equal(a[np.isinf(a)], t[np.isinf(t)]), f"{name}: infs differ"


# --------------------------------------------------------------------------- PyTorch

TORCH_SAMPLE_SHAPES = [(5, 5, 5), (3, 2, 4), (3, 1), (3, 2, 3, 4), (2, 1), (1, 2, 3)]
NHWC_SHAPES = [(4, 8, 10, 10), (4, 1, 9, 9), (4, 9, 1, 1)]
TORCH_SHAPES = ([pytest.param(s, "contig", id="x".join(map(str, s))) for s in TORCH_SAMPLE_SHAPES]
                + [pytest.param(s, "chlast", id="x".join(map(str, s)) + "-nhwc")
                   for s in NHWC_SHAPES])


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
@pytest.mark.parametrize("shape,layout", TORCH_SHAPES)
def test_forward_matches_torch(shape, layout, variant, train, affine):
    torch = pytest.importorskip("torch")
    x, w, b, rm, rv = make_forward_case(shape, 1, variant, affine, True, layout,
                                        seed=_seed(shape, variant))
    t_rm, t_rv = to_torch(rm.copy()).clone(), to_torch(rv.copy()).clone()
    out, mean, invstd = bngrad.batch_norm_forward(x, w, b, rm, rv, train)
    t_out, t_mean, t_invstd = torch.ops.aten.native_batch_norm(
        to_torch(x), to_torch(w), to_torch(b), t_rm, t_rv, train, 0.1, 1e-5)
    tol = x.dtype  # PyTorch as a 2nd oracle: semantics; accuracy is judged vs the reference
    assert out.dtype == from_torch(t_out).dtype
    # Term scale of output = x*a + c: PyTorch normalises half data with half-rounded
    # statistics, an error of u * |mean| * invstd * |w| that the term scale accounts for.
    _, ref_mean, ref_invstd, _, _ = reference.batch_norm_forward(x, w, b, rm, rv, train)
    a = (ref_invstd if train else 1 / np.sqrt(rv.astype(np.float64) + 1e-5)) * (
        1.0 if w is None else np.abs(w.astype(np.float64)))
    term_scale = (np.max(np.abs(x.astype(np.float64))) * np.max(a)
                  + (0.0 if b is None else np.max(np.abs(b.astype(np.float64)))))
    assert_close(out, from_torch(t_out), tol, "output vs PyTorch", factor=2, scale=term_scale)
    assert mean.shape == tuple(t_mean.shape) and invstd.shape == tuple(t_invstd.shape)
    # deliberate difference: float32 save stats for half inputs even where PyTorch gives half
    assert mean.dtype == stat_dtype(x.dtype)
    if train:
        assert_close(mean, from_torch(t_mean), tol, "save_mean vs PyTorch", factor=2,
                     scale=np.max(np.abs(x.astype(np.float64))))
        assert_close(invstd, from_torch(t_invstd), tol, "save_invstd vs PyTorch", factor=2)
    assert rm.dtype == from_torch(t_rm).dtype
    assert_close(rm, from_torch(t_rm), rm.dtype, "running_mean vs PyTorch", factor=2,
                 scale=1.0)
    assert_close(rv, from_torch(t_rv), rv.dtype, "running_var vs PyTorch", factor=2)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
def test_running_update_is_numpys_expression_bitwise(dtype):
    """kernels.update_running_stats (compiled for float32/float64) gives the bits of NumPy's
    ``(1 - momentum) * running + momentum * batch`` on the running statistic's dtype, and for
    halves the float64 value rounded once (NumPy's expression on a half array rounds the
    product to the half type first: float16 running statistics were a unit off PyTorch's in a
    quarter of the channels); the variance's batch statistic unbiased (NaN for a count of 1),
    NaN and inf passing."""
    dt = {"float32": F32, "float64": F64, "float16": F16, "bfloat16": BF16}[dtype]
    wide = np.float64 if dt in (F16, BF16) else dt
    rng = np.random.default_rng(5)
    mean, var = rng.normal(0, 3, 64), rng.uniform(0, 5, 64)
    mean[:3], var[3:5] = (np.nan, np.inf, -np.inf), (np.nan, np.inf)
    for momentum in (0.1, 0.01, 1 / 3, 0.0, 1.0, 0.123456789):
        for count in (1, 2, 7, 1000003):
            start_mean = rng.normal(0, 2, 64).astype(dt)
            start_var = rng.uniform(0, 4, 64).astype(dt)
            rm, rv = start_mean.copy(), start_var.copy()
            with np.errstate(invalid="ignore", over="ignore"):  # inf * 0, as in the forward
                kernels.update_running_stats(rm, rv, mean, var, momentum, count)
                unbiased = var * count / (count - 1) if count > 1 else np.full(64, np.nan)
                expect_mean = ((1 - momentum) * start_mean.astype(wide)
                               + momentum * mean).astype(dt)
                expect_var = ((1 - momentum) * start_var.astype(wide)
                              + momentum * unbiased).astype(dt)
            assert_bitwise_equal(rm, expect_mean, f"running_mean {momentum} {count}")
            assert_bitwise_equal(rv, expect_var, f"running_var {momentum} {count}")
            for alone, expect, other in ((0, expect_mean, 1), (1, expect_var, 0)):
                stats = [None, None]  # one of them given: the other is skipped
                stats[alone] = (start_mean if alone == 0 else start_var).copy()
                with np.errstate(invalid="ignore", over="ignore"):
                    kernels.update_running_stats(*stats, mean, var, momentum, count)
                assert stats[other] is None
                assert_bitwise_equal(stats[alone], expect, f"alone {alone} {momentum} {count}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_running_statistics_are_the_reference_rounded_once(dtype):
    """Half running statistics (with half input, weight and bias) are the float64 reference's
    new running statistics rounded once to the half type, in every channel."""
    dt = {"float16": F16, "bfloat16": BF16}[dtype]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((16, 4096)).astype(F32).astype(dt)
    rm = rng.standard_normal(4096).astype(F32).astype(dt)
    rv = (rng.random(4096) + 0.5).astype(F32).astype(dt)
    w, b = np.ones(4096, dt), np.zeros(4096, dt)
    new_rm, new_rv = rm.copy(), rv.copy()
    bngrad.batch_norm_forward(x, w, b, new_rm, new_rv, True, 0.1)
    expected = reference.batch_norm_forward(x, w, b, rm, rv, True, 0.1)
    assert_bitwise_equal(new_rm, expected[3].astype(dt), "running_mean")
    assert_bitwise_equal(new_rv, expected[4].astype(dt), "running_var")


def test_an_invstd_beyond_float32_warns_nothing():
    """A variance of ~1e-80 (float32 subnormals) with eps 0 has an invstd beyond float32's
    range: the saved float32 invstd is inf, silently (NumPy's cast warned, an error under
    ``-W error``); the mean is the reference's."""
    import warnings

    x = np.array([[1e-40], [-1e-40], [2e-40], [0.0]]).astype(F32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, mean, invstd = bngrad.batch_norm_forward(x, eps=0.0)
    assert invstd.dtype == F32 and np.isposinf(invstd[0])
    assert_close(mean, reference.batch_norm_moments(x)[0], F32, "mean")


@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
@pytest.mark.parametrize("momentum", [0.0, 0.1])
def test_inf_and_nan_data_warn_nothing(variant, momentum):
    """inf/NaN input gives NaN statistics (as in PyTorch) silently: the kernels do not warn and
    the NumPy running update of half statistics (0 * inf with momentum 0) is guarded."""
    import warnings

    x, w, b, rm, rv = make_forward_case((3, 2, 4), 1, variant, True, True, seed=2)
    x[1, 0, 2], x[2, 1, 0] = np.inf, np.nan
    x[0, 1, 0] = -np.inf  # channel 0: mean inf (0 * inf in the update), channel 1: NaN
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for train in (True, False):
            out, mean, invstd = bngrad.batch_norm_forward(x, w, b, rm, rv, train, momentum)
            bngrad.batch_norm_backward(x, x, w, rm, rv, mean, invstd, train)
    assert not np.isfinite(rm.astype(np.float64)).any()  # inf (0 * inf: NaN), NaN
