"""bngrad.torch's fused batch norm + ReLU and batch norm + add + ReLU: the custom ops
(opcheck), gradients by finite differences (gradcheck / gradgradcheck, float64, eager and op
paths), values against PyTorch's unfused sequence (BatchNorm*d, add, ReLU under autograd),
modules' state, and what autograd keeps for the backward."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.autograd import gradcheck, gradgradcheck  # noqa: E402

import bngrad.torch as bt  # noqa: E402
from bngrad.errors import ArgumentTypeError, ArgumentValueError  # noqa: E402
from bngrad.torch import _eager  # noqa: E402
from conftest import from_torch  # noqa: E402
from tolerances import assert_close  # noqa: E402


def _t(shape, dtype=torch.float64, seed=0, shift=0.2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) + shift).to(dtype)


def _chlast(t):
    perm = [0] + list(range(2, t.dim())) + [1]
    return t.permute(perm).contiguous().permute([perm.index(i) for i in range(t.dim())])


# --- custom ops: schema, fake implementations, autograd registration --------------------------

def _forward_samples():
    x = _t((3, 4, 2, 5), torch.float32).requires_grad_()
    w, b = _t(4, torch.float32, 1).requires_grad_(), _t(4, torch.float32, 2).requires_grad_()
    rm, rv = _t(4, torch.float32, 3), _t(4, torch.float32, 4).abs() + 0.5
    z = _chlast(_t((3, 4, 2, 5), torch.float32, 5)).requires_grad_()
    yield "float32-train-side", (_chlast(x.detach()).requires_grad_(), w, b, rm, rv, z, True,
                                 0.1, 1e-5, "relu")
    xb = _t((3, 4, 5), torch.bfloat16, 6).requires_grad_()
    yield "bfloat16-p32-eval", (xb, w, b, rm, rv, None, False, 0.1, 1e-5, "relu")
    yield "float64-noparams-none", (_t((5, 3), seed=7).requires_grad_(), None, None, None, None,
                                    _t((5, 3), seed=8).requires_grad_(), True, 0.1, 1e-5, "none")


def _backward_samples():
    x, dy = _t((3, 4, 5), torch.float32), _t((3, 4, 5), torch.float32, 5)
    w = _t(4, torch.float32, 1)
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    invstd = torch.rsqrt(var + 1e-5)
    bits = torch.randint(0, 256, ((x.numel() + 7) // 8,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(9))
    yield "train", (dy, x, w, None, None, mean, invstd, bits, True, 1e-5, [True] * 4, "relu")
    yield "eval-noweight-mask1001", (dy, x, None, mean, var, torch.empty(0), torch.empty(0),
                                     bits, False, 1e-5, [True, False, False, True], "relu")
    yield "train-none-mask0110", (dy, x, w, None, None, mean, invstd,
                                  torch.empty(0, dtype=torch.uint8), True, 1e-5,
                                  [False, True, True, False], "none")


_FORWARD = dict(_forward_samples())
_BACKWARD = dict(_backward_samples())


@pytest.mark.parametrize("case", list(_FORWARD))
def test_opcheck_batch_norm_relu_forward(case):
    torch.library.opcheck(torch.ops.bngrad.batch_norm_relu_forward.default, _FORWARD[case])


@pytest.mark.parametrize("case", list(_BACKWARD))
def test_opcheck_batch_norm_relu_backward(case):
    torch.library.opcheck(torch.ops.bngrad.batch_norm_relu_backward.default, _BACKWARD[case])


@pytest.mark.parametrize("layout", ["contig", "chlast"])
def test_op_mask_is_the_documented_bits(layout):
    """Bit i % 8 of byte i // 8 is element i of the input's memory order (NCHW: C order;
    channels-last: N, H, W, C); unpack_mask decodes it."""
    x = _t((2, 3, 5, 3), seed=1)
    z = _t((2, 3, 5, 3), seed=2, shift=-0.5)
    if layout == "chlast":
        x, z = _chlast(x), _chlast(z)
    out, *_, mask = torch.ops.bngrad.batch_norm_relu_forward(x, None, None, None, None, z, True,
                                                             0.1, 1e-5, "relu")
    assert mask.dtype == torch.uint8 and mask.shape == ((x.numel() + 7) // 8,)
    in_memory = out.permute(0, 2, 3, 1) if layout == "chlast" else out
    flat = in_memory.reshape(-1) > 0
    for i in range(x.numel()):
        assert bool((int(mask[i // 8]) >> (i % 8)) & 1) == bool(flat[i]), i
    assert torch.equal(bt.fused.unpack_mask(mask, x), out > 0)


# --- finite differences, float64, both paths ---------------------------------------------------

@pytest.fixture(params=["eager", "op"])
def path(request, monkeypatch):
    if request.param == "op":
        monkeypatch.setattr(_eager, "applies", lambda input: False)
    return request.param


@pytest.mark.parametrize("layout", ["contig", "chlast"])
@pytest.mark.parametrize("with_side", [True, False], ids=["add-relu", "relu"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_gradcheck_and_gradgradcheck(train, with_side, layout, path):
    x = _t((3, 2, 3, 2), seed=1)
    x = (_chlast(x) if layout == "chlast" else x).requires_grad_()
    w = (_t(2, seed=2) + 0.8).requires_grad_()
    b = _t(2, seed=3).requires_grad_()
    z = _t((3, 2, 3, 2), seed=4).requires_grad_()
    rm, rv = _t(2, seed=5), _t(2, seed=6).abs() + 0.5

    def f(x, w, b, z):
        if with_side:
            return bt.batch_norm_add_relu(x, z, rm.clone(), rv.clone(), w, b, train)
        return bt.batch_norm_relu(x, rm.clone(), rv.clone(), w, b, train) + 0 * z

    assert gradcheck(f, (x, w, b, z))
    assert gradgradcheck(f, (x, w, b, z))


def test_third_order_through_the_op(path):
    x = _t((3, 2, 3), seed=1).requires_grad_()
    w, b = (_t(2, seed=2) + 0.8).requires_grad_(), _t(2, seed=3).requires_grad_()
    z = _t((3, 2, 3), seed=4)
    v = _t((3, 2, 3), seed=5)

    def first(x, w, b):
        y = bt.batch_norm_add_relu(x, z, None, None, w, b, True)
        return torch.autograd.grad((y * v).sum(), (x, w, b), create_graph=True)

    assert gradgradcheck(first, (x, w, b))


# --- against PyTorch's unfused sequence ---------------------------------------------------------

VARIANTS = {"float64": (torch.float64, torch.float64), "float32": (torch.float32, torch.float32),
            "bfloat16-p32": (torch.bfloat16, torch.float32)}


def _pair(cls, torch_cls, dtype, seed=0):
    ours, theirs = cls(4, dtype=dtype), torch_cls(4, dtype=dtype)
    with torch.no_grad():
        for m in (ours, theirs):
            m.weight.copy_(_t(4, dtype, seed) + 0.5)
            m.bias.copy_(_t(4, dtype, seed + 1))
            m.running_mean.copy_(_t(4, dtype, seed + 2) * 0.3)
            m.running_var.copy_(_t(4, dtype, seed + 3).abs() + 0.5)
    return ours, theirs


@pytest.mark.parametrize("layout", ["contig", "chlast"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("with_side", [True, False], ids=["add-relu", "relu"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_modules_match_torch_sequence(variant, with_side, train, layout, path):
    dtype, pdtype = VARIANTS[variant]
    cls = bt.BatchNormAddReLU2d if with_side else bt.BatchNormReLU2d
    ours, theirs = _pair(cls, nn.BatchNorm2d, pdtype)
    ours.train(train)
    theirs.train(train)
    x = _t((3, 4, 5, 6), dtype, 10)
    z = _t((3, 4, 5, 6), dtype, 11)
    dy = _t((3, 4, 5, 6), dtype, 12)
    if layout == "chlast":
        x, dy = _chlast(x), _chlast(dy)
    results = []
    for model in (ours, theirs):
        xi, zi = x.clone().requires_grad_(), z.clone().requires_grad_()
        if model is ours:
            y = ours(xi, zi) if with_side else ours(xi)
        else:
            y = F.relu(theirs(xi) + zi) if with_side else F.relu(theirs(xi))
        y.backward(dy)
        results.append(dict(y=y, x=xi.grad, z=zi.grad, w=model.weight.grad, b=model.bias.grad,
                            rm=model.running_mean, rv=model.running_var,
                            n=model.num_batches_tracked))
    a, e = results
    assert a["y"].dtype == dtype and a["x"].dtype == dtype
    assert a["y"].stride() == e["y"].stride()
    for key in ("y", "x", "w", "b", "rm", "rv") + (("z",) if with_side else ()):
        # both sides are approximate: twice the tolerance of the result's dtype; half results
        # are judged norm-wise (the ReLU may differ where y rounds to the other side of 0)
        assert_close(from_torch(a[key]), from_torch(e[key]), what=key, factor=2)
    if not with_side:
        assert a["z"] is None
    assert int(a["n"]) == int(e["n"]) == (1 if train else 0)


@pytest.mark.parametrize("ndim,cls,torch_cls", [
    (2, bt.BatchNormReLU1d, nn.BatchNorm1d), (3, bt.BatchNormReLU1d, nn.BatchNorm1d),
    (5, bt.BatchNormReLU3d, nn.BatchNorm3d), (3, bt.BatchNormAddReLU1d, nn.BatchNorm1d),
    (5, bt.BatchNormAddReLU3d, nn.BatchNorm3d)])
def test_1d_and_3d(ndim, cls, torch_cls):
    ours, theirs = _pair(cls, torch_cls, torch.float64)
    shape = (5, 4, 3, 2, 3)[:ndim]
    x, z = _t(shape, seed=1).requires_grad_(), _t(shape, seed=2)
    add = "Add" in cls.__name__
    y = ours(x, z) if add else ours(x)
    expected = F.relu(theirs(x) + z) if add else F.relu(theirs(x))
    assert_close(y.detach().numpy(), expected.detach().numpy(), what="output")
    bad = _t((2, 4, 3) if ndim == 5 else (2, 4, 3, 3))   # PyTorch's input-dimension check
    with pytest.raises(ValueError, match="expected .*D input"):
        ours(bad, bad) if add else ours(bad)


def test_modules_have_batch_norm_state():
    plain = nn.BatchNorm2d(4)
    with torch.no_grad():
        plain.running_mean.add_(1.5)
        plain.weight.mul_(2)
    for cls in (bt.BatchNormReLU2d, bt.BatchNormAddReLU2d):
        fused = cls(4)
        assert list(fused.state_dict()) == list(plain.state_dict())
        fused.load_state_dict(plain.state_dict())
        assert torch.equal(fused.running_mean, plain.running_mean)
        assert not isinstance(fused, nn.BatchNorm2d)   # it is not one: it also applies a ReLU
        assert repr(fused).startswith(f"bngrad.torch.{cls.__name__}(4, eps=1e-05")


def test_autograd_keeps_input_and_one_bit_mask_not_the_output(path):
    """What stays alive for the backward: x and weights as tensors, plus (eager) the 1-bit
    mask and the statistics as NumPy arrays, or (op) the mask as a uint8 tensor."""
    x = _t((4, 8, 6, 6), torch.float32).requires_grad_()
    z = _t((4, 8, 6, 6), torch.float32, 1).requires_grad_()
    w, b = torch.ones(8, requires_grad=True), torch.zeros(8, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = bt.batch_norm_add_relu(x, z, None, None, w, b, True)
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()
    masks = [t for t in saved if t.dtype == torch.uint8]
    assert sum(t.numel() for t in masks) <= x.numel() // 8
    y.sum().backward()
    assert x.grad is not None and z.grad is not None


def test_compile_and_export_trace_the_ops():
    m = bt.BatchNormAddReLU2d(4)
    x, z = _t((2, 4, 3, 3), torch.float32).requires_grad_(), _t((2, 4, 3, 3), torch.float32, 1)
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    y = compiled(x, z)
    y.sum().backward()
    m2 = bt.BatchNormAddReLU2d(4)
    expected = m2(x.detach(), z)
    assert_close(y.detach().numpy(), expected.detach().numpy(), what="compiled output")
    assert torch.equal(m.running_mean, m2.running_mean)
    exported = torch.export.export(bt.BatchNormReLU2d(4).eval(), (x.detach(),))
    assert "bngrad.batch_norm_relu_forward" in str(exported.graph)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_differentiable_backward_gives_the_same_first_derivatives(train, path):
    """With create_graph=True the backward is another graph (gradgradcheck differentiates it,
    but cannot see whether it starts from the right first derivative): compare with PyTorch."""
    x = _t((3, 2, 4), seed=1).requires_grad_()
    w, b = (_t(2, seed=2) + 0.8).requires_grad_(), _t(2, seed=3).requires_grad_()
    z = _t((3, 2, 4), seed=4).requires_grad_()
    rm, rv = _t(2, seed=5), _t(2, seed=6).abs() + 0.5
    v = _t((3, 2, 4), seed=7)
    y = bt.batch_norm_add_relu(x, z, rm.clone(), rv.clone(), w, b, train)
    ours = torch.autograd.grad((y * v).sum(), (x, w, b, z), create_graph=True)
    y2 = F.relu(F.batch_norm(x, rm.clone(), rv.clone(), w, b, train) + z)
    theirs = torch.autograd.grad((y2 * v).sum(), (x, w, b, z))
    assert (y2 <= 0).any() and (y2 > 0).any()
    for name, a, e in zip("xwbz", ours, theirs):
        assert_close(a.detach().numpy(), e.numpy(), what=f"grad {name}", factor=2)


@pytest.mark.parametrize("with_side", [True, False], ids=["add-relu", "relu"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_second_derivatives_are_defined_where_pytorchs_are(train, with_side, path):
    """Each first derivative of the fused forms, taken with create_graph=True, differentiated
    again with respect to input, weight and bias: defined where PyTorch's unfused sequence's
    is, with its value. The ReLU's masked gradient depends on the forward's output with a zero
    derivative (threshold_backward), so PyTorch gives 0 where the batch norm alone would not
    connect them (eval mode's grad_input and input; grad_weight and weight); bngrad raised
    that the tensor was not used in the graph. (Not the side input: the fused forms do not
    keep it for the backward; docs/torch.md.)"""
    x = _t((3, 2, 4), seed=1).requires_grad_()
    w, b = (_t(2, seed=2) + 0.8).requires_grad_(), _t(2, seed=3).requires_grad_()
    z = _t((3, 2, 4), seed=4).requires_grad_()
    rm, rv = _t(2, seed=5), _t(2, seed=6).abs() + 0.5
    v = _t((3, 2, 4), seed=7)
    side = z if with_side else torch.zeros_like(z)

    def second(y):
        """Second derivatives (i, j) and, by key (i, j, j), the third with respect to the
        same tensor again (a derivative made of the ReLU's zero alone must stay in the
        graph too: it raised "does not require grad")."""
        firsts = torch.autograd.grad((y * v).sum(), (x, w, b), create_graph=True)
        results = {}
        for i, first in enumerate(firsts):
            for j, t in enumerate((x, w, b)):
                try:
                    results[i, j] = torch.autograd.grad((first * first).sum(), t,
                                                        create_graph=True)[0]
                    results[i, j, j] = torch.autograd.grad((results[i, j] * v[0, 0, 0]).sum(),
                                                           t, retain_graph=True)[0]
                except RuntimeError as error:
                    assert "not have been used in the graph" in str(error)
                    results[i, j] = None
        return results

    ours = second(bt.batch_norm_add_relu(x, side, rm.clone(), rv.clone(), w, b, train)
                  if with_side else bt.batch_norm_relu(x, rm.clone(), rv.clone(), w, b, train))
    theirs = second(F.relu(F.batch_norm(x, rm.clone(), rv.clone(), w, b, train) + side))
    assert {k for k, e in theirs.items() if e is None} == set()
    for key, expected in theirs.items():
        assert ours.get(key) is not None, f"{key} undefined (0: x, 1: weight, 2: bias)"
        if len(key) == 3 and train:  # PyTorch's third order in training is wrong (bngrad.torch.ops)
            continue
        assert_close(ours[key].detach().numpy(), expected.detach().numpy(), what=str(key),
                     factor=4)


@pytest.mark.parametrize("form", ["batch_norm", "relu", "add-relu"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_batched_grad_outputs_give_pytorchs_jacobian(form, train):
    """``jacobian(..., vectorize=True)`` runs the backward once on a batch of grad_outputs
    (``is_grads_batched``, autograd's vmap), which have no NumPy view: the eager backward
    raised "Batching rule not implemented for aten::detach" (found by hostile testing); it
    takes the torch-operation backward then, and gives PyTorch's Jacobian."""
    x = _t((3, 2, 4), seed=1).requires_grad_()
    w, b, z = _t(2, seed=2) + 0.8, _t(2, seed=3), _t((3, 2, 4), seed=4)
    rm, rv = _t(2, seed=5), _t(2, seed=6).abs() + 0.5

    def ours(x):
        if form == "batch_norm":
            return bt.batch_norm(x, rm.clone(), rv.clone(), w, b, train)
        if form == "relu":
            return bt.batch_norm_relu(x, rm.clone(), rv.clone(), w, b, train)
        return bt.batch_norm_add_relu(x, z, rm.clone(), rv.clone(), w, b, train)

    def theirs(x):
        y = F.batch_norm(x, rm.clone(), rv.clone(), w, b, train)
        return y if form == "batch_norm" else F.relu(y + z if form == "add-relu" else y)

    expected = torch.autograd.functional.jacobian(theirs, x, vectorize=True)
    got = torch.autograd.functional.jacobian(ours, x, vectorize=True)
    assert_close(got.numpy(), expected.numpy(), what="jacobian", factor=4)


# --- found by hostile testing: tracers, forward-mode AD, argument checks -----------------------

@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_make_fx_in_real_mode_traces_the_ops(fused):
    """make_fx's default (real-tensor) tracing is a dispatch mode, not a tracer the eager path
    knew: it must record the custom op, and its graph replay the module's computation (the
    eager path ran unseen, and the graph returned an uninitialised buffer)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    m = (bt.BatchNormAddReLU2d(3) if fused else bt.BatchNorm2d(3)).eval()
    m.running_mean.uniform_(-1, 1)
    z = _t((2, 3, 4, 4), torch.float32, 3)
    f = (lambda x: m(x, z)) if fused else m
    graph = make_fx(f)(_t((2, 3, 4, 4), torch.float32, 1))
    op = "bngrad.batch_norm_relu_forward" if fused else "bngrad.batch_norm_forward"
    assert op in str(graph.graph)
    x2 = _t((2, 3, 4, 4), torch.float32, 2)
    assert torch.equal(graph(x2), f(x2))


def _bngrad_and_pytorch(form):
    """(bngrad's callable, PyTorch's) for one form, the same state: the functional forms in
    training mode, modules in eval mode with running statistics (a module in training mode
    updates them in place, which torch.func refuses for PyTorch's module as for bngrad's)."""
    z = _t((4, 3, 5), seed=1)
    if form == "batch_norm":
        return (lambda d: bt.batch_norm(d, None, None, training=True),
                lambda d: F.batch_norm(d, None, None, training=True))
    if form == "batch_norm_relu":
        return (lambda d: bt.batch_norm_relu(d, None, None, training=True),
                lambda d: F.relu(F.batch_norm(d, None, None, training=True)))
    ours = (bt.BatchNormAddReLU1d(3) if form == "add_relu_module" else bt.BatchNorm1d(3))
    ours = ours.double().eval()
    with torch.no_grad():
        ours.running_mean.uniform_(-1, 1)
        ours.running_var.uniform_(0.5, 2)
        ours.weight.uniform_(-2, 2)
        ours.bias.uniform_(-1, 1)
    theirs = bt.revert(copy.deepcopy(ours)) if form == "module" else nn.BatchNorm1d(3).double()
    if form == "add_relu_module":
        theirs.load_state_dict(ours.state_dict())
        theirs.eval()
        return (lambda d: ours(d, z)), (lambda d: F.relu(theirs(d) + z))
    return ours, theirs


_AUTODIFF_FORMS = ["batch_norm", "batch_norm_relu", "add_relu_module", "module"]


@pytest.mark.parametrize("form", _AUTODIFF_FORMS)
def test_forward_mode_ad_gives_pytorchs_tangents(form):
    """bngrad has no forward derivative: a dual input runs on PyTorch's own batch norm (it was
    refused; before that, its tangent was dropped, reading as zero), and gives PyTorch's
    output and tangent, bitwise; a plain input in the same dual level is right too."""
    import torch.autograd.forward_ad as fwAD
    ours, theirs = _bngrad_and_pytorch(form)
    x, tangent = _t((4, 3, 5)), _t((4, 3, 5), seed=2)
    with fwAD.dual_level():
        got = fwAD.unpack_dual(ours(fwAD.make_dual(x, tangent)))
        want = fwAD.unpack_dual(theirs(fwAD.make_dual(x, tangent)))
        torch.testing.assert_close(got.primal, want.primal, rtol=0, atol=0)
        torch.testing.assert_close(got.tangent, want.tangent, rtol=0, atol=0)
        torch.testing.assert_close(ours(x).detach(), theirs(x).detach())


@pytest.mark.parametrize("form", _AUTODIFF_FORMS)
def test_torch_func_transforms_give_pytorchs_derivatives(form):
    """torch.func's differentiating transforms (grad, jacrev, jacfwd, hessian, and per-sample
    gradients: vmap over grad) run on PyTorch's own batch norm, bitwise PyTorch's results
    (they were refused: PyTorch's custom-operator autograd cannot run under them); vmap alone
    runs bngrad's layer (PyTorch's per-sample fallback) and is right."""
    import warnings
    ours, theirs = _bngrad_and_pytorch(form)
    x = _t((4, 3, 5))
    for transform in (torch.func.grad, torch.func.jacrev, torch.func.jacfwd, torch.func.hessian):
        got = transform(lambda t: ours(t).square().sum())(x)
        want = transform(lambda t: theirs(t).square().sum())(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    if form == "module":  # per sample: each sample a batch of its own
        per_sample = torch.func.vmap(torch.func.grad(lambda t: ours(t[None]).sum()))(x)
        want = torch.func.vmap(torch.func.grad(lambda t: theirs(t[None]).sum()))(x)
        torch.testing.assert_close(per_sample, want, rtol=0, atol=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (PyTorch's: a slow per-sample fallback)
            out = torch.func.vmap(ours)(x[:, None])
        torch.testing.assert_close(out[:, 0], ours(x).detach())


def test_torch_func_grad_trains_a_functional_model_as_pytorchs():
    """The use torch.func.grad is for (MAML-like loops): functional_call over a converted
    model's parameters, in training mode without running statistics, gives PyTorch's
    gradients."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False),
                          nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 2)).double()
    converted = bt.convert(copy.deepcopy(model), fuse=True)
    x = _t((5, 3, 6, 6))

    def loss(m):
        return lambda p: torch.func.functional_call(m, p, (x,)).square().mean()
    got = torch.func.grad(loss(converted))(dict(converted.named_parameters()))
    want = torch.func.grad(loss(model))(dict(model.named_parameters()))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_pytorchs_batch_norm_under_autodiff_keeps_bngrads_checks():
    """(Found by hostile testing of the above.) Where a call runs on PyTorch's batch norm for
    forward-mode AD or torch.func, the operands are still checked as bngrad checks them: a
    side input of another shape or dtype (PyTorch's add broadcast or promoted it), a negative
    running_var (PyTorch: NaN), a NaN eps."""
    import torch.autograd.forward_ad as fwAD
    x, w = _t((4, 3, 2)), torch.ones(3, dtype=torch.float64)
    zeros, ones = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    cases = [
        (lambda t: bt.batch_norm_add_relu(t, _t((2, 4, 3, 2)), None, None, training=True),
         ArgumentValueError, r"side_input: expected the shape of input \(4, 3, 2\), got shape "
                             r"\(2, 4, 3, 2\)"),
        (lambda t: bt.batch_norm_add_relu(t, _t((3, 1)), None, None, training=True),
         ArgumentValueError, "side_input: expected the shape of input"),
        (lambda t: bt.batch_norm_add_relu(t, _t((4, 3, 2), torch.float32), None, None,
                                          training=True),
         ArgumentTypeError, r"side_input: expected the dtype of input \(float64\), got dtype "
                            "float32"),
        (lambda t: bt.batch_norm(t, zeros, -ones, w), ArgumentValueError,
         "running_var: expected variances >= 0, got -1 at channel 0"),
        (lambda t: bt.batch_norm_relu(t, zeros, -ones, w), ArgumentValueError,
         "running_var: expected variances >= 0"),
        (lambda t: bt.batch_norm(t, None, None, w, training=True, eps=float("nan")),
         ArgumentValueError, "eps: expected a finite float >= 0, got nan"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call(x)  # eagerly
        with pytest.raises(error, match=match):
            torch.func.grad(lambda t, call=call: call(t).sum())(x)
        with pytest.raises(error, match=match), fwAD.dual_level():
            call(fwAD.make_dual(x, torch.ones_like(x)))


def test_a_tangent_on_the_running_statistics_is_pytorchs_to_handle():
    """(Found by hostile testing.) A dual running_var with an input that requires grad raised
    PyTorch's "implement the jvp function" from bngrad's autograd.Function; PyTorch's batch
    norm runs (its output has no tangent)."""
    import torch.autograd.forward_ad as fwAD
    x = _t((4, 3, 2)).requires_grad_()
    for train in (True, False):
        with fwAD.dual_level():
            mean = fwAD.make_dual(_t((3,), seed=4) * 0.1, torch.ones(3, dtype=torch.float64))
            var = fwAD.make_dual(torch.ones(3, dtype=torch.float64) * 2,
                                 torch.ones(3, dtype=torch.float64))
            got = bt.batch_norm_relu(x, mean.clone(), var.clone(), training=train)
            want = F.relu(F.batch_norm(x, mean.clone(), var.clone(), training=train))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            assert fwAD.unpack_dual(got).tangent is None


@pytest.mark.parametrize("fused", [False, True])
def test_functionalize_updates_the_running_statistics_as_pytorchs(fused):
    """(Found by hostile testing.) torch.func.functionalize of a training-mode layer failed
    with an internal assert (the custom op's in-place copy into the running statistics): it
    runs on PyTorch's batch norm now, with PyTorch's outputs and running statistics."""
    ours = (bt.BatchNormReLU2d(3) if fused else bt.BatchNorm2d(3)).double()
    theirs = nn.BatchNorm2d(3).double()
    x = _t((4, 3, 2, 2))
    got = torch.func.functionalize(ours)(x)
    want = torch.func.functionalize(theirs)(x)
    torch.testing.assert_close(got, F.relu(want) if fused else want, rtol=0, atol=0)
    torch.testing.assert_close(ours.running_var, theirs.running_var, rtol=0, atol=0)
    assert int(ours.num_batches_tracked) == 1


def test_eps_and_momentum_are_numbers():
    """(Found by hostile testing.) A string eps was taken (float('1e-5')), and eps=None's
    error did not name eps; a one-element tensor momentum, which PyTorch takes, was refused."""
    x = _t((4, 3, 2))
    for eps in ("1e-5", None, [1e-5]):
        with pytest.raises(ArgumentTypeError, match="eps: expected a float >= 0, got"):
            bt.batch_norm(x, None, None, training=True, eps=eps)
        with pytest.raises(ArgumentTypeError, match="eps: expected a float >= 0, got"):
            bt.batch_norm_relu(x, None, None, training=True, eps=eps)
    ours, theirs = (torch.zeros(3, dtype=torch.float64) for _ in range(2))
    got = bt.batch_norm(x, ours, torch.ones(3, dtype=torch.float64), training=True,
                        momentum=torch.tensor(0.25))
    want = F.batch_norm(x, theirs, torch.ones(3, dtype=torch.float64), training=True,
                        momentum=torch.tensor(0.25))
    assert_close(got.numpy(), want.numpy())
    torch.testing.assert_close(ours, theirs)
    # a 0-d tensor eps, which PyTorch takes (and a 1-element 1-D one, which it refuses)
    got = bt.batch_norm(x, None, None, training=True, eps=torch.tensor(1e-3))
    want = F.batch_norm(x, None, None, training=True, eps=torch.tensor(1e-3))
    assert_close(got.numpy(), want.numpy())
    with pytest.raises(ArgumentTypeError, match="eps: expected a float >= 0, got"):
        bt.batch_norm(x, None, None, training=True, eps=torch.tensor([1e-3]))


def test_op_refuses_a_bool_mask():
    """The op documents the "bits" mask; a bool mask gave first derivatives, then its double
    backward (which decodes bits) failed with a size mismatch."""
    dy, x, w, _, _, mean, invstd, bits, *rest = _BACKWARD["train"]
    with pytest.raises(TypeError, match="relu_mask: expected the forward's \"bits\" mask"):
        torch.ops.bngrad.batch_norm_relu_backward(dy, x, w, None, None, mean, invstd,
                                                  torch.ones_like(x, dtype=torch.bool), *rest)


def test_add_relu_module_refuses_a_missing_side_input():
    """As the functional form: no silent BN -> ReLU, and no training step counted."""
    m = bt.BatchNormAddReLU2d(3)
    with pytest.raises(TypeError, match="argument 'side_input' must be Tensor, not NoneType"):
        m(_t((2, 3, 4, 4), torch.float32), None)
    assert int(m.num_batches_tracked) == 0
