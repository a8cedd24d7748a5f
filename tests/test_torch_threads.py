"""bngrad.torch follows torch.get_num_threads(): every call into the NumPy API passes it, and a
forked child that set torch.set_num_threads(1) (as a DataLoader worker does) completes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

import bngrad  # noqa: E402
import bngrad.torch as bt  # noqa: E402
from bngrad.torch import _eager  # noqa: E402

CORE_CALLS = ["batch_norm_forward", "batch_norm_backward", "batch_norm_backward_reduce",
              "batch_norm_backward_elemt", "batch_norm_moments"]


@pytest.fixture
def recorded(monkeypatch):
    """{core function name: [num_threads of each call]}, with the real functions still run."""
    calls = {name: [] for name in CORE_CALLS}
    for name in CORE_CALLS:
        real = getattr(bngrad, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name].append(kwargs.get("num_threads"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(bngrad, name, spy)
    return calls


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("path", ["eager", "op"])
def test_calls_pass_torchs_thread_count(recorded, one_thread, monkeypatch, path):
    if path == "op":  # as under torch.compile / torch.export
        monkeypatch.setattr(_eager, "applies", lambda input: False)
    x = torch.randn(4, 3, 5, requires_grad=True)
    w = torch.ones(3, requires_grad=True)
    model_out = bt.batch_norm(x, torch.zeros(3), torch.ones(3), w, torch.zeros(3), True)
    model_out.square().sum().backward()
    assert recorded["batch_norm_forward"] == [1]
    assert recorded["batch_norm_backward"] == [1]


def test_sync_halves_and_moments_pass_torchs_thread_count(recorded, one_thread):
    x, dy = torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    mean, var = torch.ops.bngrad.batch_norm_moments(x)
    invstd = (var + 1e-5).rsqrt()
    w = torch.ones(3, dtype=torch.float64)
    x64, dy64 = x.double(), dy.double()
    sum_dy, sum_dy_xmu, _, _ = torch.ops.bngrad.batch_norm_backward_reduce(
        dy64, x64, mean, invstd, w, True, True, True)
    torch.ops.bngrad.batch_norm_backward_elemt(dy64, x64, mean, invstd, w, sum_dy, sum_dy_xmu,
                                                torch.tensor([20]))
    assert recorded["batch_norm_moments"] == [1]
    assert recorded["batch_norm_backward_reduce"] == [1]
    assert recorded["batch_norm_backward_elemt"] == [1]


def test_thread_count_follows_changes(recorded):
    before = torch.get_num_threads()
    x = torch.randn(4, 3)
    try:
        for n in (1, 2, 1):
            torch.set_num_threads(n)
            bt.batch_norm(x, None, None, training=True)
    finally:
        torch.set_num_threads(before)
    assert recorded["batch_norm_forward"] == [1, 2, 1]


def test_forked_child_with_one_thread_completes():
    # In a fresh interpreter: the parent runs bngrad.torch on all its threads, then forks; the
    # child does what a DataLoader worker does (one thread) and runs forward and backward.
    code = textwrap.dedent("""
        import os, sys, time
        import torch, bngrad.torch as bt

        def step():
            x = torch.randn(16, 8, 12, 12, requires_grad=True)
            m = bt.BatchNorm2d(8)
            m(x).square().sum().backward()
            return bool(torch.isfinite(x.grad).all())

        assert step()
        pid = os.fork()
        if pid == 0:
            torch.set_num_threads(1)
            os._exit(0 if step() and step() else 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                print("child exit", os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            print("child hung")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "child exit 0", (result.stdout, result.stderr)
