"""`bngrad precompile --fused` leaves nothing for a fused call to compile (a file of its own:
on an empty cache it compiles for a minute or two, which pytest-xdist can then schedule apart
from test_precompile.py's fresh-cache run)."""

import pytest

from bngrad._precompile import precompile


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
