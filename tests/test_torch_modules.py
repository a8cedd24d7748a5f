"""bngrad.torch.BatchNorm1d/2d/3d against torch.nn's: outputs, gradients, running statistics,
state_dict, input checks, convert/revert, and 20 SGD steps of a small CNN."""

from __future__ import annotations

import copy
import io
import os
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import bngrad.torch as bt  # noqa: E402
from conftest import BF16, from_torch  # noqa: E402
from tolerances import assert_close  # noqa: E402

CLASSES = {
    "1d-NC": (bt.BatchNorm1d, nn.BatchNorm1d, (6, 3)),
    "1d-NCL": (bt.BatchNorm1d, nn.BatchNorm1d, (4, 3, 5)),
    "2d": (bt.BatchNorm2d, nn.BatchNorm2d, (3, 3, 4, 5)),
    "3d": (bt.BatchNorm3d, nn.BatchNorm3d, (2, 3, 2, 3, 4)),
}
CONFIGS = {
    "default": {},
    "momentum-None": {"momentum": None},
    "eps-momentum": {"eps": 1e-3, "momentum": 0.3},
    "no-affine": {"affine": False},
    "no-running-stats": {"track_running_stats": False},
}


def _close(actual, expected, what, dtype=None):
    """bngrad vs PyTorch: both approximate, so twice the table's tolerance."""
    assert_close(from_torch(actual).astype(np.float64), from_torch(expected).astype(np.float64),
                 dtype=dtype or from_torch(expected).dtype, what=what, factor=2)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", list(CLASSES))
def test_module_matches_torch(kind, config):
    ours_cls, torch_cls, shape = CLASSES[kind]
    kwargs = dict(CONFIGS[config], dtype=torch.float64)
    theirs = torch_cls(shape[1], **kwargs)
    ours = ours_cls(shape[1], **kwargs)
    if theirs.affine:  # non-trivial affine parameters
        with torch.no_grad():
            theirs.weight.uniform_(0.5, 1.5)
            theirs.bias.uniform_(-0.5, 0.5)
    ours.load_state_dict(theirs.state_dict())
    gen = torch.Generator().manual_seed(0)
    # three training steps, then eval; every output, gradient and buffer compared each time
    for step, training in enumerate([True, True, True, False]):
        ours.train(training)
        theirs.train(training)
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + step
        dy = torch.randn(shape, generator=gen, dtype=torch.float64)
        xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
        yo, yt = ours(xo), theirs(xt)
        yo.backward(dy)
        yt.backward(dy)
        _close(yo, yt, f"step {step} output")
        _close(xo.grad, xt.grad, f"step {step} grad_input")
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            _close(p.grad, q.grad, f"step {step} {name}.grad")
            p.grad = q.grad = None
        for (name, b), c in zip(ours.named_buffers(), theirs.buffers()):
            if b.dtype == torch.long:
                assert torch.equal(b, c), f"step {step} {name}: {b} != {c}"
            else:
                _close(b, c, f"step {step} {name}")
    assert set(ours.state_dict()) == set(theirs.state_dict())


@pytest.mark.parametrize("kind", list(CLASSES))
def test_input_dimension_checks_match_torch(kind):
    ours_cls, torch_cls, shape = CLASSES[kind]
    bad_ndim = {nn.BatchNorm1d: 4, nn.BatchNorm2d: 3, nn.BatchNorm3d: 4}[torch_cls]
    bad = torch.randn((2, shape[1]) + (2,) * (bad_ndim - 2))
    with pytest.raises(ValueError) as ours:
        ours_cls(shape[1])(bad)
    with pytest.raises(ValueError) as theirs:
        torch_cls(shape[1])(bad)
    assert str(ours.value) == str(theirs.value)


def test_is_a_drop_in():
    m = bt.BatchNorm2d(4, eps=1e-3, momentum=None, affine=True, track_running_stats=True,
                       device="cpu", dtype=torch.float32)
    t = nn.BatchNorm2d(4, eps=1e-3, momentum=None)
    assert isinstance(m, nn.BatchNorm2d)
    assert list(m.state_dict()) == list(t.state_dict()) == [
        "weight", "bias", "running_mean", "running_var", "num_batches_tracked"]


