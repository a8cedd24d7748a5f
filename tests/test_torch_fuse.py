"""bngrad.torch.convert(model, fuse=True) and revert: BN→ReLU and BN→add→ReLU fused in
ResNet-style models by torch.fx, checked against the unconverted PyTorch model (outputs,
gradients, running statistics, optimizer steps), state_dict kept, revert back to plain
PyTorch, and every fallback with its report."""

from __future__ import annotations

import copy
import io
import pickle
import os
import random
import re
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
import torch.fx as fx  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import bngrad.torch as bt  # noqa: E402
from bngrad.torch import _fuse as fusion  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import models  # noqa: E402  (benchmarks/models.py: ResNet-18 / ResNet-20)

# their models have 1x1 stride-2 shortcut convolutions (conftest.native_convolutions)
pytestmark = pytest.mark.usefixtures("native_convolutions")

LAYOUTS = {"contig": torch.contiguous_format, "chlast": torch.channels_last}
TOL = {torch.float64: 1e-10, torch.float32: 2e-4}


# --- models -----------------------------------------------------------------------------------

class TVBlock(nn.Module):
    """torchvision's BasicBlock: one shared nn.ReLU(inplace=True), ``out += identity``, a
    1x1 conv + BN downsample."""

    def __init__(self, inplanes, planes, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TVNet(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(TVBlock(width, width), TVBlock(width, 2 * width, 2))
        self.fc = nn.Linear(2 * width, 5)

    def forward(self, x):
        x = self.layer1(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class MLP(nn.Module):
    """BatchNorm1d followed by F.relu, then a residual add with Tensor.add and x.relu_()."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn1 = nn.Linear(6, 8), nn.BatchNorm1d(8)
        self.fc2, self.bn2 = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        h = F.relu(self.bn1(self.fc1(x)))
        return self.bn2(self.fc2(h)).add(h).relu_()


class Net3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(4)

    def forward(self, x):
        return torch.relu_(self.bn(self.conv(x)))


def _resnet20():
    return models.resnet20(10, width=4)


# name: (builder, input shape, 2-d convolutions: the layout matters)
MODELS = {"torchvision-block": (TVNet, (4, 3, 8, 8), True),
          "resnet20": (_resnet20, (4, 3, 16, 16), True),
          "mlp-1d": (MLP, (6, 6), False),
          "conv-3d": (Net3d, (3, 2, 4, 4, 4), False)}
# (model, fused BN+ReLU, fused BN+add+ReLU)
COUNTS = {"torchvision-block": (3, 2), "resnet20": (10, 9), "mlp-1d": (1, 1),
          "conv-3d": (1, 0)}


def _count(model, classes):
    return sum(isinstance(m, classes) for m in model.modules())


def _fused(model):
    """(BN+ReLU, BN+add+ReLU) fused in ``model``: the fused calls of its GraphModules and
    the fused pairs of its FusedSequentials, as they run."""
    relu = add = 0
    for m in model.modules():
        if isinstance(m, fx.GraphModule):
            relu += sum(n.target is fusion.bn_relu for n in m.graph.nodes)
            add += sum(n.target is fusion.bn_add_relu for n in m.graph.nodes)
        relu += len(getattr(m, "fused_pairs", ()))
    return relu, add


def _bngrad_modules(model):
    return [name for name, m in model.named_modules() if type(m).__module__.startswith("bngrad")]


def _build(name, dtype, layout):
    build, shape, is_2d = MODELS[name]
    torch.manual_seed(0)
    model = build().to(dtype)
    x = torch.randn(shape, dtype=dtype)
    if is_2d:
        model, x = model.to(memory_format=LAYOUTS[layout]), x.to(memory_format=LAYOUTS[layout])
    with torch.no_grad():  # batch norms with non-trivial affine parameters and statistics
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    return model, x


def _fuse(model):
    """convert(fuse=True) of a copy, asserting that it warned about nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", bt.FusionWarning)
        return bt.convert(copy.deepcopy(model), fuse=True)


def _assert_close(actual, expected, tol, what):
    # relative to the tensor's scale: gradients through batch norm cancel elementwise
    scale = max(expected.abs().max().item(), 1.0)
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol * scale, msg=what)


def _forward_backward(model, x):
    x = x.detach().clone().requires_grad_()
    out = model(x)
    g = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out.backward(g.to(out.dtype))
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), x.grad, grads


# --- equivalence with PyTorch -----------------------------------------------------------------

CASES = [(name, dtype, layout, mode)
         for name, (_, _, is_2d) in MODELS.items()
         for dtype in (torch.float64, torch.float32)
         for layout in (("contig", "chlast") if is_2d else ("contig",))
         for mode in ("train", "eval")]


@pytest.mark.parametrize("name,dtype,layout,mode", CASES,
                         ids=[f"{n}-{str(d)[6:]}-{lay}-{m}" for n, d, lay, m in CASES])
def test_fused_model_matches_torch(name, dtype, layout, mode):
    ref, x = _build(name, dtype, layout)
    ref.train(mode == "train")
    ours = _fuse(ref)
    n_relu, n_add = COUNTS[name]
    assert _fused(ours) == (n_relu, n_add)
    assert len(ours.bngrad_fusion_report.fused) == n_relu + n_add
    assert ours.training == ref.training

    out_ref, gx_ref, grads_ref = _forward_backward(ref, x)
    out, gx, grads = _forward_backward(ours, x)
    tol = TOL[dtype]
    _assert_close(out, out_ref, tol, "output")
    _assert_close(gx, gx_ref, tol, "grad of the input")
    assert list(grads) == list(grads_ref)
    for key in grads:
        _assert_close(grads[key], grads_ref[key], tol, f"grad of {key}")
    for (key, v), v_ref in zip(ours.state_dict().items(), ref.state_dict().values()):
        _assert_close(v.double(), v_ref.double(), tol, f"{key} after the step")


def test_state_dict_keys_order_and_objects_kept():
    ref, _ = _build("torchvision-block", torch.float32, "contig")
    before = ref.state_dict(keep_vars=True)
    params = list(ref.parameters())
    ours = bt.convert(ref, fuse=True)
    after = ours.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is before[k] for k in before)
    assert list(ours.parameters()) == params or all(
        a is b for a, b in zip(ours.parameters(), params))
    # the modules whose own forward had something fused became GraphModules; the rest kept
    # their classes (the stem's nn.Sequential fused by its chain, still indexable)
    assert type(ours) is TVNet and isinstance(ours.stem, nn.Sequential)
    assert ours.stem.fused_pairs == (("1", "2"),) and type(ours.layer1) is nn.Sequential
    assert all(isinstance(block, fx.GraphModule) for block in ours.layer1)
    # a checkpoint of the unconverted model loads into the fused one, and back
    ours.load_state_dict(copy.deepcopy(before))
    ref2, _ = _build("torchvision-block", torch.float32, "contig")
    ref2.load_state_dict(ours.state_dict())


