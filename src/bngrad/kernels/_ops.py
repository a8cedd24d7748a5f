"""The per-element maths of batch norm, each formula written once (docs/internals.md).

The loops of kernels.batchnorm call these (``@overload``): each is compiled once per argument
types, linked into the loop's machine code and inlined there by LLVM, and stays in Numba's disk
cache (which functions passed as arguments or made by closure factories do not). They are not
inlined by Numba (``inline="never"``, its default): that re-typed their bodies at every call
site, and typing was most of the compile time (docs/internals.md). An operand that is None
selects a formula when the kernel is compiled, never at run time:

- ``accumulate``: ``dy'`` and ``dy'*(x - mean)``, ``dy' = dy - shift``, in float64 (the
  backward's sums of half data, without a shift: float32, about the float32 nearest the mean,
  summed in float32 blocks before the float64 total, which ``uncentre`` moves to the mean;
  the moments' ``d`` and ``d*d`` where dy is None);
- ``elementwise``: x and dy: training grad_input ``(dy - GRAD_MEAN - (x - MEAN)*PROJ)*SCALE``;
  dy only: eval grad_input ``dy*SCALE``; x only: the forward ``(x - MEAN)*SCALE + BIAS``, plus
  the side input ``z`` where one is given (bngrad.fused), added to the batch-norm value rounded
  to the data type first, as PyTorch's separate BN and add round it (a no-op for float32 and
  float64; half types round twice, so that the ReLU agrees with PyTorch's sequence near 0);
- ``grad``: the incoming gradient; given ``y``, the fused ReLU's record (the forward output or
  a mask byte), 0 where the ReLU blocked it (PyTorch's threshold_backward: y <= 0);
- ``relu`` and ``relu_passes``: the forward's ReLU as stored, and whether it passes (its
  mask bit: the stored value is not 0; after the ReLU it is +0, positive or NaN);
- ``finish``: the value stored in ``out``, with the fused variants' second output ``aux``
  written on the way: the forward's ReLU and mask byte, the backward's grad_side_input. (The
  forward's mask as bits is packed by kernels.batchnorm's loop from the stored output, as
  ``relu_passes`` judges it.)

``(x - MEAN)*PROJ`` is subtracted by one fused multiply-add, after the mean gradient, as
PyTorch's CPU kernel does (its compiler contracts it): where grad_input cancels (a channel of
one or two elements) it cancels exactly (one element: exactly 0). Keeping ``x - mean``
explicit avoids the cancellation of ``a*dy + b*x + c`` when |mean| >> std.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, types
from numba.extending import intrinsic, overload

from ._elements import from_float, to_float

# Rows of ``coef`` (per channel, compute dtype): SCALE = invstd*weight, PROJ =
# sum_dy_xmu/count*invstd**2, GRAD_MEAN = sum_dy/count, MEAN; the forward's BIAS uses
# GRAD_MEAN's row.
SCALE, PROJ, GRAD_MEAN, MEAN = 0, 1, 2, 3
BIAS = GRAD_MEAN


@intrinsic
def _fma(typingctx, a, b, c):
    """a*b + c rounded once (llvm.fma: one instruction on CPUs with FMA, exact everywhere)."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        fma = builder.module.declare_intrinsic("llvm.fma", [args[0].type] * 3)
        return builder.call(fma, args)
    return a(a, b, c), codegen


@intrinsic
def _select(typingctx, cond, a, b):
    """``a if cond else b`` as one LLVM select: no branch in Numba's IR (a ternary inlined
    twice over trips Numba's IR scope check, NumbaIRAssumptionWarning) and it vectorises."""
    if not (isinstance(cond, types.Boolean) and a == b):
        return None

    def codegen(context, builder, signature, args):
        return builder.select(*args)
    return a(cond, a, b), codegen


def take(values: Any, index: Any) -> Any:
    """``values[index]`` for an array, ``values`` itself for a scalar, None for None (jitted)."""
    raise NotImplementedError


@overload(take)
def _take(values, index):
    if isinstance(values, types.NoneType):
        return lambda values, index: None
    if isinstance(values, types.Array):
        return lambda values, index: values[index]
    return lambda values, index: values


def grad(dy: Any, y: Any) -> Any:
    """The incoming gradient element in the compute type (jitted; ``y``: see the docstring)."""
    raise NotImplementedError


def _zero(value: Any) -> Any:
    """0 in ``value``'s float type (jitted): ``value * 0`` would keep a NaN or make one of inf."""
    raise NotImplementedError


@overload(_zero)
def _zero_impl(value):
    if value == types.float64:
        return lambda value: np.float64(0.0)
    return lambda value: np.float32(0.0)


def passes(y: Any) -> Any:
    """Whether the ReLU let the gradient through (jitted): ``y`` a mask byte (uint8: the
    kernels see bool masks as uint8) or the forward output, ``not y <= 0`` as PyTorch's
    threshold_backward (so a NaN output passes it)."""
    raise NotImplementedError


