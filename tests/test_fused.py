"""bngrad.batch_norm_relu_forward / _backward (batch norm + side input + ReLU) against
bngrad.reference: every dtype variant, layouts (one array each: input, grad_out, side_input),
train/eval, with and without side input, the backward given the output or either mask format,
every output_mask, every kernel path (forced, with tests/test_paths.py's grids), ties at
exactly 0 and NaN (as PyTorch's threshold_backward), errors."""

from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest

import bngrad
from bngrad import reference
from conftest import (DTYPE_VARIANT, DTYPE_VARIANTS, F32, assert_output_layout, make_data,
                      quantize, to_layout)
from test_paths import CASES, _assert_path, _case_id, _on_path
from tolerances import assert_close, assert_dtype, backward_scales

SHAPE = (3, 4, 2, 5)
# (id, input layout, grad_out layout, side_input layout, channel axis)
LAYOUTS = [
    ("nchw", "contig", "contig", "contig", 1),
    ("nhwc", "chlast", "chlast", "chlast", 1),
    ("mixed", "chlast", "contig", "fortran", 1),
    ("sliced", "sliced", "chlast", "flipped", 1),
    ("axis-1", "contig", "contig", "contig", -1),
]
FORMS = ["output", "bits", "bytes"]


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _case(variant, layout, train, with_side, seed, shape=SHAPE):
    v = DTYPE_VARIANT[variant]
    _, in_l, go_l, z_l, ax = layout
    rng = np.random.default_rng(seed)
    c = shape[ax]
    dy, x = make_data(shape, ax, rng, v.data)
    z = quantize(rng.standard_normal(shape), v.data) if with_side else None
    p = dict(weight=quantize(rng.uniform(-1.5, 1.5, c), v.param),
             bias=quantize(rng.standard_normal(c) * 0.5, v.param),
             running_mean=quantize(rng.normal(0.0, 0.3, c), v.param),
             running_var=quantize(rng.uniform(0.5, 2.0, c), v.param))
    return dict(x=to_layout(x, in_l, ax), dy=to_layout(dy, go_l, ax),
                z=None if z is None else to_layout(z, z_l, ax), params=p, train=train, axis=ax)


def _memory_order(x):
    """The documented element order of a 'bits' mask of x: the axes by decreasing stride where
    x is dense in that order, else C order (computed here independently of bngrad)."""
    order = sorted(range(x.ndim), key=lambda axis: -x.strides[axis])
    dense = x.itemsize
    for axis in reversed(order):
        if x.shape[axis] > 1 and x.strides[axis] != dense:
            return list(range(x.ndim))
        dense *= x.shape[axis]
    return order