def test_uncalled_modules_and_registration_order_survive_copies():
    class Unordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(2, 2)  # registered first, never called
            self.bn = nn.BatchNorm2d(3)
            self.conv = nn.Conv2d(3, 3, 1)  # called before bn
            self.register_buffer("extra", torch.ones(2))

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)))

    ref = Unordered()
    keys = list(ref.state_dict())
    ours = _fuse(ref)
    assert isinstance(ours.bn, bt.BatchNorm2d) and _fused(ours) == (1, 0)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for model in (ours, copy.deepcopy(ours), torch.load(buffer, weights_only=False)):
        assert list(model.state_dict()) == keys
        assert [n for n, _ in model.named_children()] == ["unused", "bn", "conv"]


def test_optimizer_built_before_conversion_still_trains():
    ref, x = _build("resnet20", torch.float64, "contig")
    model = copy.deepcopy(ref)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    model = bt.convert(model, fuse=True)
    labels = torch.arange(x.shape[0]) % 10
    for _ in range(2):
        for m, o in ((ref, opt_ref), (model, opt)):
            o.zero_grad()
            F.cross_entropy(m(x), labels).backward()
            o.step()
    changed = False
    for (key, p), p_ref, p0 in zip(model.named_parameters(), ref.parameters(),
                                   _build("resnet20", torch.float64, "contig")[0].parameters()):
        _assert_close(p.detach(), p_ref.detach(), 1e-9, key)
        changed |= not torch.equal(p.detach(), p0)
    assert changed


@pytest.mark.parametrize("name", ["torchvision-block", "resnet20", "mlp-1d"])
def test_revert_gives_plain_pytorch(name):
    ref, x = _build(name, torch.float64, "contig")
    before = ref.state_dict(keep_vars=True)
    ours = _fuse(ref)
    by_chain = sum("nn.Sequential" in how for _, how in ours.bngrad_fusion_report.fused)
    back = bt.revert(ours)
    assert _bngrad_modules(back) == []
    assert not hasattr(back, "bngrad_fusion_report")
    after = back.state_dict(keep_vars=True)
    assert list(after) == list(before)
    assert all(after[k] is ours.state_dict(keep_vars=True)[k] for k in after)
    n_bn = _count(ref, nn.modules.batchnorm._BatchNorm)
    assert _count(back, nn.modules.batchnorm._BatchNorm) == n_bn
    # the ReLUs and adds are separate ops again
    assert _fused(back) == (0, 0) and sum(_fused(ours)) == 0 and by_chain <= sum(COUNTS[name])
    assert not any(isinstance(m, fusion._FusedSequential) for m in back.modules())
    out_ref, gx_ref, grads_ref = _forward_backward(ref, x)
    out, gx, grads = _forward_backward(back, x)
    _assert_close(out, out_ref, 1e-10, "output after revert")
    _assert_close(gx, gx_ref, 1e-10, "grad after revert")
    # and it can be converted again
    again = _fuse(back)
    assert sum(_fused(again)) == sum(COUNTS[name])


# --- the forms of ReLU and add that fuse ------------------------------------------------------

RELUS = {"nn.ReLU": lambda m, t: m.relu(t), "nn.ReLU-inplace": lambda m, t: m.relu_inplace(t),
         "torch.relu": lambda m, t: torch.relu(t), "torch.relu_": lambda m, t: torch.relu_(t),
         "F.relu": lambda m, t: F.relu(t), "F.relu-inplace": lambda m, t: F.relu(t, inplace=True),
         "F.relu_": lambda m, t: F.relu_(t), "Tensor.relu": lambda m, t: t.relu(),
         "Tensor.relu_": lambda m, t: t.relu_()}
ADDS = {"+": lambda a, b: a + b, "+=": None, "torch.add": lambda a, b: torch.add(a, b),
        "Tensor.add": lambda a, b: a.add(b), "Tensor.add_": lambda a, b: a.add_(b),
        "side + bn": lambda a, b: b + a}


class Form(nn.Module):
    def __init__(self, relu, add):
        super().__init__()
        self.bn1, self.bn2 = nn.BatchNorm2d(3), nn.BatchNorm2d(3)
        self.relu, self.relu_inplace = nn.ReLU(), nn.ReLU(inplace=True)
        self.relu_form, self.add_form = relu, add

    def forward(self, x):
        h = RELUS[self.relu_form](self, self.bn1(x))
        out = self.bn2(h * 2)
        if self.add_form == "+=":
            out += h
        else:
            out = ADDS[self.add_form](out, h)
        return RELUS[self.relu_form](self, out)


@pytest.mark.parametrize("add", list(ADDS))
@pytest.mark.parametrize("relu", list(RELUS))
def test_relu_and_add_forms_fuse(relu, add):
    torch.manual_seed(0)
    ref = Form(relu, add).double()
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64)
    ours = _fuse(ref)
    assert _fused(ours) == (1, 1)
    out_ref, gx_ref, grads_ref = _forward_backward(ref, x)
    out, gx, grads = _forward_backward(ours, x)
    _assert_close(out, out_ref, 1e-10, "output")
    _assert_close(gx, gx_ref, 1e-10, "grad")
    for key in grads:
        _assert_close(grads[key], grads_ref[key], 1e-10, key)


