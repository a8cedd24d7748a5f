"""Large results of bngrad.torch come in memory advised to be huge pages (bngrad.torch._convert.
empty_like): PyTorch's allocator hands out fresh 4 KiB pages for every tensor above glibc's
mmap threshold, and faulting them in cost as much as the batch norm itself."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

import bngrad.torch as bt  # noqa: E402
from bngrad.torch import _convert  # noqa: E402

LARGE = (2, 4, 512, 512)  # 8 MiB of float32: above the 4 MiB threshold
SMALL = (2, 4, 16, 16)


@pytest.fixture
def advised(monkeypatch):
    """The (start, length) of every madvise(MADV_HUGEPAGE) bngrad.torch makes."""
    calls = []

    def record(start, length, advice):
        assert advice == _convert._MADV_HUGEPAGE
        calls.append((start, length))
        return 0
    monkeypatch.setattr(_convert, "_madvise", record)
    return calls


def _covers(calls, tensor):
    """Whether one advice covers the whole pages of ``tensor``'s storage."""
    start, size = tensor.data_ptr(), tensor.untyped_storage().nbytes()
    page = _convert._PAGE
    first, end = -(-start // page) * page, (start + size) // page * page
    return any(s == first and s + n == end and s % page == 0 for s, n in calls)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_large_forward_output_and_grad_input_are_advised(advised, memory_format):
    torch.manual_seed(0)
    x = torch.randn(LARGE).contiguous(memory_format=memory_format).requires_grad_()
    ours, theirs = bt.BatchNorm2d(4), torch.nn.BatchNorm2d(4)
    y = ours(x)
    assert _covers(advised, y)
    y.backward(torch.ones_like(y))
    assert _covers(advised, x.grad) and len(advised) == 2
    assert y.is_contiguous(memory_format=memory_format)
    assert x.grad.is_contiguous(memory_format=memory_format)
    # the numbers are PyTorch's in float64 (the memory is only advised, never changed)
    xt = x.detach().double().requires_grad_()
    yt = theirs.double()(xt)
    yt.backward(torch.ones_like(yt))
    torch.testing.assert_close(y.double(), yt, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xt.grad, rtol=1e-5, atol=1e-5)


def test_fused_outputs_are_advised(advised):
    x = torch.randn(LARGE, requires_grad=True)
    side = torch.randn(LARGE, requires_grad=True)
    y = bt.BatchNormAddReLU2d(4)(x, side)
    y.backward(torch.ones_like(y))
    for tensor in (y, x.grad):
        assert _covers(advised, tensor)


def test_small_results_make_no_system_call(advised):
    x = torch.randn(SMALL, requires_grad=True)
    bt.BatchNorm2d(4)(x).sum().backward()
    assert advised == []


def test_advice_is_skipped_without_madvise(monkeypatch):
    monkeypatch.setattr(_convert, "_madvise", None)
    x = torch.randn(LARGE)
    out = _convert.empty_like(x)
    assert out.shape == x.shape and out.stride() == x.stride() and out.dtype == x.dtype


def test_fake_tensors_are_not_advised(advised):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        out = _convert.output_like(torch.empty(LARGE))
    assert advised == [] and out.shape == LARGE


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="no transparent huge pages in this kernel (not Linux, or built "
                           "without them): the advice is refused, nothing to see")
def test_the_kernel_records_the_advice():
    """Against the operating system itself: the mapping holding a large result carries the
    huge-page advice flag ("hg" in /proc/self/smaps's VmFlags)."""
    out = _convert.empty_like(torch.empty(32 << 20, dtype=torch.uint8))
    address = -(-out.data_ptr() // _convert._PAGE) * _convert._PAGE
    flags = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
                break
    assert flags is not None, "no mapping holds the tensor"
    assert "hg" in flags