@overload(passes)
def _passes(y):
    if y == types.uint8:
        return lambda y: y != 0
    return lambda y: not (to_float(y) <= 0)


@overload(grad)
def _grad(dy, y):
    if isinstance(y, types.NoneType):
        return lambda dy, y: to_float(dy)
    # a select, not dy * mask: a NaN or infinite dy where the ReLU blocked must give 0
    return lambda dy, y: _select(passes(y), to_float(dy), _zero(to_float(dy)))


def accumulate(dy: Any, x: Any, y: Any, mean: Any, shift: Any) -> Any:
    """(dy', dy'*(x - mean)), dy' = dy - shift (None: 0): one element's terms of the sums
    (jitted), in float64; for half data without a shift (the backward's sums) in float32, to
    be summed in short float32 blocks (``block_terms``), the second about the float32 nearest
    the mean (``_narrow_terms``, ``uncentre``; ``mean`` split by ``terms_mean``). ``dy`` None:
    the moments' terms, dy being x and mean the shift, (d, d*d) with d = x - shift: the same
    values, from one load and one subtraction instead of two."""
    raise NotImplementedError


@overload(accumulate)
def _accumulate(dy, x, y, mean, shift):
    if isinstance(dy, types.NoneType):  # the moments' sums: dy is x and mean is shift
        def moments(dy, x, y, mean, shift):
            d = np.float64(to_float(x)) - shift
            return d, d * d
        return moments
    if narrow_terms(x, shift):  # the mean split by terms_mean
        return lambda dy, x, y, mean, shift: _narrow_terms(dy, x, y, mean[0])
    if isinstance(shift, types.NoneType):
        def wide(dy, x, y, mean, shift):
            d = np.float64(grad(dy, y))
            return d, d * (np.float64(to_float(x)) - mean)
        return wide

    def wide_shifted(dy, x, y, mean, shift):
        d = np.float64(grad(dy, y)) - shift
        return d, d * (np.float64(to_float(x)) - mean)
    return wide_shifted


@njit(inline="always")
def _narrow_terms(dy, x, y, head):
    """accumulate's float32 terms of half data, centred on ``head``, the float32 nearest the
    mean: d and d*(x - head). Half data are exact in float32, and so is their difference from
    a float32 number near them, so each term is rounded once. The mean's float32 tail is
    taken off the sums afterwards (``uncentre``), once per lane or run instead of an fma per
    element: sum d*(x - mean) = sum d*(x - head) - tail*sum d."""
    d = grad(dy, y)
    return d, d * (to_float(x) - head)


def uncentre(sum_d: Any, sum_dx: Any, mean: Any, x: Any, shift: Any) -> Any:
    """``sum_dx`` (accumulate's second sum over data array ``x``, float64), made the sum about
    ``mean`` (as ``terms_mean`` gave it: where the terms were narrow, a (head, tail) split) by
    subtracting the tail times ``sum_d``; else itself (jitted)."""
    raise NotImplementedError


@overload(uncentre)
def _uncentre(sum_d, sum_dx, mean, x, shift):
    if not narrow_terms(x.dtype, shift):
        return lambda sum_d, sum_dx, mean, x, shift: sum_dx
    # Where sum_d is infinite or NaN, so is sum_dx, with the signs of PyTorch's sum about
    # the mean; the correction would make inf - inf or 0*inf, NaN: it is left off.
    return lambda sum_d, sum_dx, mean, x, shift: _select(
        np.isfinite(sum_d), sum_dx - np.float64(mean[1]) * sum_d, sum_dx)


def terms_mean(mean: Any, x: Any, shift: Any) -> Any:
    """``mean`` (float64: a scalar, or an array of one per lane) as ``accumulate`` and
    ``uncentre`` take it for data array ``x`` with ``shift`` (jitted): where the terms are
    narrow, split into float32 (head, tail), head = float32(mean) and tail = float32(mean -
    head); else itself. The loops split once per run or item, not per element: splitting
    per element cost halves' lane sums ~13% (benchmarks/results/2026-12-01-session9.txt)."""
    raise NotImplementedError


@overload(terms_mean)
def _terms_mean(mean, x, shift):
    if not narrow_terms(x.dtype, shift):
        return lambda mean, x, shift: mean
    # (An infinite head has the tail 0, not inf - inf: the sums about it are already those
    # about the mean, and a NaN tail made a float16 backward's sums NaN where they are -inf.)
    if isinstance(mean, types.Array):
        def split_lanes(mean, x, shift):
            head = mean.astype(np.float32)
            return head, np.where(np.isinf(head), 0.0, mean - head).astype(np.float32)
        return split_lanes

    def split(mean, x, shift):
        head = np.float32(mean)
        return head, np.float32(0.0 if np.isinf(head) else mean - np.float64(head))
    return split