def test_relu_output_used_twice_still_fuses():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            y = torch.relu(self.bn(x))
            return y * y + y

    torch.manual_seed(0)
    ref = M().double()
    ours = _fuse(ref)
    assert _fused(ours) == (1, 0)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    _assert_close(ours(x), ref(x), 1e-10, "output")


# --- fallbacks ---------------------------------------------------------------------------------

class Refused(nn.Module):
    def __init__(self, case):
        super().__init__()
        self.bn, self.case = nn.BatchNorm2d(3), case

    def forward(self, x):
        y = self.bn(x)
        if self.case == "bn-used-twice":
            return torch.relu(y) + y
        if self.case == "bn-added-to-itself":
            return torch.relu(y + y)
        if self.case == "sum-used-twice":
            s = y + x
            return torch.relu(s) * s
        if self.case == "inplace-add-into-side":
            side = x * 2
            side.add_(y)
            return torch.relu(side) + side
        if self.case == "input-written-before-relu":
            side = x * 3
            x.mul_(2)
            return torch.relu(y + side)
        if self.case == "add-of-attribute":
            return torch.relu(y + self.bn.bias.view(1, -1, 1, 1))
        raise AssertionError(self.case)


@pytest.mark.parametrize("case,message", [
    ("bn-used-twice", "output is used 2 times"),
    ("bn-added-to-itself", "output is used 2 times"),
    ("sum-used-twice", "sum is used 2 times"),
    ("inplace-add-into-side", "in-place add"),
    ("input-written-before-relu", "write in place between the batch norm and the ReLU"),
    ("add-of-attribute", "computed from parameters"),
])
def test_refused_patterns_fall_back_with_a_warning(case, message):
    torch.manual_seed(0)
    ref = Refused(case).double()
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    with pytest.warns(bt.FusionWarning, match=message):
        ours = bt.convert(copy.deepcopy(ref), fuse=True)
    assert _fused(ours) == (0, 0)
    assert isinstance(ours.bn, bt.BatchNorm2d)  # still converted
    (name, why, refused), = ours.bngrad_fusion_report.unfused
    assert name == "bn" and message in why and refused
    _assert_close(ours(x.clone()), ref(x.clone()), 1e-10, "output")


def test_hooks_and_shared_modules_are_not_fused():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn, self.hooked = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

        def forward(self, x):
            return torch.relu(self.bn(x)) + torch.relu(self.bn(x * 2)) + torch.relu(
                self.hooked(x))

    torch.manual_seed(0)
    ref = Shared().double()
    seen = []
    ref.hooked.register_forward_hook(lambda m, i, o: seen.append(o.min().item()))
    with pytest.warns(bt.FusionWarning, match="forward or backward hooks"):
        ours = bt.convert(copy.deepcopy(ref), fuse=True)
    report = ours.bngrad_fusion_report
    assert report.fused == []
    assert {n: why for n, why, _ in report.unfused}["bn"].startswith("the module is called 2")
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    _assert_close(ours(x), ref(x), 1e-10, "output")
    assert seen[0] < 0 and seen[1] < 0  # the hook saw batch norm's output, not the ReLU's


class DataDependent(nn.Module):
    """A forward fx cannot trace (control flow on a tensor's value) around traceable blocks."""

    def __init__(self):
        super().__init__()
        self.block = TVBlock(3, 3)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return torch.relu(self.bn(self.block(x)))


class TrainingBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = TVBlock(3, 3)
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        if self.training:
            x = x + 1
        return torch.relu(self.bn(self.block(x)))


@pytest.mark.parametrize("cls,why", [(DataDependent, "TraceError"),
                                     (TrainingBranch, "train and eval mode")])
def test_untraceable_forward_fuses_its_children(cls, why):
    torch.manual_seed(0)
    ref = cls().double()
    with pytest.warns(bt.FusionWarning, match="not traced"):
        ours = bt.convert(copy.deepcopy(ref), fuse=True)
    assert type(ours) is cls  # kept; its traceable child became a GraphModule
    assert isinstance(ours.block, fx.GraphModule)
    report = ours.bngrad_fusion_report
    assert [n for n, _ in report.untraced] == [""] and why in report.untraced[0][1]
    assert sorted(n for n, _ in report.fused) == ["block.bn1", "block.bn2"]
    assert isinstance(ours.bn, bt.BatchNorm2d)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for mode in (True, False):
        ref.train(mode)
        ours.train(mode)
        _assert_close(ours(x), ref(x), 1e-10, f"output, training={mode}")
    assert _bngrad_modules(bt.revert(ours)) == []


class Untraceable(nn.Module):
    def forward(self, x):
        return x if x.sum() > 0 else -x


