"""`bngrad precompile` leaves nothing for a first call to compile."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bngrad import cli
from bngrad._precompile import precompile
from bngrad.errors import ArgumentValueError

# Calls of another shape than precompile's own, over every layout and mode, writable and
# read-only: they must find every kernel compiled already.
_SECOND_PROCESS = textwrap.dedent("""
    import numpy as np, bngrad
    rng = np.random.default_rng(1)
    def calls(x, dy, read_only):
        x.flags.writeable = dy.flags.writeable = not read_only
        C = x.shape[1]
        w = np.full(C, 2.0, x.dtype)
        rm, rv = np.zeros(C, x.dtype), np.ones(C, x.dtype)
        y, m, s = bngrad.batch_norm_forward(x, w, None, rm, rv, True)
        bngrad.batch_norm_forward(x, w, None, rm, rv, False)
        bngrad.batch_norm_backward(dy, x, w, None, None, m, s)
        bngrad.batch_norm_backward(dy, x, w, rm, rv, train=False)
        bngrad.batch_norm_moments(x)
    for shape in [(32, 16, 7, 7), (4096, 3), (3, 5, 300), (16, 300), (2, 64, 17, 17)]:
        for read_only in (False, True):
            x = rng.standard_normal(shape).astype(np.float32)
            calls(x, rng.standard_normal(shape).astype(np.float32), read_only)
    nhwc = np.moveaxis(rng.standard_normal((8, 8, 8, 16)).astype(np.float32), -1, 1)
    calls(nhwc, nhwc.copy(), False)
    calls(nhwc, np.ascontiguousarray(nhwc), False)
""")


def _cache_files(cache: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*.nb*")}


def test_precompiled_cache_serves_a_new_process(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "bngrad", "precompile", "--dtype", "float32"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "float32" in done.stdout and "done in" in done.stdout
    before = _cache_files(tmp_path)
    assert before
    second = subprocess.run([sys.executable, "-c", _SECOND_PROCESS], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stderr
    after = _cache_files(tmp_path)
    compiled_again = sorted(p.name for p in after if before.get(p) != after[p])
    assert compiled_again == []


def test_precompile_names_a_bad_dtype(capsys):
    with pytest.raises(ArgumentValueError, match="dtypes: .*'int8'"):
        precompile(["int8"])
    with pytest.raises(SystemExit):
        cli.main(["precompile", "--dtype", "int8"])
    assert "invalid choice" in capsys.readouterr().err


def _loaded_kernels() -> dict:
    """How many compiled versions each of bngrad's kernels has in this process."""
    from numba.core.dispatcher import Dispatcher

    from bngrad.kernels import _launch, batchnorm
    return {(module.__name__, name): len(value.overloads) for module in (batchnorm, _launch)
            for name, value in vars(module).items() if isinstance(value, Dispatcher)}


def _fused_numpy_calls(rng, np) -> None:
    from bngrad import fused
    masks = ((True,) * 4, (True, True, True, False), (False, True, True, False))
    for shape, layout in [((32, 16, 7, 7), "c"), ((4096, 3), "c"), ((3, 5, 300), "c"),
                          ((2, 64, 17, 17), "c"), ((8, 64, 12, 12), "nhwc")]:
        for read_only in (False, True):
            x = rng.standard_normal(shape).astype(np.float32)
            if layout == "nhwc":
                x = np.moveaxis(np.ascontiguousarray(np.moveaxis(x, 1, -1)), -1, 1)
            like, c_order = np.empty_like(x), np.empty(shape, np.float32)
            like[...] = c_order[...] = rng.standard_normal(shape)
            for a in (x, like, c_order):
                a.flags.writeable = not read_only
            w = np.full(shape[1], 2.0, np.float32)
            for train in (True, False):
                rm, rv = np.zeros(shape[1], np.float32), np.ones(shape[1], np.float32)
                for side in (None, like, c_order):
                    for record in ("bits", "bytes", None):
                        y, m, s, mask = fused.batch_norm_relu_forward(
                            x, w, None, rm, rv, train, side_input=side, mask_format=record)
                        for output_mask in masks:
                            fused.batch_norm_relu_backward(
                                like, x, w, rm, rv, m if train else None, s if train else None,
                                train, output_mask=output_mask, relu_mask=mask,
                                output=y if mask is None else None)
                y, m, s, _ = fused.batch_norm_relu_forward(x, w, None, rm, rv, train,
                                                           side_input=like, activation="none")
                fused.batch_norm_relu_backward(like, x, w, rm, rv, m if train else None,
                                               s if train else None, train, activation="none")


def _fused_torch_calls() -> None:
    """bngrad.torch's fused layers in a training step and in eval, NCHW and channels-last,
    with and without a residual, the first layer's input not requiring grad."""
    torch = pytest.importorskip("torch")
    import bngrad.torch as bt
    for fmt in (torch.contiguous_format, torch.channels_last):
        for module in (bt.BatchNormReLU2d(16), bt.BatchNormAddReLU2d(16)):
            for train, needs_grad in ((True, True), (True, False), (False, True)):
                module.train(train)
                x = torch.randn(32, 16, 7, 7).contiguous(memory_format=fmt)
                x.requires_grad_(needs_grad)
                if isinstance(module, bt.BatchNormAddReLU2d):
                    side = torch.randn(32, 16, 7, 7).contiguous(memory_format=fmt)
                    out = module(x, side.requires_grad_())
                else:
                    out = module(x)
                out.sum().backward()


def test_precompile_fused_leaves_nothing_for_fused_calls():
    """(Found by a newcomer, and its first fix's gaps by review.) `bngrad precompile` compiled
    no kernel of the fused forms, whose first calls then compiled for 9-18 s each. With
    ``fused``, fused calls of other shapes than precompile's own load no kernel it has not
    loaded: every ReLU record, side input in input's layout or another, no side input, no
    activation, output masks with and without grad_side_input and grad_input, NCHW and
    channels-last, writable and read-only, training and eval, and bngrad.torch's fused layers
    (the cache on disk is the suite's, so this checks coverage, not the time;
    test_precompiled_cache_serves_a_new_process checks the cache)."""
    import numpy as np

    precompile(["float32"], fused=True)
    before = _loaded_kernels()
    _fused_numpy_calls(np.random.default_rng(2), np)
    _fused_torch_calls()
    loaded = _loaded_kernels()
    assert {k: v for k, v in loaded.items() if v != before.get(k, 0)} == {}
