"""The contenders timed on each case: bngrad, PyTorch, the NumPy reference and the floor
(batch norm's backward), or bngrad's fused pair, PyTorch's unfused sequence, the reference and
bngrad's plain batch norm (the fused ops, forward + backward); with ``Options.torch_compile``,
also PyTorch's ops compiled by ``torch.compile`` ("torch_compile", either op).

Each is a factory ``(data, threads, options) -> callable``; a factory raises
:class:`Unavailable`, with the reason shown to the user, when its contender cannot run here.
Every callable returns a tuple whose first item is grad_input (compared across contenders).
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np

import bngrad
from bngrad import reference

from .arrays import CaseData
from .floor import make_floor

if TYPE_CHECKING:
    from .results import Options

EPS = 1e-5


class Unavailable(Exception):
    """A contender cannot run here; the message says why (shown to the user)."""


#: ``torch.ops.aten`` once :func:`import_torch` has found PyTorch (which is optional)
_aten: Any = None


def import_torch():
    """(torch, from_numpy) or Unavailable; one place, so tests can pretend torch is missing."""
    global _aten
    try:
        import torch
        from bngrad.torch._convert import from_numpy
    except ImportError as exc:
        raise Unavailable("PyTorch is not installed (pip install '.[torch]' in bngrad's clone "
                          f"to compare against it): {exc}") from None
    _aten = torch.ops.aten
    return torch, from_numpy


def _bngrad(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    fn, d = bngrad.batch_norm_backward, data
    return lambda: fn(d.grad_out, d.input, d.weight, None, None, d.save_mean, d.save_invstd,
                      True, EPS, (True, True, True), channel_axis=1, num_threads=threads)


def _bngrad_out(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    """bngrad into ``out=``: one grad_input buffer in input's layout, paged in up front and
    reused by every call (compared with floor_in_place, which reuses its output alike)."""
    fn, d = bngrad.batch_norm_backward, data
    out = np.zeros_like(d.input)  # written once: its pages are in before any timing
    return lambda: fn(d.grad_out, d.input, d.weight, None, None, d.save_mean, d.save_invstd,
                      True, EPS, (True, True, True), channel_axis=1, num_threads=threads,
                      out=out)


def _aten_backward(dy, x, w, m, s):
    """What the torch contenders run (eager, or traced by torch.compile): batch norm's backward."""
    return _aten.native_batch_norm_backward(dy, x, w, None, None, m, s, True, EPS,
                                            [True, True, True])


def _backward_args(data: CaseData, from_numpy) -> tuple:
    """_aten_backward's tensors, sharing the case's memory."""
    return tuple(from_numpy(a) for a in (data.grad_out, data.input, data.weight,
                                         data.save_mean, data.save_invstd))


def _set_threads(torch, threads: int) -> None:
    # torch's thread count is process-global; run_suite sets it, this re-asserts it
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _eager(fn: Callable, args: Sequence, threads: int) -> Callable[[], Any]:
    """``fn(*args)`` on ``threads`` of PyTorch's threads (the torch contenders, eager or
    compiled)."""
    torch = import_torch()[0]

    def run():
        _set_threads(torch, threads)
        return fn(*args)
    return run