def lane(mean: Any, index: Any) -> Any:
    """``mean[index]`` (jitted), or, for a split mean (terms_mean), (head[index], tail[index])."""
    raise NotImplementedError


@overload(lane)
def _lane(mean, index):
    if isinstance(mean, types.UniTuple):
        return lambda mean, index: (mean[0][index], mean[1][index])
    return lambda mean, index: mean[index]


def narrow_terms(x: Any, shift: Any) -> bool:
    """Whether accumulate's terms are float32: half data (int16/uint16 bits) and no shift.
    The moments (dy = x, a shift) stay float64: with the shift a channel's first element,
    their variance is a difference of two large sums, which float32 terms would leave ~1e-3
    off where that element lies 1000 standard deviations out (tests/test_numerics.py)."""
    return x in (types.int16, types.uint16) and isinstance(shift, types.NoneType)


def block_terms(x: Any, shift: Any) -> Any:
    """(block, zero): how many elements' terms (accumulate) are summed, starting from
    ``zero``, before the sum is added to the float64 total, for data array ``x`` (jitted).
    Half data without a shift: 256 in float32, which vectorises at full width (float64 sums
    made halves' reductions compute-bound), the error of a block's sum within ~8 float32
    roundings (8 terms per vector lane) of its terms' magnitude, far below the data's own
    rounding; otherwise: all of them, in float64."""
    raise NotImplementedError


@overload(block_terms)
def _block_terms(x, shift):
    if narrow_terms(x.dtype, shift):
        return lambda x, shift: (256, np.float32(0.0))
    return lambda x, shift: (1 << 62, 0.0)


def elementwise(x: Any, dy: Any, y: Any, z: Any, scale: Any, proj: Any, shift: Any,
                mean: Any) -> Any:
    """grad_input (train: x and dy; eval: dy) or the forward output (x; plus z, the side
    input, unless None) of one element, in the compute type (jitted)."""
    raise NotImplementedError


@overload(elementwise)
def _elementwise(x, dy, y, z, scale, proj, shift, mean):
    if isinstance(dy, types.NoneType):
        if isinstance(z, types.NoneType):
            return lambda x, dy, y, z, scale, proj, shift, mean: (
                (to_float(x) - mean) * scale + shift)
        # batch norm's value rounded to the data type, then the add in the compute type: the
        # bits of PyTorch's bn(x) + z (exact no-op rounding for float32 and float64)
        return lambda x, dy, y, z, scale, proj, shift, mean: (
            to_float(from_float((to_float(x) - mean) * scale + shift, x)) + to_float(z))
    if isinstance(x, types.NoneType):
        return lambda x, dy, y, z, scale, proj, shift, mean: scale * grad(dy, y)
    return lambda x, dy, y, z, scale, proj, shift, mean: (
        _fma(mean - to_float(x), proj, grad(dy, y) - shift) * scale)


@njit(inline="always")
def relu(value, out):
    """The ReLU of computed ``value`` as an element of ``out``: 0 where value <= 0 (not max():
    a NaN stays NaN, as np.maximum and torch.relu keep it). Rounding after the ReLU is the
    ReLU after rounding (rounding keeps signs and order)."""
    return from_float(_select(value <= 0, _zero(value), value), out)


@njit(inline="always")
def relu_passes(stored):
    """Whether the ReLU passes: ``stored`` (from relu) is not 0, i.e. positive or NaN; in the
    element's own type (for half types their bits: +0 is all zeros), so no conversion."""
    return stored != 0


def finish(value: Any, out: Any, aux: Any, i: Any, dy: Any, y: Any) -> Any:
    """``value`` (from elementwise) as an element of ``out``, writing ``aux[i]`` on the way
    (jitted). aux None: nothing else. The forward (dy None): the ReLU is applied and aux[i] is
    its mask byte, 1 where the stored output passes (relu_passes: judged after rounding, so
    that the mask and y agree); aux a tuple (mask bits, which kernels.batchnorm packs from the
    stored output): the ReLU only. The backward: aux[i] = grad(dy, y), grad_side_input."""
    raise NotImplementedError


@overload(finish)
def _finish(value, out, aux, i, dy, y):
    if isinstance(aux, types.NoneType):
        return lambda value, out, aux, i, dy, y: from_float(value, out)
    if isinstance(aux, types.BaseTuple):
        return lambda value, out, aux, i, dy, y: relu(value, out)
    if isinstance(dy, types.NoneType):
        def relu_and_mask(value, out, aux, i, dy, y):
            stored = relu(value, out)
            aux[i] = _select(relu_passes(stored), np.uint8(1), np.uint8(0))
            return stored
        return relu_and_mask

    def side_grad(value, out, aux, i, dy, y):
        aux[i] = from_float(grad(dy, y), aux)
        return from_float(value, out)
    return side_grad