def test_repr_tells_bngrad_layers_from_pytorchs():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, eps=1e-3), nn.BatchNorm2d(4))
    state = copy.deepcopy(model.state_dict())
    model[1] = bt.convert(model[1])  # model[2] stays PyTorch's
    lines = repr(model).splitlines()
    assert lines[2] == ("  (1): bngrad.torch.BatchNorm2d(4, eps=0.001, momentum=0.1, "
                        "affine=True, bias=True, track_running_stats=True)"), lines[2]
    assert lines[3].startswith("  (2): BatchNorm2d(4, "), lines[3]
    assert repr(bt.BatchNorm1d(3)).startswith("bngrad.torch.BatchNorm1d(3, ")
    assert repr(bt.BatchNorm3d(3)).startswith("bngrad.torch.BatchNorm3d(3, ")
    assert repr(bt.SyncBatchNorm(3)).startswith("bngrad.torch.SyncBatchNorm(3, ")
    # the state_dict is untouched: same keys, same values
    assert list(model.state_dict()) == list(state)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


# --- checks and messages in PyTorch's terms ---------------------------------------------------

@pytest.mark.parametrize("eps", [0.0, -1e-5])
@pytest.mark.parametrize("kind", ["1d-NC", "2d", "3d"])
def test_eps_checks_match_torch(kind, eps):
    ours_cls, torch_cls, shape = CLASSES[kind]
    x = torch.randn(shape)
    for training in (True, False):
        ours, theirs = ours_cls(shape[1], eps=eps), torch_cls(shape[1], eps=eps)
        ours.train(training)
        theirs.train(training)
        if training or eps < 0:
            with pytest.raises(ValueError) as raised_ours:
                ours(x)
            with pytest.raises(ValueError) as raised_theirs:
                theirs(x)
            assert str(raised_ours.value) == str(raised_theirs.value)
        else:  # eval with eps = 0 runs, as PyTorch's does
            _close(ours(x), theirs(x), "eval output with eps=0")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["1d-NC", "2d", "3d"])
def test_wrong_channel_count_names_the_module(kind, training):
    ours_cls, _, shape = CLASSES[kind]
    m = ours_cls(shape[1] + 1).train(training)
    message = (f"bngrad.torch.{ours_cls.__name__}: input has {shape[1]} channels (dimension 1 "
               f"of shape {shape}), the module expects {shape[1] + 1} (num_features)")
    with pytest.raises(ValueError, match=re.escape(message)):
        m(torch.randn(shape))


def test_wrong_parameter_dtype_advises_torch_conversions():
    m = bt.BatchNorm2d(3).double()
    with pytest.raises(TypeError) as raised:
        m(torch.randn(2, 3, 4, 4))
    message = str(raised.value)
    assert "astype" not in message
    assert ("bngrad.torch.BatchNorm2d: input has dtype torch.float32 but the module's weight has "
            "dtype torch.float64") in message
    assert "model.float()" in message and "input.to(torch.float64)" in message
    # a half input may have float32 parameters, but not the other half type
    m = bt.BatchNorm2d(3).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"model\.half\(\).*input\.to\(torch\.bfloat16\)"):
        m(torch.randn(2, 3, 4, 4, dtype=torch.float16))
    # an unsupported input dtype is blamed on the input, not on the parameters
    with pytest.raises(TypeError, match="input must be float64, float32, float16 or bfloat16"):
        bt.BatchNorm2d(3)(torch.ones(2, 3, 4, 4, dtype=torch.int32))


# --- TorchScript and tracing --------------------------------------------------------------------

def _small_model(momentum=0.1):
    return bt.convert(nn.Sequential(nn.Conv2d(3, 4, 3, bias=False),
                                    nn.BatchNorm2d(4, momentum=momentum),
                                    nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5),
                                    nn.BatchNorm1d(5, momentum=momentum)))