def _unpack(bits, x):
    """The documented 'bits' format, decoded independently of bngrad: element i of x's memory
    order is bit i % 8 of byte i // 8."""
    order = _memory_order(x)
    n = x.size
    flat = [(int(bits[i // 8]) >> (i % 8)) & 1 for i in range(n)]
    in_memory = np.array(flat, dtype=bool).reshape([x.shape[axis] for axis in order])
    return in_memory.transpose(np.argsort(order))


def _check_forward(case, mask_format, num_threads=None):
    p = case["params"]
    rm, rv = p["running_mean"].copy(), p["running_var"].copy()
    x, z = case["x"], case["z"]
    x_before = x.copy()
    out, mean, invstd, mask = bngrad.batch_norm_relu_forward(
        x, p["weight"], p["bias"], rm, rv, case["train"], 0.1, 1e-5, side_input=z,
        mask_format=mask_format, channel_axis=case["axis"], num_threads=num_threads)
    np.testing.assert_array_equal(x, x_before)
    ref, ref_mean, ref_invstd, ref_rm, ref_rv, _ = reference.batch_norm_relu_forward(
        x, p["weight"], p["bias"], p["running_mean"], p["running_var"], case["train"], 0.1,
        1e-5, side_input=z, channel_axis=case["axis"])
    assert_dtype(out, x.dtype, "output")
    assert_output_layout(out, x, "output")
    # the add rounds once more than batch norm alone: judge against max |bn| + max |z|
    scale = np.abs(ref).max() + (0 if z is None else np.abs(z.astype(np.float64)).max())
    assert_close(out, ref, what="output", scale=scale)
    assert (out.astype(np.float64) >= 0).all()
    if case["train"]:
        assert_close(mean, ref_mean, what="save_mean")
        assert_close(invstd, ref_invstd, what="save_invstd")
        assert_close(rm, ref_rm, what="running_mean")
        assert_close(rv, ref_rv, what="running_var")
    else:
        assert mean.shape == (0,) and invstd.shape == (0,)
        np.testing.assert_array_equal(rm, p["running_mean"])
    positive = out.astype(np.float64) > 0
    if mask_format == "bits":
        assert mask.dtype == np.uint8 and mask.shape == ((x.size + 7) // 8,)
        np.testing.assert_array_equal(_unpack(mask, x), positive)
    elif mask_format == "bytes":
        assert mask.dtype == np.bool_ and mask.shape == x.shape
        np.testing.assert_array_equal(mask, positive)
        if _memory_order(x) != list(range(x.ndim)):  # laid out as input, where input is dense
            assert np.argsort(mask.strides, kind="stable").tolist() == np.argsort(
                x.strides, kind="stable").tolist()
    else:
        assert mask is None
    return out, mean, invstd, mask


def _check_fused(case, output_masks=((True,) * 4,), num_threads=None):
    """Forward (three mask formats) and backward (given y or either mask; each of
    ``output_masks``) of ``case`` against the reference."""
    p, x, dy, train = case["params"], case["x"], case["dy"], case["train"]
    out, mean, invstd, bits = _check_forward(case, "bits", num_threads)
    mask_bytes = _check_forward(case, "bytes", num_threads)[3]
    assert _check_forward(case, None, num_threads)[3] is None
    # The backward is judged given the fast forward's own y: near 0 a half-precision y may
    # round to the other side of the ReLU than the float64 one, and that is not the backward's
    # business.
    ref = reference.batch_norm_relu_backward(dy, x, p["weight"], p["running_mean"],
                                             p["running_var"], mean, invstd, train, 1e-5,
                                             output=out, channel_axis=case["axis"])
    g = np.where(out.astype(np.float64) > 0, dy.astype(np.float64), 0.0)
    stats = ((mean, invstd) if train else
             (p["running_mean"], 1 / np.sqrt(p["running_var"].astype(np.float64) + 1e-5)))
    scales = backward_scales(g, x, p["weight"], *stats, case["axis"])
    for form, output_mask in itertools.product(FORMS, output_masks):
        given = {"output": {"output": out}, "bits": {"relu_mask": bits},
                 "bytes": {"relu_mask": mask_bytes}}[form]
        dy_before = dy.copy()
        gi, gw, gb, gz = bngrad.batch_norm_relu_backward(
            dy, x, p["weight"], p["running_mean"], p["running_var"], mean, invstd, train, 1e-5,
            output_mask, channel_axis=case["axis"], num_threads=num_threads, **given)
        np.testing.assert_array_equal(dy, dy_before)
        what = f"({form}, output_mask {output_mask})"
        for name, got, on in zip(("grad_input", "grad_weight", "grad_bias", "grad_side_input"),
                                 (gi, gw, gb, gz), output_mask):
            assert (got is None) == (not on), f"{name} {what}"
        if output_mask[0]:
            assert_dtype(gi, x.dtype, "grad_input")
            assert_output_layout(gi, x)
            assert_close(gi, ref[0], what=f"grad_input {what}",
                         scale=scales["grad_input"] if train else None)
        if output_mask[1]:
            assert_dtype(gw, p["weight"].dtype, "grad_weight")
            assert_close(gw, ref[1], what=f"grad_weight {what}", scale=scales["grad_weight"])
        if output_mask[2]:
            assert_close(gb, ref[2], what=f"grad_bias {what}", scale=scales["grad_bias"])
        if output_mask[3]:
            assert_dtype(gz, x.dtype, "grad_side_input")
            assert_output_layout(gz, x, "grad_side_input")
            # g is dy with zeros: exact in every dtype
            np.testing.assert_array_equal(gz.astype(np.float64), g,
                                          err_msg=f"grad_side_input {what}")


@pytest.mark.parametrize("with_side", [True, False], ids=["side", "noside"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay[0])
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
def test_fused_matches_reference(variant, layout, train, with_side):
    seed = _seed(variant, layout, train, with_side)
    _check_fused(_case(variant, layout, train, with_side, seed))


# grad_side_input with and without grad_input (its own pass), grad_input alone
PATH_OUTPUT_MASKS = ((True, True, True, True), (False, True, True, True),
                     (True, False, False, False))


@pytest.mark.parametrize("with_side", [True, False], ids=["side", "noside"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
@pytest.mark.parametrize("path_case", CASES, ids=_case_id)
def test_fused_on_every_path(path_case, variant, train, with_side):
    """The fused variants of each kernel path (lanes, short, runs, fused; forced on small
    arrays with shrunk tuning constants, as tests/test_paths.py) against the reference."""
    grid, path = path_case
    layout = (grid[0], grid[2], grid[2], grid[2], 1)
    case = _case(variant, layout, train, with_side, _seed(grid[0], variant, train, with_side),
                 shape=grid[1])
    with _on_path(grid, path):
        _assert_path(case["x"], path, case["dy"])
        _check_fused(case, PATH_OUTPUT_MASKS, num_threads=2)


@pytest.mark.parametrize("variant", ["float64", "float32", "bfloat16-p32"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_activation_none_is_batch_norm_plus_side_input(variant, train):
    case = _case(variant, LAYOUTS[1], train, True, 7)
    p, x, dy, z = case["params"], case["x"], case["dy"], case["z"]
    out, mean, invstd, mask = bngrad.batch_norm_relu_forward(
        x, p["weight"], p["bias"], p["running_mean"].copy(), p["running_var"].copy(), train,
        side_input=z, activation="none")
    assert mask is None
    ref = reference.batch_norm_relu_forward(
        x, p["weight"], p["bias"], p["running_mean"], p["running_var"], train, side_input=z,
        activation="none")[0]
    assert (ref < 0).any()   # no ReLU applied
    assert_close(out, ref, what="output", scale=np.abs(ref).max() + np.abs(z).max())
    gi, gw, gb, gz = bngrad.batch_norm_relu_backward(
        dy, x, p["weight"], p["running_mean"], p["running_var"], mean, invstd, train,
        activation="none")
    np.testing.assert_array_equal(gz, dy)
    assert not np.shares_memory(gz, dy)
    plain = bngrad.batch_norm_backward(dy, x, p["weight"], p["running_mean"], p["running_var"],
                                       mean, invstd, train)
    for a, b in zip((gi, gw, gb), plain):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay[0])
@pytest.mark.parametrize("variant", [v.id for v in DTYPE_VARIANTS])
def test_add_rounds_as_the_unfused_sequence(variant, layout, train):
    """The fused add form gives the bits of batch norm, then the add in the data type (the
    batch-norm value rounded to it first, as PyTorch's separate ops), then the ReLU."""
    case = _case(variant, layout, train, True, _seed("sequence", variant, layout, train))
    p, x, z = case["params"], case["x"], case["z"]
    args = (x, p["weight"], p["bias"], p["running_mean"].copy(), p["running_var"].copy(), train)
    got = bngrad.batch_norm_relu_forward(*args, side_input=z, channel_axis=case["axis"])
    bn = bngrad.batch_norm_forward(*args, channel_axis=case["axis"])[0]
    added = (bn.astype(np.float32) + z.astype(np.float32)).astype(x.dtype)  # one rounding
    if x.dtype == np.float64:
        added = bn + z
    expected = np.where(added.astype(np.float64) > 0, added, np.zeros((), x.dtype))
    bits = [np.ascontiguousarray(a).view(np.uint8) for a in (got[0], expected)]
    np.testing.assert_array_equal(*bits)
    np.testing.assert_array_equal(_unpack(got[3], x), expected.astype(np.float64) > 0)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay[0])
def test_mask_order_and_unpack_mask(layout):
    """The public helpers follow the documented order: NHWC memory lists channels innermost."""
    case = _case("float32", layout, True, True, _seed("unpack", layout))
    x = case["x"]
    out, _, _, bits = bngrad.batch_norm_relu_forward(x, side_input=case["z"],
                                                     channel_axis=case["axis"])
    assert list(bngrad.fused.mask_order(x)) == _memory_order(x)
    if layout[0] == "nhwc":
        assert bngrad.fused.mask_order(x) == (0, 2, 3, 1)
    passes = bngrad.fused.unpack_mask(bits, x)
    np.testing.assert_array_equal(passes, out > 0)
    np.testing.assert_array_equal(passes, _unpack(bits, x))
    assert bngrad.fused.unpack_mask(passes, x) is passes
    with pytest.raises(ValueError, match="relu_mask: a uint8 mask"):
        bngrad.fused.unpack_mask(bits[:-1], x)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda lay: lay[0])
def test_a_strided_bits_mask_gives_the_bits_of_a_contiguous_one(layout):
    """A "bits" mask is one flat buffer to the kernels: a strided or reversed view of the
    same bytes (found by hostile testing: read as if contiguous, all four outputs wrong)."""
    case = _case("float32", layout, True, True, _seed("strided-bits", layout))
    x, dy, axis = case["x"], case["dy"], case["axis"]
    _, mean, invstd, bits = bngrad.batch_norm_relu_forward(x, channel_axis=axis)
    expected = bngrad.batch_norm_relu_backward(dy, x, None, None, None, mean, invstd,
                                               relu_mask=bits, channel_axis=axis)
    spread = np.zeros(2 * bits.size, np.uint8)
    spread[::2] = bits
    for mask in (spread[::2], bits[::-1].copy()[::-1]):
        got = bngrad.batch_norm_relu_backward(dy, x, None, None, None, mean, invstd,
                                              relu_mask=mask, channel_axis=axis)
        for g, e in zip(got, expected):
            assert (g is None) == (e is None)
            if g is not None:
                np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("output_mask", list(itertools.product((True, False), repeat=4)),
                         ids=lambda m: "mask" + "".join("1" if b else "0" for b in m))
def test_every_output_mask(output_mask):
    case = _case("float32", LAYOUTS[0], True, True, 11)
    p, x, dy = case["params"], case["x"], case["dy"]
    out, mean, invstd, bits = bngrad.batch_norm_relu_forward(
        x, p["weight"], p["bias"], side_input=case["z"])
    got = bngrad.batch_norm_relu_backward(dy, x, p["weight"], None, None, mean, invstd,
                                          output_mask=output_mask, relu_mask=bits)
    full = bngrad.batch_norm_relu_backward(dy, x, p["weight"], None, None, mean, invstd,
                                           relu_mask=bits)
    for name, a, b, on in zip(("grad_input", "grad_weight", "grad_bias", "grad_side_input"),
                              got, full, output_mask):
        if on:
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a is None, name


# --------------------------------------------------------------------------- ties and NaN

@pytest.mark.parametrize("variant", ["float64", "float32", "float16", "bfloat16-p32"])
def test_ties_at_zero_block_the_gradient(variant):
    """y == 0 exactly gives g = 0 (threshold_backward: y <= 0), from y and from both masks."""
    v = DTYPE_VARIANT[variant]
    x = quantize([[0.0, 1.0, -2.0], [-2.0, 0.0, 0.5], [3.0, 0.5, 0.0], [0.0, -1.0, 1.0]], v.data)
    z = quantize([[1.0, -1.0, 2.0], [2.0, 0.0, -0.5], [-3.0, 0.0, 0.0], [0.0, 1.0, -1.0]],
                 v.data)
    dy = quantize(np.arange(1.0, 13.0).reshape(4, 3), v.data)
    # eval, mean 0, var 1, eps 0, no affine: batch norm is the identity, exactly
    rm, rv = np.zeros(3, v.param), np.ones(3, v.param)
    for side in (None, z):
        pre = x.astype(np.float64) + (0 if side is None else side.astype(np.float64))
        assert (pre == 0).sum() >= 3
        out, _, _, bits = bngrad.batch_norm_relu_forward(x, None, None, rm, rv, False, 0.1, 0.0,
                                                         side_input=side)
        mask = bngrad.batch_norm_relu_forward(x, None, None, rm, rv, False, 0.1, 0.0,
                                              side_input=side, mask_format="bytes")[3]
        np.testing.assert_array_equal(out.astype(np.float64), np.maximum(pre, 0))
        np.testing.assert_array_equal(_unpack(bits, x), pre > 0)
        for given in ({"output": out}, {"relu_mask": bits}, {"relu_mask": mask}):
            gi, _, _, gz = bngrad.batch_norm_relu_backward(dy, x, None, rm, rv, None, None,
                                                           False, 0.0, **given)
            expected = np.where(pre > 0, dy.astype(np.float64), 0.0)
            np.testing.assert_array_equal(gz.astype(np.float64), expected)
            np.testing.assert_array_equal(gi.astype(np.float64), expected)


def test_nan_output_passes_the_gradient_as_threshold_backward():
    torch = pytest.importorskip("torch")
    y = np.array([[np.nan, 0.0], [1.0, -0.0], [2.0, np.nan]], dtype=F32)
    dy = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=F32)
    x = np.ones_like(y)
    expected = torch.ops.aten.threshold_backward(torch.from_numpy(dy), torch.from_numpy(y), 0)
    gz = bngrad.batch_norm_relu_backward(dy, x, None, np.zeros(2, F32), np.ones(2, F32),
                                         train=False, output=y)[3]
    np.testing.assert_array_equal(gz, expected.numpy())
    assert gz[0, 0] == 1.0 and gz[0, 1] == 0.0
    # a NaN or infinite gradient where the ReLU blocks becomes 0, as in threshold_backward
    dy[0, 1], dy[1, 1] = np.nan, np.inf
    expected = torch.ops.aten.threshold_backward(torch.from_numpy(dy), torch.from_numpy(y), 0)
    bits = np.packbits(~(y <= 0), axis=None, bitorder="little")
    for given in ({"output": y}, {"relu_mask": bits}):
        gz = bngrad.batch_norm_relu_backward(dy, x, None, np.zeros(2, F32), np.ones(2, F32),
                                             train=False, **given)[3]
        np.testing.assert_array_equal(gz, expected.numpy())
        assert gz[0, 1] == 0 and gz[1, 1] == 0


# --------------------------------------------------------------------------- out= and errors

def test_out_buffers():
    case = _case("float32", LAYOUTS[1], True, True, 5)
    p, x, dy, z = case["params"], case["x"], case["dy"], case["z"]
    expected = bngrad.batch_norm_relu_forward(x, p["weight"], p["bias"], side_input=z)
    buf = np.empty_like(x)
    got = bngrad.batch_norm_relu_forward(x, p["weight"], p["bias"], side_input=z, out=buf)
    assert got[0] is buf
    np.testing.assert_array_equal(buf, expected[0])
    np.testing.assert_array_equal(got[3], expected[3])
    grads = bngrad.batch_norm_relu_backward(dy, x, p["weight"], None, None, *expected[1:3],
                                            relu_mask=expected[3])
    dy2 = dy.copy()
    in_place = bngrad.batch_norm_relu_backward(dy2, x, p["weight"], None, None, *expected[1:3],
                                               relu_mask=expected[3], out=dy2)
    assert in_place[0] is dy2
    for a, b in zip(grads, in_place):
        np.testing.assert_array_equal(a, b)
    y = expected[0].copy()  # out may be the output y it reads, element by element
    into_y = bngrad.batch_norm_relu_backward(dy, x, p["weight"], None, None, *expected[1:3],
                                             output=expected[0])
    assert bngrad.batch_norm_relu_backward(dy, x, p["weight"], None, None, *expected[1:3],
                                           output=y, out=y)[0] is y
    np.testing.assert_array_equal(y, into_y[0])


def _bad_calls():
    x = np.ones((2, 3, 4), F32)
    x[0] = 2
    z = x.copy()
    bits = np.zeros(3, np.uint8)
    f, b = bngrad.batch_norm_relu_forward, bngrad.batch_norm_relu_backward
    shifted = np.zeros(x.size + 1, F32)  # y and out one element apart: they overlap
    y_part, out_part = shifted[1:].reshape(x.shape), shifted[:-1].reshape(x.shape)
    raw = np.zeros(x.nbytes, np.uint8)  # mask bits in out's first bytes
    return [
        ("out: overlaps output without", ValueError, lambda: b(x, x, output=y_part, out=out_part)),
        ("out: overlaps relu_mask without being the same array; pass a separate", ValueError,
         lambda: b(x, x, relu_mask=raw[:3], out=raw.view(F32).reshape(x.shape))),
        ("activation", ValueError, lambda: f(x, activation="gelu")),
        ("mask_format", ValueError, lambda: f(x, mask_format="bit")),
        ("side_input: expected the shape", ValueError, lambda: f(x, side_input=x[:1])),
        ("side_input: expected the dtype", TypeError,
         lambda: f(x, side_input=x.astype(np.float64))),
        (r"out: overlaps side_input; pass a separate buffer \(or input itself\)", ValueError,
         lambda: f(x, side_input=z, out=z)),
        # side_input is input: input itself is no way out (it said so)
        ("out: overlaps side_input; pass a separate buffer$", ValueError,
         lambda: f(x, side_input=x, out=x)),
        ("weight", ValueError, lambda: f(x, np.ones(2, F32))),
        ("output_mask: expected four", ValueError,
         lambda: b(x, x, output_mask=(True,) * 3, relu_mask=bits)),
        ("exactly one", ValueError, lambda: b(x, x)),
        ("exactly one", ValueError, lambda: b(x, x, output=x, relu_mask=bits)),
        ("expected neither", ValueError, lambda: b(x, x, activation="none", relu_mask=bits)),
        ("relu_mask: a uint8 mask", ValueError, lambda: b(x, x, relu_mask=np.zeros(4, np.uint8))),
        ("relu_mask: a bool mask", ValueError,
         lambda: b(x, x, relu_mask=np.zeros((2, 3), bool))),
        ("relu_mask: expected uint8", TypeError,
         lambda: b(x, x, relu_mask=np.zeros(3, np.int8))),
        ("relu_mask: expected a NumPy array", TypeError, lambda: b(x, x, relu_mask=[1, 2, 3])),
        ("relu_mask: .* got a masked array", TypeError,
         lambda: b(x, x, relu_mask=np.ma.array(bits, mask=True))),
        ("output: expected the shape", ValueError, lambda: b(x, x, output=x[:1])),
        ("grad_out", ValueError, lambda: b(x[:1], x, output=x)),
    ]


@pytest.mark.parametrize("index", range(len(_bad_calls())))
def test_errors_name_the_argument(index):
    words, kind, call = _bad_calls()[index]
    with pytest.raises(kind, match=words):
        call()


def test_fused_forward_after_another_of_the_same_argument_types():
    """A fused forward on the ``fused`` path, then one on ``fused_short`` with the same
    argument types, on 2 threads: the second ran the first's items where the disk cache held
    two launchers' workers of one name (kernels._launch._worker; every channel after the
    13th left unwritten at (32, 256, 14, 14))."""
    rng = np.random.default_rng(0)
    for shape in ((32, 128, 28, 28), (32, 256, 14, 14)):
        x = rng.standard_normal(shape, dtype=np.float32)
        expected = reference.batch_norm_relu_forward(x, None, None, None, None, True, 0.1,
                                                     1e-5)[0]
        for mask_format in ("bits", "bytes"):
            got = bngrad.batch_norm_relu_forward(x, num_threads=2, mask_format=mask_format)[0]
            assert_close(got, expected, what=f"{shape} {mask_format}")


def test_mask_bytes_sizes_and_refusals():
    """(Found by hostile testing.) mask_bytes(-8) returned -1, mask_bytes(8, "nib") 0, and
    mask_bytes("8") raised a bare TypeError."""
    from bngrad import fused
    assert [fused.mask_bytes(n) for n in (0, 1, 8, 9)] == [0, 1, 1, 2]
    assert fused.mask_bytes(9, "bytes") == 9 and fused.mask_bytes(9, None) == 0
    assert fused.mask_bytes(np.int64(16)) == 2
    for n, error in ((-8, bngrad.ArgumentValueError), ("8", bngrad.ArgumentTypeError),
                     (True, bngrad.ArgumentTypeError), (8.0, bngrad.ArgumentTypeError)):
        with pytest.raises(error, match="n_elements: expected an int >= 0"):
            fused.mask_bytes(n)
    with pytest.raises(bngrad.ArgumentValueError, match="mask_format: expected 'bits'"):
        fused.mask_bytes(8, "nib")
