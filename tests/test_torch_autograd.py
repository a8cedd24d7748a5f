"""bngrad.torch.batch_norm: values against bngrad.reference, gradients by finite differences
(gradcheck / gradgradcheck, float64, up to third order), layouts, dtypes, fallback, errors."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch.autograd import gradcheck, gradgradcheck  # noqa: E402

import bngrad  # noqa: E402
import bngrad.torch as bt  # noqa: E402
from bngrad import reference  # noqa: E402
from bngrad.torch import _convert, _eager, functional  # noqa: E402
from conftest import DTYPE_VARIANTS, from_torch  # noqa: E402
from tolerances import assert_close, backward_scales  # noqa: E402

SHAPES = {2: (6, 3), 3: (3, 2, 4), 4: (2, 3, 3, 2), 5: (2, 2, 2, 3, 2)}


def _layout(t, layout):
    """``t`` with the same values in the named memory layout (channels_last: C innermost)."""
    if layout == "contig":
        return t.contiguous()
    # channels innermost, for any ndim: permute to (N, ..., C), make dense, permute back
    perm = [0] + list(range(2, t.dim())) + [1]
    inv = [perm.index(i) for i in range(t.dim())]
    return t.permute(perm).contiguous().permute(inv)


def _inputs(shape, dtype=torch.float64, param_dtype=None, with_weight=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    param_dtype = param_dtype or dtype
    c = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 + 0.3).to(dtype)
    w = ((torch.rand(c, generator=g, dtype=torch.float64) * 2 - 0.5).to(param_dtype)
         if with_weight else None)
    b = torch.randn(c, generator=g, dtype=torch.float64).to(param_dtype) if with_weight else None
    rm = (torch.randn(c, generator=g, dtype=torch.float64) * 0.3).to(param_dtype)
    rv = (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(param_dtype)
    return x, w, b, rm, rv


# --- finite-difference checks, float64 -------------------------------------------------------

GRAD_CASES = [(nd, layout) for nd in (2, 3, 4, 5) for layout in ("contig", "chlast")
              if nd > 2 or layout == "contig"]


@pytest.fixture(params=["eager", "op"])
def path(request, monkeypatch):
    """Run bt.batch_norm on its eager path, or on the custom ops as traced code does."""
    if request.param == "op":
        monkeypatch.setattr(_eager, "applies", lambda input: False)
    return request.param


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
@pytest.mark.parametrize("ndim,layout", GRAD_CASES, ids=[f"{n}d-{lay}" for n, lay in GRAD_CASES])
def test_gradcheck_and_gradgradcheck(ndim, layout, with_weight, train, path):
    x, w, b, rm, rv = _inputs(SHAPES[ndim], with_weight=with_weight)
    x = _layout(x, layout).requires_grad_()
    params = [t.requires_grad_() for t in (w, b) if t is not None]

    def f(x, *wb):
        weight, bias = wb if wb else (None, None)
        return bt.batch_norm(x, rm.clone(), rv.clone(), weight, bias, train, 0.1, 1e-5)

    assert gradcheck(f, (x, *params))
    assert gradgradcheck(f, (x, *params))


def _third_order_fn(impl, train, with_weight):
    """(x, [w, b]) -> first derivatives of <v, bn(x)>, as a differentiable function."""
    x, w, b, rm, rv = _inputs((3, 2, 3), with_weight=with_weight, seed=1)
    v = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    inputs = [x.requires_grad_()] + [t.requires_grad_() for t in (w, b) if t is not None]

    def first(x, *wb):
        weight, bias = wb if wb else (None, None)
        y = impl(x, rm.clone(), rv.clone(), weight, bias, train, 0.1, 1e-5)
        return torch.autograd.grad((y * v).sum(), (x, *wb), create_graph=True)

    return first, tuple(inputs)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "noweight"])
def test_third_order_is_exact(train, with_weight, path):
    # gradgradcheck of a first derivative checks the third derivative of batch norm.
    first, inputs = _third_order_fn(bt.batch_norm, train, with_weight)
    assert gradgradcheck(first, inputs)


def _bngrad_ops_called(fn) -> set:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("bngrad::")}


def test_eager_calls_skip_the_custom_ops_unless_differentiated_twice():
    x, w, b, rm, rv = _inputs((4, 3, 5, 5))
    x.requires_grad_()
    w.requires_grad_()

    def first_order():
        bt.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5).square().sum().backward()

    def second_order():
        y = bt.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
        (gx,) = torch.autograd.grad(y.square().sum(), (x,), create_graph=True)
        gx.sum().backward()

    assert _bngrad_ops_called(first_order) == set()
    assert "bngrad::batch_norm_forward" in _bngrad_ops_called(second_order)


def test_third_order_check_detects_pytorchs_error():
    # The check above can fail: PyTorch's batch norm treats the saved statistics as constants
    # in its double backward, so its third derivative in train mode is wrong.
    first, inputs = _third_order_fn(F.batch_norm, True, True)
    assert not gradgradcheck(first, inputs, raise_exception=False)


# --- values against the float64 reference, every dtype --------------------------------------

#: dtype variant id -> (data dtype, parameter dtype), as torch dtypes
DTYPES = {v.id: (_convert.torch_dtype(v.data), _convert.torch_dtype(v.param))
          for v in DTYPE_VARIANTS}


def _np64(t):
    return None if t is None else from_torch(t).astype(np.float64)


@pytest.mark.parametrize("layout", ["contig", "chlast"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", list(DTYPES))
def test_forward_and_backward_match_reference(variant, train, layout):
    dtype, pdtype = DTYPES[variant]
    x, w, b, rm, rv = _inputs((4, 3, 5, 6), dtype, pdtype, seed=3)
    x = _layout(x, layout)
    dy = _layout(torch.randn(x.shape, generator=torch.Generator().manual_seed(4),
                             dtype=torch.float64).to(dtype), layout)
    rm0, rv0 = rm.clone(), rv.clone()
    xg, wg, bg = x.clone().requires_grad_(), w.clone().requires_grad_(), b.clone().requires_grad_()

    y = bt.batch_norm(xg, rm, rv, wg, bg, train, 0.1, 1e-5)
    y.backward(dy)

    ref_y, mean, invstd, ref_rm, ref_rv = reference.batch_norm_forward(
        _np64(x), _np64(w), _np64(b), _np64(rm0), _np64(rv0), train, 0.1, 1e-5)
    assert y.dtype == dtype and xg.grad.dtype == dtype and wg.grad.dtype == pdtype
    memory_format = torch.channels_last if layout == "chlast" else torch.contiguous_format
    assert y.is_contiguous(memory_format=memory_format), y.stride()
    assert xg.grad.is_contiguous(memory_format=memory_format), xg.grad.stride()
    assert_close(from_torch(y), ref_y, what="output")
    if train:
        assert_close(from_torch(rm), ref_rm, what="running_mean")
        assert_close(from_torch(rv), ref_rv, what="running_var")
    else:
        assert torch.equal(rm, rm0) and torch.equal(rv, rv0)
        mean, invstd = _np64(rm0), 1.0 / np.sqrt(_np64(rv0) + 1e-5)
    gi, gw, gb = reference.batch_norm_backward(
        _np64(dy), _np64(x), _np64(w), _np64(rm0), _np64(rv0), None, None, train, 1e-5)
    scales = backward_scales(_np64(dy), _np64(x), _np64(w), mean, invstd)
    assert_close(from_torch(xg.grad), gi, what="grad_input", scale=scales["grad_input"])
    assert_close(from_torch(wg.grad), gw, what="grad_weight", scale=scales["grad_weight"])
    assert_close(from_torch(bg.grad), gb, what="grad_bias", scale=scales["grad_bias"])


def test_second_forward_before_backward():
    # A module applied twice (siamese nets, GAN discriminators) updates its running stats in
    # between; the first backward must still work and be right.
    x1, w, b, rm, rv = _inputs((5, 3, 4))
    x2 = torch.randn_like(x1)
    w.requires_grad_()
    x1.requires_grad_()
    x2.requires_grad_()
    v = torch.randn((2,) + tuple(x1.shape), dtype=torch.float64)
    ours = [bt.batch_norm(x, rm, rv, w, b, True) for x in (x1, x2)]
    sum((o * vi).sum() for o, vi in zip(ours, v)).backward()
    got = [x1.grad.clone(), x2.grad.clone(), w.grad.clone()]
    for t in (x1, x2, w):
        t.grad = None
    _, _, _, rm2, rv2 = _inputs((5, 3, 4))
    theirs = [F.batch_norm(x, rm2, rv2, w, b, True) for x in (x1, x2)]
    sum((o * vi).sum() for o, vi in zip(theirs, v)).backward()
    for a, e in zip(got, [x1.grad, x2.grad, w.grad]):
        assert_close(a.numpy(), e.numpy(), factor=2)
    assert_close(rm.numpy(), rm2.numpy(), factor=2)
    assert_close(rv.numpy(), rv2.numpy(), factor=2)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("changed", ["input", "weight", "running_var"])
def test_a_tensor_changed_in_place_before_the_backward_is_refused_as_pytorch_does(train, changed):
    """The backward reads the forward's NumPy views of the saved tensors; a saved tensor
    modified in place in between is refused by autograd's version check, as in PyTorch. (The
    running statistics, which the training backward does not read, are not saved in training:
    changing them then is no error, where PyTorch refuses it.)"""
    def run(fn, change: bool):
        x, w, b, rm, rv = _inputs((4, 3, 5))
        x.requires_grad_()
        w.requires_grad_()
        saved_x = x * 1.0  # the input the batch norm saves (x itself is a leaf)
        y = fn(saved_x, rm, rv, w, b, train)
        if change:
            with torch.no_grad():
                {"input": saved_x, "weight": w, "running_var": rv}[changed].mul_(2.0)
        try:
            y.backward(torch.ones_like(y).cumsum(0))
        except RuntimeError as exc:
            assert "modified by an inplace operation" in str(exc)
            return None
        return x.grad, w.grad

    refused = run(F.batch_norm, True) is None
    assert refused
    if train and changed == "running_var":
        assert all(torch.equal(a, e) for a, e in zip(run(bt.batch_norm, True),
                                                       run(bt.batch_norm, False)))
    else:
        assert run(bt.batch_norm, True) is None


# --- zero-copy conversion ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16],
                         ids=str)
def test_convert_is_zero_copy_and_keeps_strides(dtype):
    t = torch.randn(2, 3, 4, 5).to(dtype).to(memory_format=torch.channels_last)[:, :, 1:]
    t.requires_grad_()
    a = _convert.to_numpy(t)
    assert a.ctypes.data == t.data_ptr()
    assert a.shape == tuple(t.shape)
    assert a.strides == tuple(s * t.element_size() for s in t.stride())
    back = _convert.from_numpy(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr() and back.stride() == t.stride()
    assert torch.equal(back, t.detach())


def test_convert_rejects_unsupported_tensors():
    with pytest.raises(TypeError, match="input must be float64, float32, float16 or "
                                        "bfloat16, got torch.int32"):
        _convert.to_numpy(torch.zeros(2, 3, dtype=torch.int32), "input")
    with pytest.raises(ValueError, match="weight must be a CPU tensor"):
        _convert.to_numpy(torch.zeros(3, device="meta"), "weight")
    with pytest.raises(TypeError, match="must be a torch.Tensor, got list"):
        _convert.to_numpy([1.0], "bias")


# --- non-CPU fallback -------------------------------------------------------------------------

def test_non_cpu_tensors_fall_back_to_pytorch_with_one_warning(monkeypatch):
    # No GPU here: pretend the CPU tensor is on an unsupported device.
    monkeypatch.setattr(functional, "is_supported_device", lambda t: False)
    monkeypatch.setattr(functional, "_warned_fallback", False)

    def must_not_run(*args, **kwargs):
        raise AssertionError("bngrad's kernels ran on an unsupported device")

    monkeypatch.setattr(bngrad, "batch_norm_forward", must_not_run)
    x, w, b, rm, rv = _inputs((4, 3, 5))
    rm2, rv2 = rm.clone(), rv.clone()
    with pytest.warns(RuntimeWarning, match="CPU tensors only.*PyTorch's own"):
        y = bt.batch_norm(x, rm, rv, w, b, True)
    assert torch.equal(y, F.batch_norm(x, rm2, rv2, w, b, True))
    assert torch.equal(rm, rm2) and torch.equal(rv, rv2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bt.batch_norm(x, rm, rv, w, b, False)  # no second warning


# --- errors -----------------------------------------------------------------------------------

def test_errors_match_pytorch_where_pytorch_checks():
    x = torch.randn(1, 3)
    with pytest.raises(ValueError) as ours:
        bt.batch_norm(x, None, None, training=True)
    with pytest.raises(ValueError) as theirs:
        F.batch_norm(x, None, None, training=True)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("fn", [bt.batch_norm, bt.batch_norm_relu],
                         ids=["batch_norm", "batch_norm_relu"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_argument_checks_match_pytorch(training, fn):
    """One running statistic without the other in training, a running statistic that requires
    grad and momentum=None: PyTorch's exception types and messages (bngrad accepted the first
    two silently, and dropped the second's gradient; eval mode's missing statistics:
    test_errors_name_the_argument)."""
    x = torch.randn(4, 3) + 5
    cases = [(torch.zeros(3), None, 0.1), (None, torch.ones(3), 0.1)] if training else []
    cases += [(torch.zeros(3).requires_grad_(), torch.ones(3), 0.1),
             (torch.zeros(3), torch.ones(3).requires_grad_(), 0.1),
             (torch.zeros(3), torch.ones(3), None)]
    for rm, rv, momentum in cases:
        with pytest.raises(Exception) as theirs:
            F.batch_norm(x, rm, rv, None, None, training, momentum)
        with pytest.raises(type(theirs.value)) as ours:
            fn(x, rm, rv, None, None, training, momentum)
        assert str(ours.value) == str(theirs.value)
        if rm is not None and rm.requires_grad:  # no check where no graph is made
            with torch.no_grad():
                fn(x, rm, rv, None, None, training, 0.1)


def test_add_relu_needs_a_side_input():
    with pytest.raises(TypeError, match="'side_input' must be Tensor, not NoneType"):
        bt.batch_norm_add_relu(torch.randn(4, 3), None, None, None, training=True)


def test_errors_name_the_argument():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="running_mean"):
        bt.batch_norm(x, None, None, training=False)
    with pytest.raises(ValueError, match=r"input has 3 channels.*weight has shape \(4,\)"):
        bt.batch_norm(x, None, None, torch.ones(4), training=True)
    with pytest.raises(TypeError, match="input must be float64"):
        bt.batch_norm(torch.ones(4, 3, dtype=torch.int64), None, None, training=True)
    with pytest.raises(TypeError, match="'input' must be Tensor"):
        bt.batch_norm(np.ones((4, 3)), None, None, training=True)


@pytest.mark.parametrize("path", ["eager", "op"], indirect=True)
@pytest.mark.parametrize("eps", [0.0, -1e-5, -1.0])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_eps_checks_match_pytorch(training, eps, path):
    x, w, b, rm, rv = _inputs((4, 3, 2))
    x[:, 0] = 2.5  # a constant channel: eps = 0 in training would divide by zero
    try:
        expected = F.batch_norm(x, rm.clone(), rv.clone(), w, b, training, 0.1, eps)
    except ValueError as exc:
        with pytest.raises(ValueError) as ours:
            bt.batch_norm(x, rm, rv, w, b, training, 0.1, eps)
        assert str(ours.value) == str(exc)
    else:  # eval mode with eps = 0 is allowed, as in PyTorch
        assert eps == 0.0 and not training
        assert torch.allclose(bt.batch_norm(x, rm, rv, w, b, training, 0.1, eps), expected)


@pytest.mark.parametrize("path", ["eager", "op"], indirect=True)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_empty_1d_input_matches_pytorch(training, affine, path):
    def run(fn):
        x = torch.randn(0, dtype=torch.float64, requires_grad=True)
        w = torch.rand(3, dtype=torch.float64, requires_grad=True) if affine else None
        b = torch.rand(3, dtype=torch.float64, requires_grad=True) if affine else None
        rm, rv = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
        y = fn(x, rm, rv, w, b, training)
        y.sum().backward()
        return y, x.grad, None if w is None else w.grad, None if b is None else b.grad, rm, rv

    ours, theirs = run(bt.batch_norm), run(F.batch_norm)
    for name, a, e in zip(["output", "grad_input", "grad_weight", "grad_bias", "running_mean",
                           "running_var"], ours, theirs):
        if e is None:
            assert a is None, name
        else:
            assert a.shape == e.shape and a.dtype == e.dtype and torch.equal(a, e), name


@pytest.mark.parametrize("path", ["eager", "op"], indirect=True)
def test_errors_speak_pytorch(path):
    x = torch.randn(2, 7, 3)
    with pytest.raises(ValueError, match=re.escape(
            "input has 7 channels (dimension 1 of shape (2, 7, 3)), but weight has shape (8,)")):
        bt.batch_norm(x, torch.zeros(7), torch.ones(7), torch.ones(8), None, True)
    with pytest.raises(ValueError, match=re.escape("but running_mean has shape (8,)")):
        bt.batch_norm(x, torch.zeros(8), torch.ones(8), None, None, False)
    with pytest.raises(TypeError) as raised:
        bt.batch_norm(x, torch.zeros(7), torch.ones(7), torch.ones(7),
                      torch.zeros(7, dtype=torch.float64), True)
    assert str(raised.value) == (
        "bias has dtype torch.float64 but input has dtype torch.float32; convert one of them: "
        "bias.to(torch.float32) or input.to(torch.float64)")
    with pytest.raises(TypeError) as raised:  # (no int64 input: one way only; hostile testing)
        bt.batch_norm(x, torch.zeros(7, dtype=torch.int64), torch.ones(7), None, None, True)
    assert str(raised.value) == ("running_mean has dtype torch.int64 but input has dtype "
                                 "torch.float32; convert it: running_mean.to(torch.float32)")
