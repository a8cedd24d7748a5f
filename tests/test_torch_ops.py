"""torch.ops.bngrad.*: schema, fake implementations and autograd registration (opcheck), and
tracing by torch.compile and torch.export."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import bngrad.torch as bt  # noqa: E402
from tolerances import assert_close  # noqa: E402


def _t(shape, dtype=torch.float32, seed=0, grad=False, **kw):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) + 0.2).to(dtype)
    if kw.get("channels_last"):
        t = t.to(memory_format=torch.channels_last)
    return t.requires_grad_(grad)


def _forward_samples():
    """(id, args) of batch_norm_forward calls: dtypes, modes, layouts, optional arguments."""
    for dtype, pdtype, name in [(torch.float32, torch.float32, "float32"),
                                (torch.bfloat16, torch.float32, "bfloat16-p32")]:
        for training in (True, False):
            x = _t((3, 4, 2, 5), dtype, grad=True, channels_last=training)
            w, b = _t(4, pdtype, 1, grad=True), _t(4, pdtype, 2, grad=True)
            rm, rv = _t(4, pdtype, 3), _t(4, pdtype, 4).abs() + 0.5
            mode = "train-chlast" if training else "eval"
            yield f"{name}-{mode}", (x, w, b, rm, rv, training, 0.1, 1e-5)
    yield "float64-train-noparams", (_t((5, 3), torch.float64, grad=True), None, None, None,
                                     None, True, 0.1, 1e-5)


def _backward_samples():
    x = _t((3, 4, 5))
    dy = _t((3, 4, 5), seed=5)
    w = _t(4, seed=1)
    mean, var = x.mean((0, 2)), x.var((0, 2), unbiased=False)
    invstd = torch.rsqrt(var + 1e-5)
    yield "train", (dy, x, w, None, None, mean, invstd, True, 1e-5, [True, True, True])
    yield "eval-noweight-mask100", (dy, x, None, mean, var, torch.empty(0), torch.empty(0),
                                    False, 1e-5, [True, False, False])
    yield "train-mask011", (dy, x, w, None, None, mean, invstd, True, 1e-5, [False, True, True])


_FORWARD = dict(_forward_samples())
_BACKWARD = dict(_backward_samples())


@pytest.mark.parametrize("case", list(_FORWARD))
def test_opcheck_batch_norm_forward(case):
    torch.library.opcheck(torch.ops.bngrad.batch_norm_forward.default, _FORWARD[case])


@pytest.mark.parametrize("case", list(_BACKWARD))
def test_opcheck_batch_norm_backward(case):
    torch.library.opcheck(torch.ops.bngrad.batch_norm_backward.default, _BACKWARD[case])


def test_opcheck_reduce_elemt_moments():
    x, dy = _t((4, 3, 5), torch.bfloat16), _t((4, 3, 5), torch.bfloat16, seed=1)
    mean, var = torch.ops.bngrad.batch_norm_moments(x)
    assert mean.dtype == torch.float64
    assert_close(mean.numpy(), x.double().mean((0, 2)).numpy(), what="mean")
    assert_close(var.numpy(), x.double().var((0, 2), unbiased=False).numpy(), what="var")
    mean32, invstd = mean.float(), torch.rsqrt(var + 1e-5).float()
    w = _t(3, seed=2)
    torch.library.opcheck(torch.ops.bngrad.batch_norm_moments.default, (x,))
    reduce_args = (dy, x, mean32, invstd, w, True, True, False)
    torch.library.opcheck(torch.ops.bngrad.batch_norm_backward_reduce.default, reduce_args)
    sum_dy, sum_dy_xmu, _, _ = torch.ops.bngrad.batch_norm_backward_reduce(*reduce_args)
    torch.library.opcheck(torch.ops.bngrad.batch_norm_backward_elemt.default,
                          (dy, x, mean32, invstd, w, sum_dy, sum_dy_xmu,
                           torch.tensor([20], dtype=torch.int32)))


def _small_model():
    torch.manual_seed(0)
    return bt.convert(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Flatten(), nn.Linear(4 * 6 * 6, 2), nn.BatchNorm1d(2)))


def test_torch_compile_aot_eager():
    model = _small_model()
    compiled_model = _small_model()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 3, 6, 6)
    for _ in range(2):  # train steps: forward, backward, running stats
        y, yc = model(x), compiled(x)
        y.square().sum().backward()
        yc.square().sum().backward()
        assert_close(yc.detach().numpy(), y.detach().numpy(), what="output", factor=2)
    for (name, p), q in zip(model.named_parameters(), compiled_model.parameters()):
        assert_close(q.grad.numpy(), p.grad.numpy(), what=f"{name}.grad", factor=2)
    for (name, b), c in zip(model.named_buffers(), compiled_model.buffers()):
        assert_close(c.double().numpy(), b.double().numpy(), what=name, factor=2)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_torch_compile_dynamic_fullgraph(fused):
    """(Found by hostile testing.) torch.compile(dynamic=True, fullgraph=True) failed: the
    module's momentum, a symbolic float there, went through math.isfinite, which Dynamo
    cannot trace (a graph break, an error under fullgraph). PyTorch's own layer compiles."""
    torch.manual_seed(0)
    make = (lambda: bt.BatchNormReLU2d(4)) if fused else (lambda: bt.BatchNorm2d(4))
    model, compiled_model = make(), make()
    compiled = torch.compile(compiled_model, backend="aot_eager", dynamic=True, fullgraph=True)
    for batch in (4, 6):  # a second batch size: the dynamic shape
        x = torch.randn(batch, 4, 5, 5, requires_grad=True)
        xc = x.detach().clone().requires_grad_()
        y, yc = model(x), compiled(xc)
        y.square().sum().backward()
        yc.square().sum().backward()
        assert_close(yc.detach().numpy(), y.detach().numpy(), what="output", factor=2)
        assert_close(xc.grad.numpy(), x.grad.numpy(), what="grad_input", factor=2)
    assert_close(compiled_model.running_var.numpy(), model.running_var.numpy(),
                 what="running_var", factor=2)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_torch_export(training):
    model = _small_model().train(training)
    exported = torch.export.export(model, (torch.randn(4, 3, 6, 6),))
    targets = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.bngrad.batch_norm_forward.default) == 2
    # the exported program computes what the model does, running statistics included
    program, eager = exported.module(), _small_model().train(training)
    x = torch.randn(4, 3, 6, 6) * 2 + 1
    assert_close(program(x).detach().numpy(), eager(x).detach().numpy(), factor=2)
    buffers = dict(program.named_buffers())
    for name, b in eager.named_buffers():
        assert_close(buffers[name].double().numpy(), b.double().numpy(), what=name, factor=2)
    if training:
        assert eager[1].num_batches_tracked.item() == 1