def test_sequential_fuses_bn_relu_pairs_by_its_chain():
    """An nn.Sequential's forward is its chain: [BatchNorm, ReLU] children are fused in place
    (the ReLU's slot a pass-through), untraced, so that it stays an indexable nn.Sequential,
    whatever its other children are."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.ReLU(inplace=True),
                        Untraceable(), nn.BatchNorm2d(3), nn.Identity()).double()
    ours = _fuse(ref)
    assert isinstance(ours, nn.Sequential) and ours.fused_pairs == (("1", "2"),)
    # the class its repr names is public (found by a newcomer's walk through the docs)
    assert isinstance(ours, bt.FusedSequential)
    assert repr(ours).startswith("bngrad.torch.FusedSequential(")
    assert isinstance(ours[1], bt.BatchNorm2d) and isinstance(ours[4], bt.BatchNorm2d)
    report = ours.bngrad_fusion_report
    assert [n for n, _ in report.fused] == ["1"] and report.untraced == []
    assert [(n, refused) for n, _, refused in report.unfused] == [("4", False)]
    x = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    _assert_close(ours(x), ref(x), 1e-10, "output")
    # (found by hostile testing) a slice or the children one by one compute what the
    # original's do: the batch norm's own output before its ReLU
    _assert_close(ours[:2](x), ref[:2](x), 1e-10, "a slice")
    _assert_close(ours[1](ours[0](x)), ref[1](ref[0](x)), 1e-10, "the children one by one")
    back = bt.revert(ours)
    assert type(back) is nn.Sequential and type(back[2]) is nn.ReLU and back[2].inplace
    assert _bngrad_modules(back) == []
    assert list(back.state_dict()) == list(ref.state_dict())
    _assert_close(back(x), ref(x), 1e-10, "output after revert")


def test_nothing_to_fuse_keeps_the_model_class_and_is_quiet():
    ref = nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3), nn.Conv2d(3, 3, 1))
    ours = _fuse(ref)
    assert type(ours) is nn.Sequential and isinstance(ours[1], bt.BatchNorm2d)
    (name, why, refused), = ours.bngrad_fusion_report.unfused
    assert name == "1" and not refused and "not a ReLU" in why
    assert "0 batch norm(s) fused, 1 not" in str(ours.bngrad_fusion_report)


def test_revert_leaves_hand_built_fused_modules_with_a_warning():
    class Hand(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = bt.BatchNormReLU2d(3)

        def forward(self, x):
            return self.bn(x)

    with pytest.warns(bt.FusionWarning, match="bn left as they are"):
        back = bt.revert(Hand())
    assert isinstance(back.bn, bt.BatchNormReLU2d)


def test_bad_arguments():
    with pytest.raises(TypeError, match="argument 'module' must be a torch.nn.Module, got list"):
        bt.convert([nn.BatchNorm2d(3)], fuse=True)
    with pytest.raises(TypeError, match="argument 'module' must be a torch.nn.Module, got str"):
        bt.revert("model")
    with pytest.raises(TypeError, match="argument 'fuse' must be a bool, got int"):
        bt.convert(nn.BatchNorm2d(3), fuse=1)


def test_torch_compile_of_a_fused_model():
    ref, x = _build("torchvision-block", torch.float32, "chlast")
    ours = _fuse(ref)
    eager_out, eager_gx, eager_grads = _forward_backward(ours, x)
    ours = _fuse(ref)  # the same start: the first call moved the running statistics
    compiled = torch.compile(ours, backend="aot_eager")
    out, gx, grads = _forward_backward(compiled, x)
    grads = {key.removeprefix("_orig_mod."): g for key, g in grads.items()}
    assert list(grads) == list(eager_grads)
    _assert_close(out, eager_out, 1e-5, "compiled output")
    _assert_close(gx, eager_gx, 1e-5, "compiled grad")
    for key in grads:
        _assert_close(grads[key], eager_grads[key], 1e-5, key)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_torch_export_of_a_fused_model(mode):
    ref, x = _build("torchvision-block", torch.float32, "contig")
    ref.train(mode == "train")
    exported = torch.export.export(_fuse(ref), (x,))
    targets = {str(n.target) for n in exported.graph.nodes}
    assert "bngrad.batch_norm_relu_forward.default" in targets
    _assert_close(exported.module()(x), _fuse(ref)(x), 1e-5, "exported output")


# --- what an fx graph would not keep: left untraced (found by hostile testing) ---------------

class _ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x))


class _DefaultArg(_ConvBN):
    def forward(self, x, mask=None):
        y = F.relu(self.bn(self.conv(x)))
        return y if mask is None else y * mask


class _NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        with torch.no_grad():
            t = self.frozen(x)
        return F.relu(self.bn(x)) + t


class _Backbone(_ConvBN):
    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))

    def features(self, x):
        return self.forward(x) + 1


class _UsesFeatures(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = _Backbone()

    def forward(self, x):
        if x.sum() > 0:  # untraceable: the backbone is traced on its own
            x = x * 2
        return self.backbone.features(x)


class _ReluOutside(nn.Module):
    def __init__(self):
        super().__init__()
        self.convbn = _ConvBN()

    def forward(self, x):
        return F.relu(self.convbn(x))


class _KeepsFeature(_ConvBN):
    """A block whose parent reads the feature map its forward keeps."""

    def forward(self, x):
        self.feature = h = self.conv(x)
        self.calls = getattr(self, "calls", 0) + 1
        return F.relu(self.bn(h) + x)


class _HasProperty(_ConvBN):
    @property
    def channels(self):
        return self.conv.out_channels

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)) + x)


class _ReadsProperty(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _HasProperty()

    def forward(self, x):
        return self.block(x)[:, :self.block.channels]


class _ReadsFeature(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _KeepsFeature()

    def forward(self, x):
        return self.block(x) + self.block.feature * self.block.calls


class _DrawsPythonRandom(_ConvBN):
    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        return y * 2 if random.random() < 0.5 else y


@pytest.mark.parametrize("make, why", [
    (_DefaultArg, "arguments with default values"),
    (_NoGrad, "uses no_grad"),
    (_UsesFeatures, "methods or properties besides forward (features)"),
    (_ReadsProperty, "methods or properties besides forward (channels)"),
    (_ReadsFeature, "its forward assigns self.feature"),
    (_DrawsPythonRandom, "draws numbers from random"),
])
def test_what_a_graph_would_not_keep_is_not_traced(make, why):
    """A default argument (its `is None` test), a no_grad block, a child's other methods and
    properties, attributes a forward assigns and Python's random numbers are not in an fx
    graph (the last three found by hostile testing: a crash at the first call, a feature map
    frozen at conversion, one branch for ever): such a forward is left as it is, with the
    reason in the report and a warning, and the model computes what the original does."""
    torch.manual_seed(0)
    ref = make().double()
    with pytest.warns(bt.FusionWarning, match=re.escape(why.split(" (")[0])):
        ours = bt.convert(copy.deepcopy(ref), fuse=True)
    assert why in str(ours.bngrad_fusion_report)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for _ in range(2):  # (a second call: what the first left behind is used again)
        random.seed(5)
        out_ref, x_grad_ref, grads_ref = _forward_backward(ref, x)
        random.seed(5)
        out, x_grad, grads = _forward_backward(ours, x)
    _assert_close(out, out_ref, 1e-10, "output")
    _assert_close(x_grad, x_grad_ref, 1e-10, "grad_input")
    assert grads.keys() == grads_ref.keys()
    for name, expected in grads_ref.items():
        if expected is None:
            assert grads[name] is None, name  # (no_grad: the frozen conv gets no gradient)
        else:
            _assert_close(grads[name], expected, 1e-10, name)
    if make is _DefaultArg:
        mask = torch.rand_like(x)
        _assert_close(ours(x, mask), ref(x, mask), 1e-10, "output with a mask")


class _CalledTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def forward(self, x):
        return torch.relu(self.bn(torch.relu(self.bn(x))))


def _shared_in_sequentials():
    bn = nn.BatchNorm2d(3)
    return nn.Sequential(nn.Sequential(bn, nn.ReLU()), nn.Sequential(bn, nn.ReLU()))


class _SharedInForwards(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _ConvBNReLU(), _ConvBNReLU()
        self.b.bn = self.a.bn

    def forward(self, x):
        return self.a(x) + self.b(x)


class _ConvBNReLU(_ConvBN):
    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


@pytest.mark.parametrize("make", [_CalledTwice, _shared_in_sequentials, _SharedInForwards])
def test_a_relu_after_a_batch_norm_called_twice_or_shared_warns(make):
    """docs/torch.md: a batch norm called more than once or shared by two paths is left
    unfused, with a warning when a ReLU follows it (there was none: found by hostile
    testing); the model computes what the original does."""
    torch.manual_seed(0)
    ref = make().double()
    with pytest.warns(bt.FusionWarning, match="called 2 times|the same module is also"):
        ours = bt.convert(copy.deepcopy(ref), fuse=True)
    report = ours.bngrad_fusion_report
    assert report.fused == [] and report.needs_attention
    assert all(refused for _, _, refused in report.unfused)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    _assert_close(ours(x), ref(x), 1e-10, "output")


def test_a_batch_norm_called_twice_or_shared_without_a_relu_is_quiet():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.bn(x) * 2)
    bn = nn.BatchNorm2d(3)
    shared = nn.Sequential(nn.Sequential(bn, nn.Tanh()), nn.Sequential(bn, nn.Tanh()))
    for model in (Twice(), shared):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = bt.convert(model, fuse=True)
        assert not ours.bngrad_fusion_report.needs_attention


def test_a_relu_in_the_callers_forward_is_not_fused_quietly():
    """A ReLU applied by the caller to what a module's forward returns is not fused (the
    module called alone would apply it), and nothing is wrong with that: no warning."""
    torch.manual_seed(0)
    ref = _ReluOutside().double()
    ours = _fuse(ref)
    (name, why, refused), = ours.bngrad_fusion_report.unfused
    assert name == "convbn.bn" and "what the forward returns" in why and not refused
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    _assert_close(ours(x), ref(x), 1e-10, "output")
    _assert_close(ours.convbn(x), ref.convbn(x), 1e-10, "the child called alone")


class _Residual(nn.Module):
    def __init__(self, add="+"):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3)
        self.add = add

    def forward(self, x):
        out = self.bn(self.conv(x))
        if self.add == "+=":
            out += x
        elif self.add == "add_":
            out = out.add_(x)
        elif self.add == "+":
            out = out + x
        else:  # a side input that broadcasts
            out = out + x.mean()
        return torch.relu(out)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.scale = _Residual(), 1.0

    def forward(self, x):
        return self.block(x) * self.scale


def test_only_the_module_that_calls_the_batch_norm_is_rewritten():
    """(Found by hostile testing.) Fusing used to rewrite the outermost traceable forward,
    with every child's code inlined: the children then held fused modules that their own
    forward called with one argument (a block called alone raised TypeError), hooks
    registered later on a child never ran, the outer modules' attributes were frozen into
    the graph, an nn.Sequential lost its indexing, and the model object passed in (whose
    children convert changes in place) no longer ran."""
    torch.manual_seed(0)
    ref = nn.Sequential(TVBlock(3, 3), _Holder()).double()
    keep = copy.deepcopy(ref)
    block = ref[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", bt.FusionWarning)
        ours = bt.convert(ref, fuse=True)
    assert type(ours) is nn.Sequential and isinstance(ours[0], fx.GraphModule)
    assert type(ours[1]) is _Holder and isinstance(ours[1].block, fx.GraphModule)
    assert _fused(ours) == (1, 2)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    for i in range(2):  # each child alone, as a feature extractor calls it
        _assert_close(ours[i](x), keep[i](x), 1e-10, f"child {i} alone")
    _assert_close(block(x), keep[0](x), 1e-10, "the block object that was converted")
    seen = []
    ours[1].block.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    ours[1].scale = keep[1].scale = 0.5
    _assert_close(ours(x), keep(x), 1e-10, "output after a parent's attribute changed")
    assert seen == [x.shape]


# the sum's dtype under autocast: a bfloat16 batch norm output plus a float32 shortcut
# promotes, added in place it stays bfloat16 (fx's own tracing recorded `out += x` as
# `out = out + x`: found by hostile testing)
SUM_DTYPE = {"+": torch.float32, "+=": torch.bfloat16, "add_": torch.bfloat16,
             "broadcast": torch.bfloat16}


@pytest.mark.parametrize("add", list(SUM_DTYPE))
def test_side_inputs_of_another_dtype_or_shape_run_unfused(add):
    """(Found by hostile testing.) Under autocast a residual block adds a bfloat16 batch norm
    output and a float32 shortcut, and a side input may broadcast: convert's fused module runs
    batch norm, the add as traced and the ReLU unfused then, instead of refusing the side
    input; revert puts that add back."""
    torch.manual_seed(0)
    ref = _Residual(add)
    ours = _fuse(ref)
    assert _fused(ours) == (0, 1)
    x = torch.randn(2, 3, 5, 5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, gx_ref, grads_ref = _forward_backward(ref, x)
        out, gx, grads = _forward_backward(ours, x)
        out_back = bt.revert(ours)(x)
    assert out.dtype == out_back.dtype == out_ref.dtype == SUM_DTYPE[add]
    _assert_close(out.float(), out_ref.float(), 1e-2, "output")
    _assert_close(gx, gx_ref, 2e-2, "grad of the input")
    for key in grads:
        _assert_close(grads[key], grads_ref[key], 2e-2, key)
    if add == "broadcast":  # and without autocast
        ref, ours = ref.double(), _fuse(ref.double())
        x = x.double()
        _assert_close(ours(x), ref(x), 1e-10, "broadcast side input, float64")


def test_sync_batchnorm_conversion_of_fused_models():
    """(Found by hostile testing.) SyncBatchNorm.convert_sync_batchnorm replaced a fused
    module by a plain SyncBatchNorm, dropping its ReLU (wrong outputs, silently). A model
    fused by convert keeps bngrad's batch norms in its tree, whose fused calls run a
    SyncBatchNorm put there unfused, ReLU and all; a fused module built by hand is refused."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), _Residual()).double()
    fused = _fuse(ref)
    assert _fused(fused) == (1, 1)
    sync = bt.SyncBatchNorm.convert_sync_batchnorm(fused)
    assert isinstance(sync[1], bt.SyncBatchNorm) and isinstance(sync[3].bn, bt.SyncBatchNorm)
    x = torch.randn(2, 3, 7, 7, dtype=torch.float64)
    _assert_close(sync(x), ref(x), 1e-10, "output")
    hand = nn.Sequential(nn.Conv2d(3, 4, 3), bt.BatchNormReLU2d(4))
    with pytest.raises(ValueError, match=r"1 is a fused batch norm .*convert\(model, fuse=True\)"):
        bt.SyncBatchNorm.convert_sync_batchnorm(hand)
    assert isinstance(hand[1], bt.BatchNormReLU2d)  # nothing changed


