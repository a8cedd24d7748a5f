"""The contenders timed on each case: bngrad, PyTorch, the NumPy reference and the floor
(batch norm's backward), or bngrad's fused pair, PyTorch's unfused sequence, the reference and
bngrad's plain batch norm (the fused ops, forward + backward).

Each is a factory ``(data, threads, options) -> callable``; a factory raises
:class:`Unavailable`, with the reason shown to the user, when its contender cannot run here.
Every callable returns a tuple whose first item is grad_input (compared across contenders).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Tuple

import bngrad
from bngrad import reference

from .arrays import CaseData
from .floor import make_floor

if TYPE_CHECKING:
    from .results import Options

EPS = 1e-5


class Unavailable(Exception):
    """A contender cannot run here; the message says why (shown to the user)."""


def import_torch():
    """(torch, from_numpy) or Unavailable; one place, so tests can pretend torch is missing."""
    try:
        import torch
        from bngrad.torch._convert import from_numpy
    except ImportError as exc:
        raise Unavailable("PyTorch is not installed (pip install '.[torch]' in bngrad's clone "
                          f"to compare against it): {exc}") from None
    return torch, from_numpy


def _bngrad(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    fn, d = bngrad.batch_norm_backward, data
    return lambda: fn(d.grad_out, d.input, d.weight, None, None, d.save_mean, d.save_invstd,
                      True, EPS, (True, True, True), channel_axis=1, num_threads=threads)


def _torch(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    torch, from_numpy = import_torch()
    dy, x, w, m, s = (from_numpy(a) for a in (data.grad_out, data.input, data.weight,
                                              data.save_mean, data.save_invstd))
    op = torch.ops.aten.native_batch_norm_backward

    def run():
        # torch's thread count is process-global; run_suite sets it, this re-asserts it
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return op(dy, x, w, None, None, m, s, True, EPS, [True, True, True])
    return run


def _reference(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    n = data.input.size
    if n > opts.reference_cap:
        raise Unavailable(f"NumPy reference timed only up to {opts.reference_cap:,} elements")
    d = data
    return lambda: reference.batch_norm_backward(d.grad_out, d.input, d.weight, None, None,
                                                 d.save_mean, d.save_invstd, True, EPS,
                                                 (True, True, True), channel_axis=1)


def _floor(data: CaseData, threads: int, opts: Options, in_place: bool = False
           ) -> Callable[[], Any]:
    # coefficients of the magnitude a real backward uses: weight*invstd, and a small b
    a = data.weight * data.save_invstd
    b = -0.01 * data.save_invstd
    return make_floor(data.floor_dy, data.floor_x, a, b, threads, in_place=in_place)


def _floor_in_place(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    return _floor(data, threads, opts, in_place=True)


# --- the fused ops (Case.op "relu", "add-relu"): a training step's forward + backward --------

def _fused_output_mask(data: CaseData) -> Tuple[bool, bool, bool, bool]:
    return (True, True, True, data.side_input is not None)


def _bngrad_fused(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    d, mask = data, _fused_output_mask(data)

    def run():
        _, mean, invstd, bits = bngrad.batch_norm_relu_forward(
            d.input, d.weight, None, None, None, True, 0.1, EPS, side_input=d.side_input,
            mask_format="bits", num_threads=threads)
        return bngrad.batch_norm_relu_backward(d.grad_out, d.input, d.weight, None, None, mean,
                                               invstd, True, EPS, mask, relu_mask=bits,
                                               num_threads=threads)
    return run


def _plain(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    d = data

    def run():
        _, mean, invstd = bngrad.batch_norm_forward(d.input, d.weight, None, None, None, True,
                                                    0.1, EPS, num_threads=threads)
        return bngrad.batch_norm_backward(d.grad_out, d.input, d.weight, None, None, mean,
                                          invstd, True, EPS, num_threads=threads)
    return run


def _torch_sequence(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    """The ops autograd runs for BN -> (add ->) ReLU and back: native_batch_norm, add, relu;
    threshold_backward (the add passes the gradient on as it is), native_batch_norm_backward.
    (Without autograd's own bookkeeping, which would only add to PyTorch's time.)"""
    torch, from_numpy = import_torch()
    dy, x, w = (from_numpy(a) for a in (data.grad_out, data.input, data.weight))
    z = None if data.side_input is None else from_numpy(data.side_input)
    aten = torch.ops.aten

    def run():
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        out, mean, invstd = aten.native_batch_norm(x, w, None, None, None, True, 0.1, EPS)
        y = aten.relu(out if z is None else aten.add(out, z))
        g = aten.threshold_backward(dy, y, 0)
        return aten.native_batch_norm_backward(g, x, w, None, None, mean, invstd, True, EPS,
                                               [True, True, True]) + (g,)
    return run


def _reference_fused(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    if data.input.size > opts.reference_cap:
        raise Unavailable(f"NumPy reference timed only up to {opts.reference_cap:,} elements")
    d, mask = data, _fused_output_mask(data)

    def run():
        out, mean, invstd, *_ = reference.batch_norm_relu_forward(
            d.input, d.weight, None, None, None, True, 0.1, EPS, side_input=d.side_input)
        return reference.batch_norm_relu_backward(d.grad_out, d.input, d.weight, None, None,
                                                  mean, invstd, True, EPS, mask, output=out)
    return run


#: contender name -> (factory(data, threads, options) -> callable, one-line description)
CONTENDERS: Dict[str, Tuple[Callable, str]] = {
    "bngrad": (_bngrad, "bngrad.batch_norm_backward"),
    "torch": (_torch, "torch.ops.aten.native_batch_norm_backward"),
    "reference": (_reference, "bngrad.reference (float64 NumPy)"),
    "floor": (_floor, "fused elementwise pass dx = a*dy + b*x into a new array (memory floor)"),
    "floor_in_place": (_floor_in_place, "the same pass into one reused, paged-in array"),
}
#: the same for the fused ops; "plain" (bngrad's unfused batch norm) is their baseline
FUSED_CONTENDERS: Dict[str, Tuple[Callable, str]] = {
    "bngrad": (_bngrad_fused, "bngrad.batch_norm_relu_forward (1-bit mask) + "
                              "batch_norm_relu_backward"),
    "torch": (_torch_sequence, "aten native_batch_norm, add, relu, threshold_backward, "
                               "native_batch_norm_backward (as autograd runs them)"),
    "reference": (_reference_fused, "bngrad.reference's fused forward + backward (float64)"),
    "plain": (_plain, "bngrad.batch_norm_forward + batch_norm_backward (no add, no ReLU)"),
}


def contenders(op: str) -> Dict[str, Tuple[Callable, str]]:
    """The contenders of a case of operation ``op`` (bngrad._bench.cases.OPS)."""
    return CONTENDERS if op == "backward" else FUSED_CONTENDERS


# With Options.scaling, these run on one thread as well, under the name "<name>@1".
SCALED = ("bngrad", "floor")
