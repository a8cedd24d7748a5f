"""The contenders timed on each case: bngrad, PyTorch, the NumPy reference and the floor.

Each is a factory ``(data, threads, options) -> callable``; a factory raises
:class:`Unavailable`, with the reason shown to the user, when its contender cannot run here.
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


#: contender name -> (factory(data, threads, options) -> callable, one-line description)
CONTENDERS: Dict[str, Tuple[Callable, str]] = {
    "bngrad": (_bngrad, "bngrad.batch_norm_backward"),
    "torch": (_torch, "torch.ops.aten.native_batch_norm_backward"),
    "reference": (_reference, "bngrad.reference (float64 NumPy)"),
    "floor": (_floor, "fused elementwise pass dx = a*dy + b*x into a new array (memory floor)"),
    "floor_in_place": (_floor_in_place, "the same pass into one reused, paged-in array"),
}
# With Options.scaling, these run on one thread as well, under the name "<name>@1".
SCALED = ("bngrad", "floor")