def test_a_batch_norm_reachable_by_two_names_is_converted_once():
    for convert in (bt.convert, bt.SyncBatchNorm.convert_sync_batchnorm, bt.revert):
        model = nn.Module()
        model.a = nn.BatchNorm2d(3) if convert is not bt.revert else bt.BatchNorm2d(3)
        model.b = model.a
        model = convert(model)
        assert model.a is model.b and type(model.a) is not nn.Module, convert
        assert type(model.a).__module__.startswith(
            "torch" if convert is bt.revert else "bngrad"), convert


def test_convert_keeps_every_kind_of_hook():
    """Hooks with kwargs, full backward hooks, state_dict hooks on a batch norm survive
    convert (fuse or not) and revert, and the handles taken before convert still remove
    them (the converted module shares the original's hook dictionaries)."""
    seen = []
    for fuse in (False, True):
        torch.manual_seed(0)
        seen.clear()
        ref = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU()).double()
        bn = ref[1]
        handle = bn.register_forward_hook(lambda m, args, kwargs, out: seen.append("fwd"),
                                          with_kwargs=True)
        bn.register_full_backward_hook(lambda m, gi, go: seen.append("bwd"))
        bn.register_state_dict_post_hook(lambda m, sd, prefix, meta: sd.__setitem__(
            prefix + "extra", torch.zeros(1)))
        with warnings.catch_warnings():  # (fuse: hooks on the BN, so not fused, said)
            warnings.simplefilter("ignore", bt.FusionWarning)
            ours = bt.convert(ref, fuse=fuse)
        assert "1.extra" in ours.state_dict()
        x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
        ours(x).sum().backward()
        assert seen == ["fwd", "bwd"], (fuse, seen)
        handle.remove()
        ours(x).sum().backward()
        assert seen == ["fwd", "bwd", "bwd"], (fuse, seen)
        back = bt.revert(ours)
        assert type(back[1]) is nn.BatchNorm2d and "1.extra" in back.state_dict()