@pytest.mark.parametrize("layer", ["converted", "sync"])
def test_torchscript_is_refused_clearly(layer):
    model = (_small_model() if layer == "converted"
             else nn.Sequential(nn.Linear(3, 3), bt.SyncBatchNorm(3)))
    with pytest.raises(RuntimeError, match=r"bngrad.torch.(BatchNorm2d|SyncBatchNorm): bngrad's "
                                           r"batch norm does not support TorchScript.*"
                                           r"torch.compile or torch.export"):
        torch.jit.script(model)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_jit_trace_is_clean_and_correct(training):
    torch.manual_seed(0)
    ours = _small_model().train(training)
    theirs = bt.revert(copy.deepcopy(ours))
    example = torch.randn(6, 3, 6, 6)
    with warnings.catch_warnings(record=True) as caught:
        traced = torch.jit.trace(ours, example)
        traced_theirs = torch.jit.trace(theirs, example)
    from_bngrad = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught
                   if os.path.dirname(bt.__file__) in os.path.abspath(w.filename)]
    assert not from_bngrad, from_bngrad
    for step in range(3):  # the traced model goes on updating its running statistics
        x = torch.randn(5, 3, 6, 6)
        _close(traced(x), traced_theirs(x), f"traced output, step {step}")
        for (name, b), c in zip(ours.named_buffers(), theirs.buffers()):
            if b.dtype == torch.long:
                assert torch.equal(b, c), name
            else:
                _close(b, c, f"step {step} {name}")


def test_jit_trace_refuses_a_cumulative_average_in_training():
    model = _small_model(momentum=None)
    with pytest.raises(RuntimeError, match=r"momentum=None\) cannot be traced in training mode"):
        torch.jit.trace(model, torch.randn(6, 3, 6, 6))
    torch.jit.trace(model.eval(), torch.randn(6, 3, 6, 6))  # eval mode: nothing is frozen


@pytest.mark.parametrize("direction", ["torch->bngrad", "bngrad->torch"])
def test_state_dict_round_trip(direction):
    src_cls, dst_cls = ((nn.BatchNorm2d, bt.BatchNorm2d) if direction == "torch->bngrad"
                        else (bt.BatchNorm2d, nn.BatchNorm2d))
    src = src_cls(5)
    src(torch.randn(4, 5, 3, 3) * 3 + 1)  # non-trivial running stats
    with torch.no_grad():
        src.weight.uniform_(0.5, 1.5)
    buf = io.BytesIO()
    torch.save(src.state_dict(), buf)
    buf.seek(0)
    dst = dst_cls(5)
    dst.load_state_dict(torch.load(buf), strict=True)
    for key, value in src.state_dict().items():
        assert torch.equal(dst.state_dict()[key], value), key
    src.eval()
    dst.eval()
    x = torch.randn(2, 5, 3, 3)
    _close(dst(x), src(x), "eval output after loading")


def _model():
    class MyBatchNorm(nn.BatchNorm1d):  # a user's subclass: may behave differently, kept
        pass

    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Identity(),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None)),
        nn.Flatten(), nn.Linear(4 * 5 * 5, 6), nn.BatchNorm1d(6, affine=False),
        nn.SyncBatchNorm(6), MyBatchNorm(6))


