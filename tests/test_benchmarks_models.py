"""benchmarks/models.py: the ResNets of the training-step benchmark are the published
architectures, and one SGD step of a converted model equals PyTorch's step."""

from __future__ import annotations

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import bngrad.torch as bt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import models  # noqa: E402

# their models have 1x1 stride-2 shortcut convolutions (conftest.native_convolutions)
pytestmark = pytest.mark.usefixtures("native_convolutions")

LAYOUTS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
# name: (builder at a tiny width, classes, input size); batch 4
TINY = {"resnet18": (lambda: models.resnet18(10, width=8), 10, 32),
        "resnet20": (lambda: models.resnet20(10, width=4), 10, 16)}


def _count(model, cls):
    return sum(isinstance(m, cls) for m in model.modules())


def test_full_size_architectures():
    r18, r20 = models.resnet18(), models.resnet20()
    # torchvision's resnet18() has 11,689,512 parameters; the CIFAR ResNet-20 0.27M.
    assert sum(p.numel() for p in r18.parameters()) == 11_689_512
    assert sum(p.numel() for p in r20.parameters()) == 269_722
    assert _count(r18, torch.nn.BatchNorm2d) == 20 and _count(r20, torch.nn.BatchNorm2d) == 19
    assert _count(r18, torch.nn.Conv2d) == 20 and _count(r20, torch.nn.Conv2d) == 19


def _step(model, x, labels):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), labels)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return loss.detach(), grads


# Each model in both layouts, once in float64 (tight: the arithmetic) and once in float32 (the
# dtype users train in), four cases to stay fast.
CASES = [("resnet18", "contiguous", torch.float64, 1e-9),
         ("resnet18", "channels_last", torch.float32, 2e-4),
         ("resnet20", "channels_last", torch.float64, 1e-9),
         ("resnet20", "contiguous", torch.float32, 2e-4)]


@pytest.mark.parametrize("name,layout,dtype,tol", CASES,
                         ids=[f"{n}-{lay}-{str(d)[6:]}" for n, lay, d, _ in CASES])
def test_converted_step_equals_torch_step(name, layout, dtype, tol):
    build, classes, size = TINY[name]
    torch.manual_seed(0)
    ref = build().to(dtype).to(memory_format=LAYOUTS[layout])
    ours = bt.convert(copy.deepcopy(ref))
    assert _count(ours, torch.nn.BatchNorm2d) == _count(ref, torch.nn.BatchNorm2d)
    assert all(type(m).__module__.startswith("bngrad") for m in ours.modules()
               if isinstance(m, torch.nn.BatchNorm2d))
    x = torch.randn(4, 3, size, size, dtype=dtype).to(memory_format=LAYOUTS[layout])
    labels = torch.randint(0, classes, (4,))

    loss_ref, grads_ref = _step(ref, x, labels)
    loss, grads = _step(ours, x, labels)

    torch.testing.assert_close(loss, loss_ref, rtol=tol, atol=tol)
    assert len(grads) == len(grads_ref)
    for g, g_ref in zip(grads, grads_ref):
        # relative to the tensor's scale: gradients through batch norm cancel elementwise
        torch.testing.assert_close(g, g_ref, rtol=tol, atol=tol * g_ref.abs().max().item())
    for (key, v), v_ref in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(v, v_ref, rtol=tol, atol=tol, msg=f"{key} after the step")
