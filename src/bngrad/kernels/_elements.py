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
from numba import types
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


# bfloat16 in LLVM IR on 32-bit integers: written in Python, Numba's typing would widen the
# uint32 arithmetic to 64 bits, halving the vector lanes (and the speed of a bfloat16 pass).

@intrinsic
def _bf16_bits_to_float32(typingctx, bits):
    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)),
                               ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _float32_to_bf16_bits(typingctx, value):
    # Branch-free, so that loops storing bfloat16 vectorise: round to nearest even, except
    # that a NaN keeps its top bits and is made quiet. (No overflow: below NaN, bits + 0x8000
    # fits 32 bits.)
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)

        def const(v):
            return ir.Constant(i32, v)
        bits = builder.bitcast(args[0], i32)
        top = builder.lshr(bits, const(16))
        rounded = builder.lshr(builder.add(builder.add(bits, const(0x7FFF)),
                                           builder.and_(top, const(1))), const(16))
        quiet_nan = builder.or_(top, const(0x40))
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.trunc(builder.select(is_nan, quiet_nan, rounded), ir.IntType(16))
    return types.uint16(types.float32), codegen


def to_float(value):
    """Element -> compute type (float64 for float64, float32 otherwise). Jitted use only."""
    raise NotImplementedError


def from_float(value, out):
    """Computed value -> the element type of array ``out`` (or of element ``out``). Jitted use
    only."""
    raise NotImplementedError


@overload(to_float)
def _to_float(value):
    return {types.float64: lambda value: value,
            types.float32: lambda value: value,
            types.int16: lambda value: _half_bits_to_float32(value),
            types.uint16: lambda value: _bf16_bits_to_float32(value)}.get(value)


@overload(from_float)
def _from_float(value, out):
    return {types.float64: lambda value, out: np.float64(value),
            types.float32: lambda value, out: np.float32(value),
            types.int16: lambda value, out: _float32_to_half_bits(np.float32(value)),
            types.uint16: lambda value, out: _float32_to_bf16_bits(np.float32(value))
            }.get(out.dtype if isinstance(out, types.Array) else out)