def test_convert_and_revert():
    model = _model()
    model[4][1].eval()
    params = {name: p for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    x = torch.randn(3, 3, 5, 5)
    model.eval()
    expected = model(x)
    model.train()
    model[4][1].eval()

    converted = bt.convert(model)
    assert converted is model
    assert type(model[1]) is bt.BatchNorm2d and type(model[4][1]) is bt.BatchNorm2d
    assert type(model[7]) is bt.BatchNorm1d
    assert type(model[8]) is nn.SyncBatchNorm  # left alone, as are subclasses
    assert type(model[9]).__name__ == "MyBatchNorm"
    assert model[4][1].momentum is None and not model[4][1].training and model[1].training
    # the very same Parameter and buffer objects: an existing optimizer keeps working
    assert all(p is params[name] for name, p in model.named_parameters())
    assert all(b is buffers[name] for name, b in model.named_buffers())
    model.eval()
    _close(model(x), expected, "output after convert")

    reverted = bt.revert(model)
    assert type(reverted[1]) is nn.BatchNorm2d and type(reverted[7]) is nn.BatchNorm1d
    assert all(p is params[name] for name, p in reverted.named_parameters())
    assert torch.equal(reverted(x), expected)

    root = bt.convert(nn.BatchNorm3d(2))
    assert type(root) is bt.BatchNorm3d
    assert type(bt.revert(root)) is nn.BatchNorm3d


# --- 20 SGD steps of a small CNN -----------------------------------------------------------------

class _Cast(nn.Module):
    """Casts activations to ``dtype`` (the batch norm's input) and back to float32 after."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def forward(self, x):
        return x.to(self.dtype)


def _cnn(bn_dtype):
    def block(c_in, c_out, stride):
        return [nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
                _Cast(bn_dtype), nn.BatchNorm2d(c_out), _Cast(torch.float32), nn.ReLU()]
    return nn.Sequential(*block(3, 8, 1), *block(8, 8, 2), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 4))


def _data(n=64):
    """Four classes of 3x8x8 images: a fixed random prototype per class plus noise."""
    gen = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 4, (n,), generator=gen)
    prototypes = torch.randn(4, 3, 8, 8, generator=gen)
    return prototypes[labels] + 0.8 * torch.randn(n, 3, 8, 8, generator=gen), labels


def _train(model, x, labels, steps=20, batch=16):
    """``steps`` SGD steps; returns the last step's logits and batch-norm outputs (gradients
    are left in place, before the last update)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    bn_outputs = []
    hooks = [m.register_forward_hook(lambda m, i, o: bn_outputs.append(o))
             for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for step in range(steps):
        bn_outputs.clear()
        start = (step * batch) % len(x)
        opt.zero_grad()
        logits = model(x[start:start + batch])
        nn.functional.cross_entropy(logits, labels[start:start + batch]).backward()
        if step < steps - 1:
            opt.step()
    for h in hooks:
        h.remove()
    return logits, list(bn_outputs)


@pytest.mark.parametrize("bn_dtype", [torch.float32, torch.bfloat16],
                         ids=["float32", "bfloat16-p32"])
def test_cnn_training_matches_torch(bn_dtype):
    # The batch norms see bn_dtype activations with float32 parameters and statistics (for
    # bfloat16: PyTorch's mixed precision); everything else is the same float32 computation.
    # After the steps, everything is judged at the tolerance of the dtype the batch norms
    # computed in (their rounding reaches every gradient and, through the updates, every
    # parameter). bfloat16 training is chaotic at that tolerance: in PyTorch against itself,
    # nudging one conv weight by one bfloat16 step moves gradients 9% after 5 steps and 4-29%
    # after 10-20, so two correct batch norms that round differently cannot agree for 20
    # steps; bfloat16 is compared after 3.
    steps = 3 if bn_dtype == torch.bfloat16 else 20
    torch.manual_seed(0)
    reference = _cnn(bn_dtype)
    x, labels = _data()
    theirs = copy.deepcopy(reference)
    ours = bt.convert(copy.deepcopy(reference))
    assert sum(isinstance(m, bt.BatchNorm2d) for m in ours.modules()) == 2
    logits_t, bn_t = _train(theirs, x, labels, steps)
    logits_o, bn_o = _train(ours, x, labels, steps)
    tol = BF16 if bn_dtype == torch.bfloat16 else np.float32
    _close(logits_o, logits_t, "logits", tol)
    for i, (a, b) in enumerate(zip(bn_o, bn_t)):
        assert a.dtype == b.dtype == bn_dtype
        _close(a, b, f"batch norm {i} output", tol)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        _close(p.grad, q.grad, f"{name}.grad", tol)
        _close(p, q, name, tol)
    for (name, b), c in zip(ours.named_buffers(), theirs.buffers()):
        if b.dtype == torch.long:
            assert torch.equal(b, c), name
        else:
            _close(b, c, name, tol)
