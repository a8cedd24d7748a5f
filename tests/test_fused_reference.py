"""bngrad.reference's fused batch norm (+ side input, + ReLU): against a composition of the
reference's own batch-norm functions, and against PyTorch's unfused sequence (F.batch_norm,
add, relu) under autograd, in float64."""

from __future__ import annotations

import numpy as np
import pytest

from bngrad import reference
from tolerances import assert_close

SHAPES = [(4, 3), (3, 4, 5), (2, 3, 4, 5)]


def _data(shape, seed, channel_axis=1):
    rng = np.random.default_rng(seed)
    c = shape[channel_axis]
    x = rng.standard_normal(shape) * 1.5 + 0.3
    z = rng.standard_normal(shape)
    dy = rng.standard_normal(shape)
    w, b = rng.uniform(-1.5, 1.5, c), rng.standard_normal(c) * 0.5
    rm, rv = rng.standard_normal(c) * 0.3, rng.uniform(0.5, 2.0, c)
    return x, z, dy, w, b, rm, rv


@pytest.mark.parametrize("activation", ["relu", "none"])
@pytest.mark.parametrize("with_side", [True, False], ids=["side", "noside"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("channel_axis", [1, -1])
def test_reference_is_the_composition(channel_axis, train, with_side, activation):
    x, z, dy, w, b, rm, rv = _data((3, 4, 5), 1, channel_axis)
    z = z if with_side else None
    out, mean, invstd, new_rm, new_rv, mask = reference.batch_norm_relu_forward(
        x, w, b, rm, rv, train, 0.2, 1e-3, side_input=z, activation=activation,
        channel_axis=channel_axis)
    bn, mean2, invstd2, rm2, rv2 = reference.batch_norm_forward(
        x, w, b, rm, rv, train, 0.2, 1e-3, channel_axis=channel_axis)
    pre = bn + (0 if z is None else z)
    expected = np.maximum(pre, 0) if activation == "relu" else pre
    np.testing.assert_array_equal(out, expected)
    for got, want in ((mean, mean2), (invstd, invstd2), (new_rm, rm2), (new_rv, rv2)):
        np.testing.assert_array_equal(got, want)
    if activation == "relu":
        np.testing.assert_array_equal(mask, pre > 0)
    else:
        assert mask is None

    g = dy * (pre > 0) if activation == "relu" else dy
    gi, gw, gb = reference.batch_norm_backward(g, x, w, rm, rv, mean, invstd, train, 1e-3,
                                               channel_axis=channel_axis)
    forms = [{"output": out}, {"relu_mask": mask}] if activation == "relu" else [{}]
    for form in forms:
        got = reference.batch_norm_relu_backward(dy, x, w, rm, rv, mean, invstd, train, 1e-3,
                                                 activation=activation,
                                                 channel_axis=channel_axis, **form)
        for name, a, e in zip(("grad_input", "grad_weight", "grad_bias", "grad_side_input"),
                              got, (gi, gw, gb, g)):
            np.testing.assert_array_equal(a, e, err_msg=name)


def test_reference_output_mask_leaves_out_what_is_not_asked():
    x, z, dy, w, b, rm, rv = _data((3, 4), 2)
    out, mean, invstd, *_ = reference.batch_norm_relu_forward(x, w, b, side_input=z)
    for mask in [(True, False, True, False), (False, True, False, True)]:
        got = reference.batch_norm_relu_backward(dy, x, w, None, None, mean, invstd,
                                                 output_mask=mask, output=out)
        assert [g is not None for g in got] == list(mask)


# --------------------------------------------------------------------------- PyTorch

def _torch_unfused(x, z, dy, w, b, rm, rv, train, activation, momentum=0.1, eps=1e-5):
    """PyTorch's sequence under autograd: output, running stats, grads of x, w, b, z."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    t = {k: None if v is None else torch.from_numpy(v.copy())
         for k, v in dict(x=x, z=z, w=w, b=b, rm=rm, rv=rv).items()}
    for k in ("x", "w", "b", "z"):
        if t[k] is not None:
            t[k].requires_grad_()
    y = F.batch_norm(t["x"], t["rm"], t["rv"], t["w"], t["b"], train, momentum, eps)
    if t["z"] is not None:
        y = y + t["z"]
    if activation == "relu":
        y = F.relu(y)
    y.backward(torch.from_numpy(dy))
    grads = {k: (t[k].grad.numpy() if t[k] is not None else None) for k in ("x", "w", "b", "z")}
    return (y.detach().numpy(), t["rm"].numpy(), t["rv"].numpy(), grads)


@pytest.mark.parametrize("activation", ["relu", "none"])
@pytest.mark.parametrize("with_side", [True, False], ids=["side", "noside"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["w", "now"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_matches_torch(shape, train, with_weight, with_side, activation):
    x, z, dy, w, b, rm, rv = _data(shape, 3)
    z = z if with_side else None
    w, b = (w, b) if with_weight else (None, None)
    t_out, t_rm, t_rv, t_grads = _torch_unfused(x, z, dy, w, b, rm, rv, train, activation)
    out, mean, invstd, new_rm, new_rv, mask = reference.batch_norm_relu_forward(
        x, w, b, rm, rv, train, 0.1, 1e-5, side_input=z, activation=activation)
    assert_close(out, t_out, np.float64, "output")
    if train:
        assert_close(new_rm, t_rm, np.float64, "running_mean")
        assert_close(new_rv, t_rv, np.float64, "running_var")
    forms = [{"output": out}, {"relu_mask": mask}] if activation == "relu" else [{}]
    for form in forms:
        got = reference.batch_norm_relu_backward(dy, x, w, rm, rv, mean, invstd, train, 1e-5,
                                                 activation=activation, **form)
        for name, a, key in zip(("grad_input", "grad_weight", "grad_bias", "grad_side_input"),
                                got, ("x", "w", "b", "z")):
            if t_grads[key] is not None:
                assert_close(a, t_grads[key], np.float64, f"{name} ({list(form)})",
                             scale=np.abs(t_grads[key]).max() + 1.0)


def test_reference_ties_at_zero_give_zero_gradient_as_torch():
    """Where the ReLU's input is exactly 0, the gradient is 0 (threshold_backward: y <= 0)."""
    # eval with mean 0, var 1, eps 0, w 1, b 0: batch norm is the identity, exactly.
    x = np.array([[0.0, 1.0], [-2.0, 0.0], [3.0, 0.5], [0.0, -1.0]])
    z = np.array([[1.0, -1.0], [2.0, 0.0], [-3.0, 0.0], [0.0, 1.0]])   # x + z = 0 at 4 places
    dy = np.arange(1.0, 9.0).reshape(4, 2)
    rm, rv = np.zeros(2), np.ones(2)
    for side in (None, z):
        pre = x + (0 if side is None else side)
        assert (pre == 0).sum() >= 3
        t_out, _, _, t_grads = _torch_unfused(x, side, dy, None, None, rm, rv, False, "relu",
                                              eps=0.0)
        out, *_, mask = reference.batch_norm_relu_forward(
            x, None, None, rm, rv, False, 0.1, 0.0, side_input=side)
        np.testing.assert_array_equal(out, t_out)
        for form in ({"output": out}, {"relu_mask": mask}):
            gi, _, _, gz = reference.batch_norm_relu_backward(dy, x, None, rm, rv, None, None,
                                                              False, 0.0, **form)
            np.testing.assert_array_equal(gi, np.where(pre > 0, dy, 0.0))
            np.testing.assert_array_equal(gi, t_grads["x"])
            if side is not None:
                np.testing.assert_array_equal(gz, t_grads["z"])