def test_an_in_place_write_between_through_a_view_is_not_fused():
    class Alias(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def forward(self, h, side):
            out = self.bn(h)
            h.view(-1).mul_(2)
            return F.relu(out + side)

    torch.manual_seed(0)
    ref = Alias().double().eval()
    with pytest.warns(bt.FusionWarning, match="write in place between"):
        ours = bt.convert(copy.deepcopy(ref), fuse=True)
    h, side = (torch.randn(2, 3, 4, 4, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        _assert_close(ours(h.clone(), side), ref(h.clone(), side), 1e-10, "output")


# --- found by hostile testing of the one-module-at-a-time pass --------------------------------

class _Blk(nn.Module):
    expansion = 4

    def __init__(self):
        super().__init__()
        self.bn, self.scale = nn.BatchNorm2d(4), 0.5

    def forward(self, x):
        return torch.relu(self.bn(x))


class _CallsGrandchild(nn.Module):
    """Its forward calls its child's batch norm directly: that call must stay batch norm."""

    def __init__(self):
        super().__init__()
        self.b = _Blk()

    def forward(self, x):
        return self.b(x) + self.b.bn(x) * self.b.scale * self.b.expansion


class _WritesThroughAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x, acc):
        y = F.relu(self.bn(x)) * 1.0
        v = y.narrow(1, 0, 2)
        v += 1.0  # writes into y
        acc += y.sum()  # and into the caller's tensor
        return y


class _LeafWritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)
        self.sc = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(4, 4, 1))

    def forward(self, x):
        h = self.c(x)
        out = self.bn(h)
        return F.relu(out + self.sc(h))


class _SharedBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        self.child = nn.Sequential(self.bn)

    def forward(self, x):
        return F.relu(self.bn(x) + self.child(x * 2))


class _NoGradHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def _scale(self, t):
        with torch.no_grad():
            return t.abs().mean() + 1

    def forward(self, x):
        return F.relu(self.bn(x) + x * self._scale(x))


class _ReluHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.relu = nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x):
        return self.relu(self.bn(x))


class _MySeq(nn.Sequential):
    pass