def _torch(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    return _eager(_aten_backward, _backward_args(data, import_torch()[1]), threads)


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


def _aten_sequence(dy, x, w, z):
    """The ops autograd runs for BN -> (add ->) ReLU and back: native_batch_norm, add, relu;
    threshold_backward (the add passes the gradient on as it is), native_batch_norm_backward.
    (Without autograd's own bookkeeping, which would only add to PyTorch's time.)"""
    aten = _aten
    out, mean, invstd = aten.native_batch_norm(x, w, None, None, None, True, 0.1, EPS)
    y = aten.relu(out if z is None else aten.add(out, z))
    g = aten.threshold_backward(dy, y, 0)
    return aten.native_batch_norm_backward(g, x, w, None, None, mean, invstd, True, EPS,
                                           [True, True, True]) + (g,)


def _sequence_args(data: CaseData, from_numpy) -> tuple:
    """_aten_sequence's tensors, sharing the case's memory (z: None but for add-relu)."""
    z = None if data.side_input is None else from_numpy(data.side_input)
    return tuple(from_numpy(a) for a in (data.grad_out, data.input, data.weight)) + (z,)


def _torch_sequence(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    return _eager(_aten_sequence, _sequence_args(data, import_torch()[1]), threads)


# --- torch.compile (optional): the torch contender's ops, compiled by inductor ---------------

def find_cxx() -> Optional[str]:
    """The C++ compiler inductor would use (``torch._inductor.config.cpp.cxx``, found on PATH),
    or None. Inductor turns the graph into C++ and builds it: without one, compiling fails."""
    candidates: Any
    try:
        from torch._inductor import config
        candidates = config.cpp.cxx
    except (ImportError, AttributeError):
        candidates = ("g++",)
    if isinstance(candidates, str) or candidates is None:
        candidates = (candidates,)
    # None there means "download one with conda", which the bench will not do
    return next((c for c in candidates if c and shutil.which(c)), None)


def _first_line(exc: BaseException) -> str:
    """``exc``'s first line, with the next one when it only announces it (inductor's errors
    start "backend='inductor' raised:")."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def compile_contender(fn: Callable, args: Sequence, threads: int) -> Callable[[], Any]:
    """``torch.compile(fn)`` (inductor, default mode, static shapes), compiled here by a first
    call on ``args`` so that no timing includes it; Unavailable when torch, a C++ compiler or
    the compilation is missing or fails."""
    torch = import_torch()[0]
    if find_cxx() is None:
        raise Unavailable("torch.compile needs a C++ compiler, and none of "
                          "torch._inductor.config.cpp.cxx is on PATH (install g++ or set CXX)")
    _set_threads(torch, threads)  # inductor's C++ kernels fix their thread count when built
    # Every case compiles the same function: forget the previous cases' graphs, or dynamo's
    # recompile limit (8) would silently leave later cases running eagerly.
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)
        compiled(*args)
    except Exception as exc:  # never let one case's compiler failure stop the whole run
        raise Unavailable(f"torch.compile failed: {type(exc).__name__}: {_first_line(exc)}"
                          ) from None
    return _eager(compiled, args, threads)


def _torch_compile(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    return compile_contender(_aten_backward, _backward_args(data, import_torch()[1]), threads)


def _torch_compile_sequence(data: CaseData, threads: int, opts: Options) -> Callable[[], Any]:
    return compile_contender(_aten_sequence, _sequence_args(data, import_torch()[1]), threads)


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
    "bngrad_out": (_bngrad_out, "bngrad.batch_norm_backward into out=, one reused, paged-in "
                                "grad_input"),
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


#: the optional contender (Options.torch_compile), per op: PyTorch's contender compiled
TORCH_COMPILE = "torch_compile"
_COMPILED: Dict[str, Tuple[Callable, str]] = {
    "backward": (_torch_compile, "torch.compile (inductor, default mode, dynamic=False) of "
                                 "the torch contender's native_batch_norm_backward"),
    "fused": (_torch_compile_sequence, "torch.compile (inductor, default mode, dynamic=False) "
                                       "of the torch contender's sequence"),
}


def contenders(op: str, torch_compile: bool = False) -> Dict[str, Tuple[Callable, str]]:
    """The contenders of a case of operation ``op`` (bngrad._bench.cases.OPS); with
    ``torch_compile``, also :data:`TORCH_COMPILE` (off by default: compiling takes seconds
    per case)."""
    chosen = CONTENDERS if op == "backward" else FUSED_CONTENDERS
    if not torch_compile:
        return chosen
    return {**chosen, TORCH_COMPILE: _COMPILED["backward" if op == "backward" else "fused"]}


# With Options.scaling, these run on one thread as well, under the name "<name>@1".
SCALED = ("bngrad", "floor")
