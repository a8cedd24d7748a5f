"""Element access for every supported dtype, converted inside the kernels.

Numba has no half-precision type on the CPU, but LLVM does: the kernels see float16 data as
its int16 bits and bfloat16 as its uint16 bits (``as_kernel_array``; bngrad._dtypes), and the
element type selects the conversion at compile time. float16: bitcast to LLVM ``half`` and
``fpext``/``fptrunc`` (round to nearest even; the CPU's vector conversions). bfloat16: the top
half of a float32; widening is a shift, narrowing rounds to nearest even, NaNs kept quiet.

``to_float(v)``: the compute type (float64 for float64, float32 otherwise);
``from_float(value, out)``: a computed value in ``out``'s element type (``out`` an array, or an
element of that type).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from .. import _dtypes

_KERNEL_DTYPE = {s.numpy: s.kernel_view for s in _dtypes.DTYPES if s.kernel_view != s.numpy}


def as_kernel_array(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` in the element type the kernels take (no copy)."""
    kernel_dtype = _KERNEL_DTYPE.get(array.dtype)
    return array if kernel_dtype is None else array.view(kernel_dtype)


compute_dtype = _dtypes.compute_dtype


@intrinsic
def _half_bits_to_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _float32_to_half_bits(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.int16(types.float32), codegen


@intrinsic
def _uint32_as_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _float32_as_uint32(typingctx, value):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(inline="always")
def _bf16_bits_to_float32(bits):
    return _uint32_as_float32(np.uint32(bits) << np.uint32(16))


@njit(inline="always")
def _float32_to_bf16_bits(value):
    # Branch-free, so that loops storing bfloat16 vectorise: round to nearest even, except
    # that a NaN keeps its top bits and is made quiet.
    bits = _float32_as_uint32(value)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x40)
    is_nan = np.uint32((bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000))
    nan_mask = np.uint32(0) - is_nan  # all ones for NaN, else zero
    return np.uint16((quiet_nan & nan_mask) | (rounded & ~nan_mask))


def to_float(value):
    """Element -> compute type (float64 for float64, float32 otherwise). Jitted use only."""
    raise NotImplementedError


def from_float(value, out):
    """Computed value -> the element type of array ``out`` (or of element ``out``). Jitted use
    only."""
    raise NotImplementedError


@overload(to_float, inline="always")
def _to_float(value):
    return {types.float64: lambda value: value,
            types.float32: lambda value: value,
            types.int16: lambda value: _half_bits_to_float32(value),
            types.uint16: lambda value: _bf16_bits_to_float32(value)}.get(value)


@overload(from_float, inline="always")
def _from_float(value, out):
    return {types.float64: lambda value, out: np.float64(value),
            types.float32: lambda value, out: np.float32(value),
            types.int16: lambda value, out: _float32_to_half_bits(np.float32(value)),
            types.uint16: lambda value, out: _float32_to_bf16_bits(np.float32(value))
            }.get(out.dtype if isinstance(out, types.Array) else out)