class _UsesMySeq(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = _MySeq(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU())

    def forward(self, x):
        return self.s[0](x) + self.s(x) * len(self.s)


class _TensorAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn, self.t = nn.BatchNorm2d(4), torch.full((4, 1, 1), 2.0, dtype=torch.float64)

    def forward(self, x):
        return F.relu(self.bn(x * self.t * torch.tensor(2.0, dtype=torch.float64)))


def _doubled(t):
    with torch.no_grad():
        return t * 2


class _NoGradFunction(_ReluHook):
    def forward(self, x):
        return self.relu(self.bn(x)) + _doubled(x) + self._tripled(x)

    @staticmethod
    def _tripled(t):
        return t * 3


class _Act(nn.Module):
    def forward(self, t):
        return t.mul_(2)


class _WritesAnAncestor(nn.Module):
    """A module writes into the tensor the batch norm's input is a view of, between the
    batch norm's call and its ReLU (where the fused call runs)."""

    def __init__(self):
        super().__init__()
        self.bn, self.act = nn.BatchNorm2d(4), _Act()

    def forward(self, x):
        x = x * 1
        out = self.bn(x[:, :4])
        y = self.act(x)
        return torch.cat([torch.relu(out), y], 1)


class _AtenWrite(_ReluHook):
    def forward(self, x):
        x = x * 1
        out = self.bn(x)
        torch.ops.aten.mul_.Tensor(x, torch.tensor(2.0, dtype=x.dtype))
        return self.relu(out) + x


class _ReadsStatistics(_ReluHook):
    def forward(self, x):
        out = self.bn(x)
        m = self.bn.running_mean.sum()
        return self.relu(out) + m


class _FrozenBN(_ReluHook):
    def forward(self, x):
        out = self.bn(x)
        if self.training and not self.bn.training:
            out = out.detach()
        return self.relu(out)


class _Prep(nn.Module):
    def prep(self, t):
        with torch.no_grad():
            return t * 2


class _NoGradInBase(_Prep):
    """no_grad reached through super(), and a read of the grad mode: fx records neither."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        scale = 1.0 if torch.is_grad_enabled() else 0.5
        return torch.relu(self.bn(x) + super().prep(x) * scale)


class _PowView(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        v = y[:, :2]
        v **= 2  # writes into y
        return torch.relu(self.bn(y))


class _ClampBN(nn.BatchNorm2d):
    def forward(self, input):
        input.clamp_(-0.5, 0.5)
        return super().forward(input)


class _SubclassBetween(_LeafWritesInput):
    """The module between: a user's subclass of batch norm that writes into its input."""

    def __init__(self):
        super().__init__()
        self.sc = _ClampBN(4)


class _InPlaceReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(x), inplace=True)


class _Clip(nn.Module):
    def __init__(self, w):
        super().__init__()
        self.w = w

    def forward(self, t):
        self.w.data.clamp_(max=1.0)
        return t


