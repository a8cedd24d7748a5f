"""Property tests (hypothesis): any shape, channel axis, layout pair, dtype, mode, weight and
output mask — bngrad agrees with bngrad.reference within the tolerance table.

Shapes include size-0 and size-1 axes; grad_out and input get independently drawn layouts;
data scale and offset vary. The forward and the reduce/elemt split are held to the same
standard.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import bngrad
from bngrad import reference
from conftest import (DTYPE_VARIANTS, LAYOUTS, MASKS, MODES, check_backward, make_case,
                      quantize)
from tolerances import assert_close, backward_scales

SETTINGS = settings(max_examples=150, deadline=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow])

VARIANT_IDS = [v.id for v in DTYPE_VARIANTS]


@st.composite
def geometry(draw):
    ndim = draw(st.integers(2, 5))
    dims = st.one_of(st.integers(1, 7), st.just(0)) if draw(st.booleans()) and \
        draw(st.integers(0, 9)) == 0 else st.integers(1, 7)
    shape = tuple(draw(dims) for _ in range(ndim))
    if np.prod(shape) > 3000:
        shape = (1,) * (ndim - 1) + (shape[-1],)
    axis = draw(st.integers(-ndim, ndim - 1))
    return shape, axis


@st.composite
def backward_case(draw):
    shape, axis = draw(geometry())
    variant = draw(st.sampled_from(VARIANT_IDS))
    mode = draw(st.sampled_from(MODES))
    with_weight = draw(st.booleans())
    mask = draw(st.sampled_from(MASKS))
    layouts = (draw(st.sampled_from(list(LAYOUTS))), draw(st.sampled_from(list(LAYOUTS))))
    eps = draw(st.sampled_from([1e-5, 1e-3, 0.1]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    case = make_case(shape, axis, variant, mode, with_weight, mask, layouts, seed=seed, eps=eps)
    scale = draw(st.sampled_from([1e-2, 1.0, 30.0]))
    if scale != 1.0:  # rescale data, keep the layouts: write into the arrays in place
        case.grad_out[...] = quantize(case.grad_out.astype(np.float64) * scale,
                                      case.grad_out.dtype)
        if mode == "train-nostats" or mode == "eval":
            case.input[...] = quantize(case.input.astype(np.float64) * scale, case.input.dtype)
    return case


@SETTINGS
@given(case=backward_case())
def test_backward_property(case):
    check_backward(case)


@SETTINGS
@given(geom=geometry(), variant=st.sampled_from(VARIANT_IDS), train=st.booleans(),
       affine=st.booleans(), layout=st.sampled_from(list(LAYOUTS)),
       momentum=st.sampled_from([0.0, 0.1, 0.9]), seed=st.integers(0, 2 ** 32 - 1))
def test_forward_property(geom, variant, train, affine, layout, momentum, seed):
    from test_forward import check_forward, make_forward_case
    shape, axis = geom
    x, w, b, rm, rv = make_forward_case(shape, axis, variant, affine, True, layout, seed=seed)
    count = x.size // x.shape[axis] if x.shape[axis] else 0
    if train and count == 0:
        return  # no batch statistics to check (covered by test_forward's zero-size tests)
    check_forward(x, w, b, rm, rv, train, momentum=momentum, axis=axis)


@SETTINGS
@given(geom=geometry(), variant=st.sampled_from(VARIANT_IDS), with_weight=st.booleans(),
       layouts=st.tuples(st.sampled_from(list(LAYOUTS)), st.sampled_from(list(LAYOUTS))),
       seed=st.integers(0, 2 ** 32 - 1))
def test_reduce_elemt_property(geom, variant, with_weight, layouts, seed):
    shape, axis = geom
    case = make_case(shape, axis, variant, "train", with_weight, layouts=layouts, seed=seed)
    args = (case.grad_out, case.input, case.save_mean, case.save_invstd, case.weight)
    got = bngrad.batch_norm_backward_reduce(*args, channel_axis=axis)
    ref = reference.batch_norm_backward_reduce(*args, channel_axis=axis)
    scales = backward_scales(*args[:2], case.weight, case.save_mean, case.save_invstd, axis)
    for name, g, r in zip(("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), got, ref):
        assert_close(g, r, g.dtype, name, scale=scales[name])
    count = case.input.size // case.input.shape[axis] if case.input.shape[axis] else 0
    if count == 0:
        return  # elemt needs a positive count (tested in test_errors)
    s_dy, s_dy_xmu = ref[0].astype(case.save_mean.dtype), ref[1].astype(case.save_mean.dtype)
    gi = bngrad.batch_norm_backward_elemt(*args, s_dy, s_dy_xmu, count, channel_axis=axis)
    expected = reference.batch_norm_backward_elemt(*args, s_dy, s_dy_xmu, count,
                                                   channel_axis=axis)
    assert gi.dtype == case.input.dtype and gi.shape == case.input.shape
    assert_close(gi, expected, gi.dtype, "grad_input", scale=scales["grad_input"])