class _TiedClip(nn.Module):
    """A module between the batch norm and the add writes into the batch norm's weight."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)
        self.clip = _Clip(self.bn.weight)
        nn.init.constant_(self.bn.weight, 2.0)

    def forward(self, x):
        out = self.bn(x)
        return torch.relu(out + self.clip(x * 2))


class _SideFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        side = x.contiguous() * 2
        return torch.relu(side + self.bn(x)).view(x.shape[0], -1)


ONE_MODULE_CASES = {  # model -> (fused (BN+ReLU, BN+add+ReLU), a reason the report gives)
    _CallsGrandchild: ((1, 0), None),
    _WritesThroughAView: ((1, 0), None),
    _LeafWritesInput: ((0, 0), "may write in place between"),
    _SharedBN: ((0, 0), "the same module is also child.0"),
    _NoGradHelper: ((0, 0), "its _scale uses no_grad"),
    _ReluHook: ((1, 0), None),
    _UsesMySeq: ((0, 0), "nn.Sequential subclass _MySeq is kept"),
    _TensorAttribute: ((1, 0), None),
    _NoGradFunction: ((0, 0), "its _doubled uses no_grad"),
    _WritesAnAncestor: ((0, 0), "may write in place between"),
    _AtenWrite: ((0, 0), "may write in place between"),
    _ReadsStatistics: ((0, 0), "reads its state between"),
    _FrozenBN: ((0, 0), "reads a training flag"),
    _NoGradInBase: ((0, 0), "is_grad_enabled"),
    _PowView: ((1, 0), None),
    _SubclassBetween: ((0, 0), "may write in place between"),
    _InPlaceReLU: ((1, 0), None),
    _TiedClip: ((0, 0), "may write in place between"),
    _SideFirst: ((0, 1), None),
}


@pytest.mark.parametrize("make", list(ONE_MODULE_CASES), ids=lambda m: m.__name__)
def test_what_only_a_module_of_its_own_sees(make):
    """A parent calling its child's batch norm, a write into a view or an argument, a leaf
    module that may write into batch norm's input, a batch norm shared with another module,
    no_grad in a method forward calls, a hook put on the ReLU later, a Sequential subclass,
    a tensor attribute and a tensor made in forward: each fused only where that keeps every
    number, the reason said where not, attributes and hooks as before."""
    torch.manual_seed(0)
    ref = make().double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", bt.FusionWarning)
        given = copy.deepcopy(ref)
        ours = bt.convert(given, fuse=True)
    expected, reason = ONE_MODULE_CASES[make]
    assert _fused(ours) == expected
    report = ours.bngrad_fusion_report
    if reason is not None:
        assert any(reason in why for _, why, _ in report.unfused) or any(
            reason in why for _, why in report.untraced), str(report)
    seen = []
    if make is _InPlaceReLU:  # a hook keeps the batch norm's output, which the ReLU changes
        ours.bn.register_forward_hook(lambda m, i, o: seen.append(o))
        ref.bn.register_forward_hook(lambda m, i, o: seen.append(o))
    if make is _ReluHook:
        ours.relu.register_forward_hook(lambda m, i, o: seen.append("ours"))
        ref.relu.register_forward_hook(lambda m, i, o: seen.append("ref"))
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64)
    for mode in ("train", "eval"):
        ref.train(mode == "train")
        ours.train(mode == "train")
        if make is _FrozenBN:  # a frozen batch norm in a training model: no gradient
            ref.bn.eval()
            ours.bn.eval()
            xg = x.clone().requires_grad_()
            out, out_ref = ours(xg), ref(xg)
            assert out.requires_grad == out_ref.requires_grad
            _assert_close(out.detach(), out_ref.detach(), 1e-10, f"output ({mode})")
            continue
        if make is _SideFirst:  # channels_last x: the sum takes the side input's layout
            xc = x.to(memory_format=torch.channels_last)
            _assert_close(ours(xc), ref(xc), 1e-10, f"output, channels_last ({mode})")
        if make in (_LeafWritesInput, _WritesAnAncestor, _AtenWrite, _PowView,
                    _SubclassBetween):  # (backward raises)
            with torch.no_grad():
                _assert_close(ours(x.clone()), ref(x.clone()), 1e-10, f"output ({mode})")
            continue
        if make is _WritesThroughAView:
            acc_ref, acc = (torch.zeros((), dtype=torch.float64) for _ in range(2))
            _assert_close(ours(x, acc), ref(x, acc_ref), 1e-10, f"output ({mode})")
            _assert_close(acc, acc_ref, 1e-10, f"the argument written ({mode})")
            continue
        out_ref, gx_ref, grads_ref = _forward_backward(ref, x)
        out, gx, grads = _forward_backward(ours, x)
        _assert_close(out, out_ref, 1e-10, f"output ({mode})")
        _assert_close(gx, gx_ref, 1e-10, f"grad of the input ({mode})")
        for key in grads_ref:
            _assert_close(grads[key], grads_ref[key], 1e-10, f"{key} ({mode})")
    for (key, v), v_ref in zip(ours.state_dict().items(), ref.state_dict().values()):
        _assert_close(v.double(), v_ref.double(), 1e-10, key)
    if make is _ReluHook:
        assert seen.count("ours") == seen.count("ref") == 2
    if make is _InPlaceReLU:  # (the fused call skipped the hook before: see the global one)
        assert all(float(o.min()) >= 0 for o in seen) and len(seen) == 4
    if make is _CallsGrandchild:  # a rewritten block keeps its numbers for its callers
        assert ours.b.scale == 0.5 and ours.b.expansion == 4
    if make is _TensorAttribute:  # fx's constants stay off the module given to convert
        assert not [k for k in vars(given) if k.startswith("_tensor_constant")]


def test_global_hooks_run_the_modules_one_by_one():
    """(Found by hostile testing.) A hook registered for every module
    (register_module_forward_hook) expects the batch norm's own output: the fused call
    skipped it."""
    torch.manual_seed(0)
    ref = _ReluHook().double()
    ours = _fuse(ref)
    assert _fused(ours) == (1, 0)
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: o * 2 if isinstance(m, nn.modules.batchnorm._BatchNorm) else None)
    try:
        x = torch.randn(2, 4, 3, 3, dtype=torch.float64)
        _assert_close(ours(x), ref(x), 1e-10, "output with a global hook")
    finally:
        handle.remove()


def test_a_converted_model_traces_and_converts_again():
    """(Found by hostile testing.) fx.symbolic_trace of a converted model failed in bngrad's
    batch norm (not a leaf of fx's default tracer: its input checks ran on proxies); a second
    convert of a fused model said its batch norms were not called."""
    torch.manual_seed(0)
    ref, x = _build("torchvision-block", torch.float64, "contig")
    ref.eval()
    for model in (bt.convert(copy.deepcopy(ref)), _fuse(ref)):
        traced = fx.symbolic_trace(model)
        _assert_close(traced(x), ref(x), 1e-10, "traced converted model")
    again = bt.convert(_fuse(ref), fuse=True)
    report = again.bngrad_fusion_report
    assert len(report.fused) == sum(COUNTS["torchvision-block"])
    assert [name for name, _, _ in report.unfused] == ["layer1.1.downsample.1"]
    assert all(how.startswith("fused already") for _, how in report.fused)
    _assert_close(again(x), ref(x), 1e-10, "converted twice")


_SEEN = []


def _count_call(module, args, output):  # (a hook that pickles: a module-level function)
    _SEEN.append(type(module).__name__)


def test_copies_and_pickles_keep_a_rewritten_modules_hooks_and_attributes():
    """(Found by hostile testing.) GraphModule's own deepcopy and pickling rebuild the module
    from its code and kept neither its forward hooks nor its plain attributes."""
    torch.manual_seed(0)
    ref = TVBlock(3, 3).double()
    ours = _fuse(ref)
    ours.tag = "block"
    ours.register_forward_hook(_count_call)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    buffer.seek(0)
    for copied in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours)),
                   torch.load(buffer, weights_only=False)):
        _SEEN.clear()
        _assert_close(copied(x), ours(x), 1e-12, "output of the copy")
        assert len(_SEEN) == 2 and copied.tag == "block"
        assert copied.bngrad_fusion_report.fused == ours.bngrad_fusion_report.fused


@pytest.mark.parametrize("fuse", [False, True])
def test_a_permuted_input_gives_pytorchs_layouts(fuse):
    """(Found by hostile testing.) A batch norm on a permuted input that is not channels_last
    ((N, L, C) tokens transposed to (N, C, L)) kept that layout in its output, where PyTorch's
    is contiguous: a .view after it failed. The gradient keeps the input's layout, as
    PyTorch's."""
    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return torch.relu(self.bn(x.transpose(1, 2))).view(x.shape[0], -1)

    torch.manual_seed(0)
    ref = Tokens().double()
    ours = bt.convert(copy.deepcopy(ref), fuse=fuse)
    assert _fused(ours) == ((1, 0) if fuse else (0, 0))
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    out_ref, gx_ref, grads_ref = _forward_backward(ref, x)
    out, gx, grads = _forward_backward(ours, x)
    _assert_close(out, out_ref, 1e-10, "output")
    _assert_close(gx, gx_ref, 1e-10, "grad of the input")
    assert gx.stride() == gx_ref.stride()
    for key in grads_ref:
        _assert_close(grads[key], grads_ref[key], 1e-10, key)
