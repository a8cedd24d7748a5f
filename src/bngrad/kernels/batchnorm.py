"""Numba kernels: each layout's loops, the parallel kernels' work items, their launchers.

Canonical layouts (bngrad._layout): channels-first ``(A, C, B)``, channel c of row a the run
``x[a, c, :]``, and channels-last ``(M, C)``, both C-contiguous. A parallel kernel is a loop
over independent items (tiles, run segments, channel groups, channels); ``<kernel>_item`` is
one item's work and writes only its own outputs, so whoever runs the items (the launchers at
the end) cannot change the result. The per-element maths is kernels._ops'.

Determinism: reduction tiles have row bounds that depend on the shape only (a lane
reduction's column groups may follow the thread count: a lane sums over rows alone), each is
summed in a fixed order, and the tile sums are added in a fixed order; the fused and two-phase
paths share ``_tile_sums`` and ``_channel_sums``, so they give the same bits. Sums are float64 (the
backward's sums of half data, which have no shift: float32 blocks first, of 256 terms along a
run (kernels._ops.block_terms) or 64 rows of a lane (_LANE_BLOCK_ROWS)); elementwise
arithmetic runs in ``coef``'s dtype (float64 for float64 data, float32 otherwise).

Operands of the fused variants (bngrad.fused; None compiles them away, kernels._ops): ``y``,
the backward's ReLU record (the forward output, or mask bytes as uint8), read beside dy by
the reductions and the elementwise pass; ``z``, the forward's side input, read beside x; and
``aux``, the elementwise pass's second output (the forward's mask bytes, the backward's
grad_side_input), written beside ``out``. The forward's mask may instead be bits: ``aux`` is
then ``(bits, start)``, a 1-D uint8 array packing one bit per element in the canonical array's
memory order (element k: bit ``k % 8`` of ``bits[k // 8]``) and the flat index of the array's
first element; each item writes its mask bytes to a scratch buffer (``_with_scratch``,
``_mask_part``) and packs them (``_flush``). The backward's ``y`` may be such bits too: each
loop unpacks the range it reads into its item's scratch (``_relu_record``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._cache import install as _install_cache_locator
from ._cache import lock_cache_files
from ._elements import to_float
from ._ops import (BIAS, GRAD_MEAN, MEAN, PROJ, SCALE, accumulate, block_terms, elementwise,
                   finish, lane, narrow_terms, take, terms_mean, uncentre)

_install_cache_locator()  # before the first cached kernel is defined (kernels._cache)
_JIT: dict[str, Any] = dict(cache=True, nogil=True)


# ---------------------------------------------------------------------------------------------
# the loops every path shares: sums over a run or rows of lanes, an elementwise pass

# Reassociation lets LLVM vectorise this reduction (4x faster than a fixed-lane scalar loop);
# the vector order is fixed in the compiled code, so the result still does not depend on the
# thread count. Callers slice, so that LLVM sees indices from 0, and vectorises.
@njit(fastmath={"reassoc"}, **_JIT)
def _run_sums(xr, dr, yr, m, shift):
    """(sum dy', sum dy'*(x - m)) over 1-D xr, dr (yr: their ReLU record or None), in float64
    (halves: in blocks)."""
    sum_dy = sum_dy_xmu = 0.0
    mean = terms_mean(m, xr, shift)
    block, zero = block_terms(xr, shift)
    for k in range(0, xr.shape[0], block):  # one block unless the data are halves (_ops)
        xb, db, yb = xr[k:k + block], take(dr, slice(k, k + block)), take(yr, slice(k, k + block))
        bd = bx = zero
        for i in range(xb.shape[0]):
            p, q = accumulate(take(db, i), xb[i], take(yb, i), mean, shift)
            bd += p
            bx += q
        sum_dy += bd
        sum_dy_xmu += bx
    return sum_dy, uncentre(sum_dy, sum_dy_xmu, mean, xr, shift)


@njit(inline="always", **_JIT)
def _accumulate_row(x, d, y, mean, shift, psd, psx):
    for c in range(x.shape[0]):
        p, q = accumulate(take(d, c), x[c], take(y, c), lane(mean, c), take(shift, c))
        psd[c] += p
        psx[c] += q


@njit(inline="always", **_JIT)
def _accumulate_4_rows(x0, x1, x2, x3, d0, d1, d2, d3, y0, y1, y2, y3, mean, shift, psd, psx):
    for c in range(x0.shape[0]):
        m, s = lane(mean, c), take(shift, c)
        p0, q0 = accumulate(take(d0, c), x0[c], take(y0, c), m, s)
        p1, q1 = accumulate(take(d1, c), x1[c], take(y1, c), m, s)
        p2, q2 = accumulate(take(d2, c), x2[c], take(y2, c), m, s)
        p3, q3 = accumulate(take(d3, c), x3[c], take(y3, c), m, s)
        psd[c] += (p0 + p1) + (p2 + p3)
        psx[c] += (q0 + q1) + (q2 + q3)


@njit(**_JIT)
def _accumulate_rows(x, dy, y, r0, r1, c0, c1, mean, shift, psd, psx):
    """Rows r0..r1-1 of lanes c0..c1-1 summed into psd, psx (zeros; per lane, rows in order;
    the second sum about ``mean``: kernels._ops.uncentre). Narrow terms (half data) are summed
    in float32 blocks of ``_LANE_BLOCK_ROWS`` rows (from r0) first: float64 partial sums, read
    and written every four rows, were as many bytes as the half data they summed. ``mean``:
    as kernels._ops.terms_mean gives it."""
    L, w = x.shape[1], c1 - c0
    ys = _with_scratch(y, 4 * w)
    bsd, bsx = _block_partials(psd, psx, x, shift)
    r = r0
    while r + 4 <= r1:  # four rows per pass over the partial sums: a quarter of the stores
        _accumulate_4_rows(x[r, c0:c1], x[r + 1, c0:c1], x[r + 2, c0:c1], x[r + 3, c0:c1],
                           take(dy, (r, slice(c0, c1))), take(dy, (r + 1, slice(c0, c1))),
                           take(dy, (r + 2, slice(c0, c1))), take(dy, (r + 3, slice(c0, c1))),
                           _relu_record(ys, (r, slice(c0, c1)), r * L + c0, w, 0),
                           _relu_record(ys, (r + 1, slice(c0, c1)), (r + 1) * L + c0, w, w),
                           _relu_record(ys, (r + 2, slice(c0, c1)), (r + 2) * L + c0, w, 2 * w),
                           _relu_record(ys, (r + 3, slice(c0, c1)), (r + 3) * L + c0, w, 3 * w),
                           mean, shift, bsd, bsx)
        r += 4
        if (r - r0) % _LANE_BLOCK_ROWS == 0:
            _add_block(bsd, bsx, psd, psx, x, shift)
    while r < r1:
        _accumulate_row(x[r, c0:c1], take(dy, (r, slice(c0, c1))),
                        _relu_record(ys, (r, slice(c0, c1)), r * L + c0, w, 0), mean, shift,
                        bsd, bsx)
        r += 1
    _finish_lanes(bsd, bsx, psd, psx, mean, x, shift)


# Rows of a lane's float32 block (narrow terms): 16 sums of four, whose error stays within
# ~16 float32 roundings of the block's magnitude, far below the half data's own rounding.
_LANE_BLOCK_ROWS = 64


def _block_partials(psd: Any, psx: Any, x: Any, shift: Any) -> Any:
    """Where _accumulate_rows sums its rows first (jitted): for narrow terms, float32 zeros
    like psd and psx, else psd and psx themselves."""
    raise NotImplementedError


@overload(_block_partials, inline="always")
def _block_partials_impl(psd, psx, x, shift):
    if narrow_terms(x.dtype, shift):
        return lambda psd, psx, x, shift: (np.zeros(psd.shape[0], np.float32),
                                           np.zeros(psx.shape[0], np.float32))
    return lambda psd, psx, x, shift: (psd, psx)


def _add_block(bsd: Any, bsx: Any, psd: Any, psx: Any, x: Any, shift: Any) -> None:
    """Where the terms are narrow, a float32 block's sums (_block_partials) added into psd and
    psx, and zeroed; else nothing: they are psd and psx (jitted)."""
    raise NotImplementedError


@overload(_add_block, inline="always")
def _add_block_impl(bsd, bsx, psd, psx, x, shift):
    if not narrow_terms(x.dtype, shift):
        return lambda bsd, bsx, psd, psx, x, shift: None

    def add(bsd, bsx, psd, psx, x, shift):
        for c in range(psd.shape[0]):
            psd[c] += bsd[c]
            psx[c] += bsx[c]
            bsd[c] = 0
            bsx[c] = 0
    return add


def _finish_lanes(bsd: Any, bsx: Any, psd: Any, psx: Any, mean: Any, x: Any,
                  shift: Any) -> None:
    """Where the terms are narrow, the last float32 block added into psd and psx and each
    lane's second sum moved to its mean (kernels._ops.uncentre), in one pass; else nothing
    (jitted)."""
    raise NotImplementedError


@overload(_finish_lanes, inline="always")
def _finish_lanes_impl(bsd, bsx, psd, psx, mean, x, shift):
    if not narrow_terms(x.dtype, shift):
        return lambda bsd, bsx, psd, psx, mean, x, shift: None

    def finish_lanes(bsd, bsx, psd, psx, mean, x, shift):
        for c in range(psd.shape[0]):
            psd[c] += bsd[c]
            psx[c] = uncentre(psd[c], psx[c] + bsx[c], lane(mean, c), x, shift)
    return finish_lanes


# Inlined, as the row helpers above: a call per row would pass new slices, and each costs an
# atomic incref and decref of its array's refcount (locked instructions, contended between
# threads), a third of a channels-last forward's time before they were inlined.
@njit(inline="always", **_JIT)
def _map_loop(x, dy, y, z, out, aux, scale, proj, shift, mean):
    for i in range(out.shape[0]):
        d = take(dy, i)  # loaded once, before out (which may be dy) is written
        r = take(y, i)
        out[i] = finish(elementwise(take(x, i), d, r, take(z, i), take(scale, i), take(proj, i),
                                    take(shift, i), take(mean, i)), out, aux, i, d, r)


@intrinsic
def _same_data(typingctx, a, b):
    """Whether arrays ``a`` and ``b`` start at the same address."""
    def codegen(context, builder, signature, args):
        a_data, b_data = (context.make_array(t)(context, builder, v).data
                          for t, v in zip(signature.args, args))
        return builder.icmp_unsigned("==", builder.ptrtoint(a_data, ir.IntType(64)),
                                     builder.ptrtoint(b_data, ir.IntType(64)))
    return types.boolean(a, b), codegen


def _map(x: Any, dy: Any, y: Any, z: Any, out: Any, aux: Any, scale: Any, proj: Any,
         shift: Any, mean: Any, may_alias: Any = True) -> None:
    """out = elementwise(x, dy, y, z), and aux (kernels._ops.finish), over 1-D slices that
    start at 0, so that LLVM vectorises (None: not an operand). Coefficients: one channel's
    scalars or per-lane vectors. ``may_alias`` None: out is known to be neither x nor dy (no
    test for it, below). (Jitted; inlined, as the row helpers above.)"""
    raise NotImplementedError


# In place (grad_out or input copied into grad_input's buffer, bngrad._layout; or out=input,
# out=grad_out): dy (x) is read through out, which LLVM then sees is one array, and vectorises.
# Two arrays at one address fail its overlap check and run the scalar loop: float32 ~20% slower,
# half data 2x (their conversions). Only the plain training grad_input has these loops (eval's
# in place keeps the scalar loop), outlined, so that each is compiled once per element type
# rather than once more at every loop that inlines _map: with both inlined and eval's too,
# compiling the float32 and bfloat16 kernels took 15% longer, with these ~0-10%.

@njit(**_JIT)
def _map_dy_in_out(x, out, scale, proj, shift, mean):
    _map_loop(x, out, None, None, out, None, scale, proj, shift, mean)


@njit(**_JIT)
def _map_x_in_out(dy, out, scale, proj, shift, mean):
    _map_loop(out, dy, None, None, out, None, scale, proj, shift, mean)


@overload(_map, inline="always")
def _map_impl(x, dy, y, z, out, aux, scale, proj, shift, mean, may_alias=True):
    def plain(x, dy, y, z, out, aux, scale, proj, shift, mean, may_alias=True):
        _map_loop(x, dy, y, z, out, aux, scale, proj, shift, mean)
    if not all(isinstance(a, types.NoneType) for a in (y, z, aux)) or isinstance(
            may_alias, types.NoneType):
        return plain
    if isinstance(x, types.Array) and isinstance(dy, types.Array):
        def train(x, dy, y, z, out, aux, scale, proj, shift, mean, may_alias=True):
            if _same_data(dy, out):
                _map_dy_in_out(x, out, scale, proj, shift, mean)
            elif _same_data(x, out):
                _map_x_in_out(dy, out, scale, proj, shift, mean)
            else:
                _map_loop(x, dy, y, z, out, aux, scale, proj, shift, mean)
        return train
    return plain


@intrinsic
def _atomic_or(typingctx, array, index, value):
    """array[index] |= value as one atomic operation (1-D uint8 array)."""
    if not (isinstance(array, types.Array) and array.dtype == types.uint8
            and value == types.uint8 and isinstance(index, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, signature.args[0], ary, [args[1]])
        builder.atomic_rmw("or", ptr, args[2], "monotonic")
        return context.get_dummy_value()
    return types.void(array, index, value), codegen


# Bits of the forward's mask: the loops store the ReLU's output only, and the item packs the
# bits from what it stored (relu_passes: not 0) once it has written a range contiguous in
# memory (a run segment, a group of whole runs, whole rows of lanes; else each slice), read
# back from the cache: 32 (8) elements become 4 (1) bytes of bits by one vector compare and
# bitcast (x86: a move-mask). (Writing mask bytes in the loop and packing those cost a
# bfloat16 forward a quarter more; benchmarks/results/2026-12-01-session9.txt.)

def _pointers(context, builder, signature, args):
    """(&a[i], &b[j]) for an intrinsic's arguments (a, i, b, j), a and b 1-D arrays."""
    a_type, _, b_type, _ = signature.args
    a = context.make_array(a_type)(context, builder, args[0])
    b = context.make_array(b_type)(context, builder, args[2])
    return (cgutils.get_item_pointer(context, builder, a_type, a, [args[1]]),
            cgutils.get_item_pointer(context, builder, b_type, b, [args[3]]))


def _pack_codegen(lanes):
    def codegen(context, builder, signature, args):
        src, dst = _pointers(context, builder, signature, args)
        element = context.get_value_type(signature.args[0].dtype)
        vector = ir.VectorType(element, lanes)
        loaded = builder.load(builder.bitcast(src, vector.as_pointer()), align=1)
        zero = ir.Constant(vector, None)
        passes = (builder.fcmp_unordered("!=", loaded, zero)  # a NaN passes
                  if isinstance(element, (ir.FloatType, ir.DoubleType))
                  else builder.icmp_unsigned("!=", loaded, zero))
        word = builder.bitcast(passes, ir.IntType(lanes))
        builder.store(word, builder.bitcast(dst, ir.IntType(lanes).as_pointer()), align=1)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _pack32(typingctx, mask, i, bits, j):
    """bits[j:j+4] = the 32 bits ``mask[i:i+32] != 0``, element i + k at bit k % 8 of byte
    j + k // 8 (``mask`` of any element type, floats compared unordered: a NaN is not 0;
    ``bits`` uint8; x86: one vector compare and a move-mask)."""
    return types.void(mask, i, bits, j), _pack_codegen(32)


@intrinsic
def _pack8(typingctx, mask, i, bits, j):
    """bits[j] = the 8 bits ``mask[i:i+8] != 0``, as _pack32."""
    return types.void(mask, i, bits, j), _pack_codegen(8)


@njit(inline="always")
def _pack_few(mask, i0, i1, shift0):
    """``mask[i0:i1] != 0`` (a few elements) as one byte, element i at bit
    ``(i + shift0) % 8``."""
    acc = np.uint32(0)
    for i in range(i0, i1):
        acc |= np.uint32(mask[i] != 0) << np.uint32((i + shift0) % 8)
    return np.uint8(acc)


@njit(**_JIT)
def _pack_bits(mask, n, bits, start):
    """Pack ``mask[0:n] != 0`` as the bits of flat elements start..start+n-1: bytes
    of ``bits`` wholly inside the range are stored; the partial bytes at either end are ORed
    in atomically (``bits`` starts zeroed), as a neighbouring range, maybe another item's,
    owns their other bits. OR is order-free: the bits do not depend on who runs first."""
    head = min(n, -start % 8)
    if head:
        _atomic_or(bits, start // 8, _pack_few(mask, 0, head, start))
    b0, body = (start + head) // 8, (n - head) // 8
    for j in range(body // 4):
        _pack32(mask, head + 32 * j, bits, b0 + 4 * j)
    for j in range(body // 4 * 4, body):
        _pack8(mask, head + 8 * j, bits, b0 + j)
    if head + 8 * body < n:
        _atomic_or(bits, b0 + body, _pack_few(mask, head + 8 * body, n, start))


def _with_scratch(y: Any, n: Any) -> Any:
    """An item's ``y``: mask bits ``(bits, base)`` get a scratch buffer for ``n`` mask bytes
    (_relu_record), ``(bits, base, scratch)``; anything else is itself (jitted)."""
    raise NotImplementedError


@overload(_with_scratch)
def _with_scratch_impl(y, n):
    if isinstance(y, types.BaseTuple):
        return lambda y, n: (y[0], y[1], np.empty(n, np.uint8))
    return lambda y, n: y


def _mask_part(aux: Any, index: Any) -> Any:
    """``aux``'s part for a loop over ``out[index]`` (jitted): None; the array's slice; mask
    bits ``(bits, base)`` as they are (the loop applies the ReLU only, kernels._ops.finish,
    and _flush packs the bits from the output)."""
    raise NotImplementedError


@overload(_mask_part)
def _mask_part_impl(aux, index):
    if isinstance(aux, (types.NoneType, types.BaseTuple)):
        return lambda aux, index: aux
    return lambda aux, index: aux[index]


def _flush(aux: Any, out: Any, start: Any, n: Any) -> None:
    """For mask bits ``(bits, base)``: pack the ReLU's passes of out's flat elements
    start..start+n-1 (one range contiguous in memory, just stored) as the bits of flat
    elements base + start ...; nothing for other operands (jitted)."""
    raise NotImplementedError


@overload(_flush)
def _flush_impl(aux, out, start, n):
    if isinstance(aux, types.BaseTuple):
        return lambda aux, out, start, n: _pack_bits(out.reshape(out.size)[start:start + n],
                                                     n, aux[0], aux[1] + start)
    return lambda aux, out, start, n: None


# The backward's ReLU record as bits (``y`` = (bits, base), the forward's mask): each loop
# unpacks the bits of the range it reads (contiguous in memory) into its item's scratch as 0/1
# bytes, one vector shuffle, AND and compare per 32 (x86: vpshufb, vpand, vpcmpeqb), and reads
# those as it would mask bytes: no pass over memory of its own, no full-size temporary.

def _unpack_codegen(lanes):
    def codegen(context, builder, signature, args):
        src, dst = _pointers(context, builder, signature, args)
        i8, n_bytes = ir.IntType(8), lanes // 8
        loaded = builder.load(builder.bitcast(src, ir.VectorType(i8, n_bytes).as_pointer()),
                              align=1)
        spread = builder.shuffle_vector(  # byte k // 8 in lane k
            loaded, ir.Constant(ir.VectorType(i8, n_bytes), None),
            ir.Constant(ir.VectorType(ir.IntType(32), lanes), [k // 8 for k in range(lanes)]))
        vector = ir.VectorType(i8, lanes)
        bit = builder.and_(spread, ir.Constant(vector, [1 << (k % 8) for k in range(lanes)]))
        byte = builder.zext(builder.icmp_unsigned("!=", bit, ir.Constant(vector, None)), vector)
        builder.store(byte, builder.bitcast(dst, vector.as_pointer()), align=1)
        return context.get_dummy_value()
    return codegen


@intrinsic
def _unpack32(typingctx, bits, j, mask, i):
    """mask[i:i+32] = the bits of bits[j:j+4] as 0/1 bytes, bit k % 8 of byte j + k // 8 to
    mask[i + k] (uint8 arrays)."""
    return types.void(bits, j, mask, i), _unpack_codegen(32)


@intrinsic
def _unpack8(typingctx, bits, j, mask, i):
    """mask[i:i+8] = the bits of bits[j], as _unpack32."""
    return types.void(bits, j, mask, i), _unpack_codegen(8)


@njit(inline="always", **_JIT)
def _unpack_bits(bits, start, n, mask):
    """mask[0:n] = the bits of flat elements start..start+n-1 as 0/1 bytes."""
    head = min(n, -start % 8)
    for i in range(head):
        mask[i] = (bits[(start + i) // 8] >> ((start + i) % 8)) & 1
    b0, body = (start + head) // 8, (n - head) // 8
    for j in range(body // 4):
        _unpack32(bits, b0 + 4 * j, mask, head + 32 * j)
    for j in range(body // 4 * 4, body):
        _unpack8(bits, b0 + j, mask, head + 8 * j)
    for i in range(head + 8 * body, n):
        mask[i] = (bits[(start + i) // 8] >> ((start + i) % 8)) & 1


def _relu_record(y: Any, index: Any, flat: Any, n: Any, offset: Any) -> Any:
    """The backward's ReLU record for a loop over input[index] (jitted): None; ``y[index]``;
    for mask bits ``(bits, base, scratch)``, the bits of flat elements base + flat ... (n of
    them, contiguous in memory) unpacked into scratch[offset:offset + n], which it returns."""
    raise NotImplementedError


# inlined by Numba, unlike the other helpers: LLVM does not inline the bits' unpacking, and a
# call per row cost the fused backward given bits 5-16% (docs/internals.md)
@overload(_relu_record, inline="always")
def _relu_record_impl(y, index, flat, n, offset):
    if isinstance(y, types.NoneType):
        return lambda y, index, flat, n, offset: None
    if isinstance(y, types.BaseTuple):
        def unpacked(y, index, flat, n, offset):
            part = y[2][offset:offset + n]
            _unpack_bits(y[0], y[1] + flat, n, part)
            return part
        return unpacked
    return lambda y, index, flat, n, offset: y[index]


# ---------------------------------------------------------------------------------------------
# coefficients (shared by every path, so that all paths round identically)

@njit(**_JIT)
def _train_coefficients(sum_dy, sum_dy_xmu, invstd, weight, count, mean, coef, c):
    """coef[:, c] for dx = (dy - GRAD_MEAN - (x - MEAN)*PROJ) * SCALE, from float64."""
    coef[SCALE, c] = invstd * weight
    coef[PROJ, c] = sum_dy_xmu / count * invstd * invstd
    coef[GRAD_MEAN, c] = sum_dy / count
    coef[MEAN, c] = mean


@njit(**_JIT)
def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, coef):
    for c in range(coef.shape[1]):
        _train_coefficients(sum_dy[c], sum_dy_xmu[c], invstd[c], weight[c], count, mean[c],
                            coef, c)


# ---------------------------------------------------------------------------------------------
# channels-first (A, C, B): tiles of rows x run segment, per channel

@njit(**_JIT)
def _tile_sums(x, dy, y, m, shift, c, j, s, rows, seg):
    """(sum dy', sum dy'*(x - m)) of tile (j, s) of channel c: rows block j, run segment s."""
    A, C, B = x.shape
    b0, b1 = s * seg, min(B, s * seg + seg)
    ys = _with_scratch(y, b1 - b0)
    sd = sx = 0.0
    for a in range(j * rows, min(A, j * rows + rows)):
        p, q = _run_sums(x[a, c, b0:b1], take(dy, (a, c, slice(b0, b1))),
                         _relu_record(ys, (a, c, slice(b0, b1)), (a * C + c) * B + b0, b1 - b0,
                                      0), m, shift)
        sd += p
        sx += q
    return sd, sx


def _tile(x, dy, y, m, shift, c, j, s, rows, seg, partial):
    """Tile (j, s) of channel c's sums: summed, or read from ``partial`` where the two-phase
    path stored them (jitted; chosen when compiled)."""
    raise NotImplementedError


@overload(_tile)
def _tile_impl(x, dy, y, m, shift, c, j, s, rows, seg, partial):
    if isinstance(partial, types.NoneType):
        return lambda x, dy, y, m, shift, c, j, s, rows, seg, partial: _tile_sums(
            x, dy, y, m, shift, c, j, s, rows, seg)
    return lambda x, dy, y, m, shift, c, j, s, rows, seg, partial: (partial[j, s, c, 0],
                                                                    partial[j, s, c, 1])


@njit(**_JIT)
def _channel_sums(x, dy, y, m, shift, c, rows, seg, n_blocks, n_segs, partial):
    """Channel c's sums: its tiles' sums added in one fixed order, whichever path runs."""
    sd = sx = 0.0
    for j in range(n_blocks):
        for s in range(n_segs):
            p, q = _tile(x, dy, y, m, shift, c, j, s, rows, seg, partial)
            sd += p
            sx += q
    return sd, sx


@njit(**_JIT)
def reduce_runs_item(item, x, dy, y, mean, shift, rows, seg, partial):
    """partial[j, s, c] = (sum dy', sum dy'*(x-mean)), dy' = dy - shift, over tile (j, s, c)."""
    C = x.shape[1]
    t = item // C
    j, s, c = t // partial.shape[1], t % partial.shape[1], item % C
    partial[j, s, c, 0], partial[j, s, c, 1] = _tile_sums(x, dy, y, mean[c], take(shift, c), c,
                                                          j, s, rows, seg)


@njit(**_JIT)
def combine_channels_first(partial, sum_dy, sum_dy_xmu):
    for c in range(partial.shape[2]):
        sum_dy[c], sum_dy_xmu[c] = _channel_sums(None, None, None, 0.0, 0.0, c, 0, 0,
                                                 partial.shape[0], partial.shape[1], partial)


@njit(**_JIT)
def _runs_group_sums(x, dy, y, m, shift, c0, c1, rows, seg, sd, sx):
    """(sd[i], sx[i]) = channel c0+i's (sum dy', sum dy'*(x - m[i])), dy' = dy - shift[i]
    (``shift``: None, or per channel as ``m``), for channels c0..c1-1: each channel's tiles,
    rows and order as _channel_sums (the same bits), but the group's runs read row by row,
    where they lie next to each other in memory: runs of a few KiB, a channel at a time,
    are each a stride away from the last, which the prefetchers follow badly."""
    A, C, B = x.shape
    n = c1 - c0
    td, tx = np.empty(n), np.empty(n)
    sd[:] = 0.0
    sx[:] = 0.0
    ys = _with_scratch(y, min(B, seg))
    for j in range((A + rows - 1) // rows):
        for s in range((B + seg - 1) // seg):
            b0, b1 = s * seg, min(B, s * seg + seg)
            td[:] = 0.0
            tx[:] = 0.0
            for a in range(j * rows, min(A, j * rows + rows)):
                for i in range(n):
                    run = (a, c0 + i, slice(b0, b1))
                    p, q = _run_sums(x[run], take(dy, run),
                                     _relu_record(ys, run, (a * C + c0 + i) * B + b0, b1 - b0,
                                                  0), m[i], take(shift, i))
                    td[i] += p
                    tx[i] += q
            for i in range(n):
                sd[i] += td[i]
                sx[i] += tx[i]


@njit(**_JIT)
def backward_fused_item(g, x, dy, y, out, aux, mean, invstd, weight, count, rows, seg, group,
                        sum_dy, sum_dy_xmu, coef):
    """Training backward of group g of channels: reduce them, then apply while they are in
    cache."""
    A, C, B = x.shape
    c0, c1 = g * group, min(C, g * group + group)
    _runs_group_sums(x, dy, y, mean[c0:c1], None, c0, c1, rows, seg, sum_dy[c0:c1],
                     sum_dy_xmu[c0:c1])
    for c in range(c0, c1):
        _train_coefficients(sum_dy[c], sum_dy_xmu[c], invstd[c], weight[c], count, mean[c],
                            coef, c)
    ys = _with_scratch(y, B)
    for a in range(A):  # (_map, not _map_runs: one inlined loop, a third less to compile)
        for c in range(c0, c1):
            _map(x[a, c], dy[a, c], _relu_record(ys, (a, c), (a * C + c) * B, B, 0), None,
                 out[a, c], take(aux, (a, c)),
                 coef[SCALE, c], coef[PROJ, c], coef[GRAD_MEAN, c], coef[MEAN, c])


@njit(**_JIT)
def forward_fused_item(g, x, z, out, aux, two_pass, weight, bias, eps, count, rows, seg, group,
                       mean, var, invstd, coef):
    """Training forward of group g of channels while it is in cache: their moments, shifted
    by each channel's first element or, ``two_pass`` (float64 data), by the mean of a first
    pass (the corrected two-pass algorithm), then the output; the same tiles, order and
    arithmetic as the two-phase reductions and bngrad.api's moments and normalize."""
    C = x.shape[1]
    c0, c1 = g * group, min(C, g * group + group)
    n = c1 - c0
    sd, sx, shift = np.empty(n), np.empty(n), np.zeros(n)
    if two_pass:
        _runs_group_sums(x, None, None, shift, shift, c0, c1, rows, seg, sd, sx)
        for i in range(n):
            shift[i] = _finite(sd[i] / count)
    else:
        for i in range(n):
            shift[i] = _finite(np.float64(to_float(x[0, c0 + i, 0])))
    _runs_group_sums(x, None, None, shift, shift, c0, c1, rows, seg, sd, sx)
    _normalize_group(x, z, out, aux, c0, c1, shift, sd, sx, count, eps, weight, bias, mean, var,
                     invstd, coef)


@njit(**_JIT)
def _normalize_group(x, z, out, aux, c0, c1, shift, sd, sx, count, eps, weight, bias, mean, var,
                     invstd, coef):
    """The end of a fused training forward item, for channels c0..c1-1 (``shift``, ``sd``,
    ``sx``: theirs, from index 0): their moments and coefficients, then the normalize pass a
    row at a time, each row's mask bits packed once for the group's span (contiguous)."""
    A, C, B = x.shape
    for c in range(c0, c1):
        _finish_moment(c, shift[c - c0], sd[c - c0], sx[c - c0], count, mean, var)
        _normalize_coefficient(c, mean, var, eps, weight, bias, invstd, coef)
    for a in range(A):
        for c in range(c0, c1):
            _map(x[a, c], None, None, take(z, (a, c)), out[a, c], _mask_part(aux, (a, c)),
                 coef[SCALE, c], None, coef[BIAS, c], coef[MEAN, c])
        _flush(aux, out, (a * C + c0) * B, (c1 - c0) * B)


@njit(inline="always", **_JIT)
def _map_runs(a, c0, c1, b0, b1, x, dy, ys, z, out, aux, coef):
    """out = elementwise(x, dy, y, z) on segment b0:b1 of the runs of channels c0..c1-1 in row
    a (contiguous in memory: mask bits are packed once); ``ys``: the item's ReLU record with
    its scratch (_with_scratch), ``aux``: the second output. Whether out is x or dy is tested
    once for the row, not for every run (_map): on short runs those tests and the calls they
    guard cost 10-15% (one thread, in cache)."""
    if _apart(x, dy, out):
        _map_each_run(a, c0, c1, b0, b1, x, dy, ys, z, out, aux, coef, None)
    else:
        _map_each_run(a, c0, c1, b0, b1, x, dy, ys, z, out, aux, coef, True)
    C, B = out.shape[1], out.shape[2]
    _flush(aux, out, (a * C + c0) * B + b0, (c1 - c0) * (b1 - b0))


@njit(inline="always", **_JIT)
def _map_each_run(a, c0, c1, b0, b1, x, dy, ys, z, out, aux, coef, may_alias):
    """_map_runs' loop: _map on each run (``may_alias``: _map's)."""
    C, B = out.shape[1], out.shape[2]
    for c in range(c0, c1):
        run = (a, c, slice(b0, b1))
        _map(take(x, run), take(dy, run),
             _relu_record(ys, run, (a * C + c) * B + b0, b1 - b0, 0), take(z, run), out[run],
             _mask_part(aux, run), coef[SCALE, c], coef[PROJ, c], coef[GRAD_MEAN, c],
             coef[MEAN, c], may_alias)


def _apart(x: Any, dy: Any, out: Any) -> Any:
    """Whether ``out`` starts neither where x nor where dy does (jitted; True where either is
    None: _map then has no in-place loop)."""
    raise NotImplementedError


@overload(_apart, inline="always")
def _apart_impl(x, dy, out):
    if not (isinstance(x, types.Array) and isinstance(dy, types.Array)):
        return lambda x, dy, out: True
    return lambda x, dy, out: not (_same_data(dy, out) or _same_data(x, out))


@njit(**_JIT)
def elementwise_runs_item(item, x, dy, y, z, out, aux, coef, group, seg):
    """Item (row a, group of channels, run segment): out = elementwise(x, dy, y, z) on that
    segment of each channel's run. ``runs``: one channel, segments of ``seg``; ``short``: a
    group of whole runs, so that short runs cost no index arithmetic each. Either way the
    item's elements are contiguous in memory (mask bits are packed once per item)."""
    A, C, B = out.shape
    n_groups, n_segs = (C + group - 1) // group, (B + seg - 1) // seg
    r, b0 = item // n_segs, (item % n_segs) * seg
    a, g = r // n_groups, r % n_groups
    c0, c1, b1 = g * group, min(C, g * group + group), min(B, b0 + seg)
    _map_runs(a, c0, c1, b0, b1, x, dy, _with_scratch(y, b1 - b0), z, out, aux, coef)


# Short runs (32 <= B < 256, e.g. 7x7 maps): one run at a time spends most of its time in
# per-run overhead and loop tails (49 = 32 + 17 scalar steps), so these items take a group of
# channels, whose runs are contiguous in every row, as one row of lanes.

def _lanes_of(values: Any, c0: Any, c1: Any, B: Any) -> Any:
    """values[c] over channel c's B lanes (values' dtype), for channels c0..c1-1; None for None
    (jitted)."""
    raise NotImplementedError


@overload(_lanes_of)
def _lanes_of_impl(values, c0, c1, B):
    if isinstance(values, types.NoneType):
        return lambda values, c0, c1, B: None

    def spread(values, c0, c1, B):
        lanes = np.empty((c1 - c0) * B, values.dtype)
        for c in range(c0, c1):
            lanes[(c - c0) * B:(c - c0 + 1) * B] = values[c]
        return lanes
    return spread


@njit(**_JIT)
def _short_block_sums(x2, d2, y2, B, lane_mean, lane_shift, r0, r1, c0, c1, sd, sx):
    """(sd[c - c0], sx[c - c0]) = (sum dy', sum dy'*(x-mean)) over rows r0..r1-1 of channels
    c0..c1-1: their lanes of the (A, C*B) views summed over the rows (four at a time, in
    order) into per-lane sums, then each channel's B lanes added in order. The sums of one
    channel do not depend on c0, c1: a group of any size gives the same bits."""
    n = (c1 - c0) * B
    psd, psx = np.zeros(n), np.zeros(n)
    _accumulate_rows(x2, d2, y2, r0, r1, c0 * B, c1 * B, lane_mean, lane_shift, psd, psx)
    for c in range(c1 - c0):
        sd[c], sx[c] = _lane_totals(psd[c * B:(c + 1) * B], psx[c * B:(c + 1) * B])


@njit(fastmath={"reassoc"}, **_JIT)
def _lane_totals(psd, psx):
    """(sum psd, sum psx): a channel's lane sums added up, vectorised as _run_sums is (added
    one after another, each waited for the last: a few rows of short runs spent half their
    time here)."""
    a = b = 0.0
    for i in range(psd.shape[0]):
        a += psd[i]
        b += psx[i]
    return a, b


@njit(**_JIT)
def reduce_short_item(item, x2, d2, y2, B, mean, shift, rows, group, partial):
    """partial[j, 0, c] = (sum dy', sum dy'*(x-mean)) over rows block j, for a group of
    channels (_short_block_sums)."""
    A, C = x2.shape[0], x2.shape[1] // B
    n_groups = (C + group - 1) // group
    j, g = item // n_groups, item % n_groups
    c0, c1 = g * group, min(C, g * group + group)
    _short_block_sums(x2, d2, y2, B, terms_mean(_lanes_of(mean, c0, c1, B), x2, shift),
                      _lanes_of(shift, c0, c1, B),
                      j * rows, min(A, j * rows + rows), c0, c1, partial[j, 0, c0:c1, 0],
                      partial[j, 0, c0:c1, 1])


def _as_rows(a: Any, A: Any, n: Any) -> Any:
    """A canonical (A, C, B) operand as its (A, C*B) rows: None and mask bits as they are."""
    raise NotImplementedError


@overload(_as_rows)
def _as_rows_impl(a, A, n):
    if isinstance(a, (types.NoneType, types.BaseTuple)):
        return lambda a, A, n: a
    return lambda a, A, n: a.reshape((A, n))


@njit(**_JIT)
def _group_sums(x2, d2, y2, B, mean, shift, rows, c0, c1):
    """(sd, sx) of channels c0..c1-1 over all rows of the (A, C*B) views: each rows block's
    _short_block_sums (reduce_short_item's), added in block order as combine_channels_first
    adds them (the same bits)."""
    A = x2.shape[0]
    lane_mean = terms_mean(_lanes_of(mean, c0, c1, B), x2, shift)
    lane_shift = _lanes_of(shift, c0, c1, B)
    sd, sx = np.zeros(c1 - c0), np.zeros(c1 - c0)
    bsd, bsx = np.empty(c1 - c0), np.empty(c1 - c0)
    for j in range((A + rows - 1) // rows):
        _short_block_sums(x2, d2, y2, B, lane_mean, lane_shift, j * rows,
                          min(A, j * rows + rows), c0, c1, bsd, bsx)
        for c in range(c1 - c0):
            sd[c] += bsd[c]
            sx[c] += bsx[c]
    return sd, sx


@njit(**_JIT)
def forward_fused_short_item(g, x, z, out, aux, two_pass, weight, bias, eps, count, rows,
                             group, mean, var, invstd, coef):
    """Training forward of group g of channels with short runs while it is in cache: the
    moments as forward_fused_item takes them, by the ``short`` reduction's row blocks, lanes
    and order, then the normalize pass (elementwise_runs_item's runs): the same bits."""
    A, C, B = x.shape
    c0, c1 = g * group, min(C, g * group + group)
    x2 = x.reshape((A, C * B))
    shift = np.zeros(C)  # (the group's entries only: indexed as in the whole array)
    if two_pass:
        shift[c0:c1] = _group_sums(x2, None, None, B, shift, shift, rows, c0, c1)[0] / count
    else:
        for c in range(c0, c1):
            shift[c] = np.float64(to_float(x[0, c, 0]))
    for c in range(c0, c1):
        shift[c] = _finite(shift[c])
    sd, sx = _group_sums(x2, None, None, B, shift, shift, rows, c0, c1)
    _normalize_group(x, z, out, aux, c0, c1, shift[c0:c1], sd, sx, count, eps, weight, bias,
                     mean, var, invstd, coef)


@njit(**_JIT)
def backward_fused_short_item(g, x, dy, y, out, aux, mean, invstd, weight, count, rows, group,
                              span_loop, sum_dy, sum_dy_xmu, coef):
    """Training backward of group g of channels with short runs: the ``short`` reduction's
    row blocks, lanes and order (the same bits), then its elementwise pass, while the group
    is in cache: run by run, or (``span_loop``) in one loop over the group's span of each row
    with per-lane coefficients (the same values: the same bits), which costs loads but saves
    the scalar tail of every short run (49: a vector loop of 32 and 17 scalar steps)."""
    A, C, B = x.shape
    c0, c1 = g * group, min(C, g * group + group)
    x2, d2, y2 = x.reshape((A, C * B)), dy.reshape((A, C * B)), _as_rows(y, A, C * B)
    sd, sx = _group_sums(x2, d2, y2, B, mean, None, rows, c0, c1)
    for c in range(c0, c1):
        sum_dy[c], sum_dy_xmu[c] = sd[c - c0], sx[c - c0]
        _train_coefficients(sd[c - c0], sx[c - c0], invstd[c], weight[c], count, mean[c], coef,
                            c)
    if not span_loop:
        ys = _with_scratch(y, B)
        for a in range(A):
            _map_runs(a, c0, c1, 0, B, x, dy, ys, None, out, aux, coef)
        return
    scale, proj = _lanes_of(coef[SCALE], c0, c1, B), _lanes_of(coef[PROJ], c0, c1, B)
    shift, centre = _lanes_of(coef[GRAD_MEAN], c0, c1, B), _lanes_of(coef[MEAN], c0, c1, B)
    out2, aux2 = out.reshape((A, C * B)), _as_rows(aux, A, C * B)
    yg = _with_scratch(y2, (c1 - c0) * B)
    for a in range(A):
        span = (a, slice(c0 * B, c1 * B))
        _map(x2[span], take(d2, span),
             _relu_record(yg, span, a * C * B + c0 * B, (c1 - c0) * B, 0), None, out2[span],
             _mask_part(aux2, span), scale, proj, shift, centre)


# ---------------------------------------------------------------------------------------------
# rows of lanes (M, L): tiles of rows x lanes

@njit(**_JIT)
def _tile_of(item, M, L, rows, cols):
    """(j, r0, r1, c0, c1): the item-th tile, rows block j, of an (M, L) array."""
    j, g = item // ((L + cols - 1) // cols), item % ((L + cols - 1) // cols)
    return j, j * rows, min(M, j * rows + rows), g * cols, min(L, g * cols + cols)


@njit(**_JIT)
def reduce_lanes_item(item, x, dy, y, mean, shift, rows, cols, partial):
    """partial[j, 0/1, c] = (sum dy', sum dy'*(x-mean)), dy' = dy - shift, over rows block j."""
    j, r0, r1, c0, c1 = _tile_of(item, x.shape[0], x.shape[1], rows, cols)
    psd, psx = partial[j, 0, c0:c1], partial[j, 1, c0:c1]
    psd[:] = 0.0
    psx[:] = 0.0
    _accumulate_rows(x, dy, y, r0, r1, c0, c1, terms_mean(mean[c0:c1], x, shift),
                     take(shift, slice(c0, c1)), psd, psx)


@njit(**_JIT)
def elementwise_lanes_item(item, x, dy, y, z, out, aux, coef, rows, cols):
    """One item per (rows block, column group), so that few rows still make many items (mask
    bits packed once per item where its rows are whole, else per row)."""
    _, r0, r1, c0, c1 = _tile_of(item, out.shape[0], out.shape[1], rows, cols)
    scale, proj = coef[SCALE, c0:c1], coef[PROJ, c0:c1]
    shift, mean = coef[GRAD_MEAN, c0:c1], coef[MEAN, c0:c1]
    L, w = out.shape[1], c1 - c0
    whole = w == L  # the tile is contiguous in memory
    ys = _with_scratch(y, w)
    for r in range(r0, r1):
        lanes = (r, slice(c0, c1))
        _map(take(x, lanes), take(dy, lanes), _relu_record(ys, lanes, r * L + c0, w, 0),
             take(z, lanes), out[lanes], _mask_part(aux, lanes), scale, proj, shift, mean)
        if not whole:
            _flush(aux, out, r * L + c0, w)
    if whole:
        _flush(aux, out, r0 * L, (r1 - r0) * w)


# ---------------------------------------------------------------------------------------------
# layout

@njit(**_JIT)
def copy_rows_item(item, source, out, rows):
    """out[i, :] = source[i, :] for the item's block of ``rows`` rows; ``source`` may have
    any strides. (Blocks: the rows of a cropped map are short, 7-56 elements, and a row per
    item spent most of its time starting the item.)"""
    for i in range(item * rows, min(out.shape[0], item * rows + rows)):
        row, into = source[i], out[i]
        for j in range(into.shape[0]):  # (not a slice assignment: spread_lanes says why)
            into[j] = row[j]


def _transpose8_codegen(context, builder, signature, args):
    source_type, _, _, out_type = signature.args
    source = context.make_array(source_type)(context, builder, args[0])
    out = context.make_array(out_type)(context, builder, args[3])
    b0, c0 = args[1], args[2]
    vector = ir.VectorType(context.get_value_type(source_type.dtype), 8)

    def at(array_type, array, i, j, k):  # &array[i + k, j] as a pointer to 8 elements
        i = builder.add(i, ir.Constant(i.type, k))
        pointer = cgutils.get_item_pointer(context, builder, array_type, array, [i, j])
        return builder.bitcast(pointer, vector.as_pointer())

    rows = [builder.load(at(source_type, source, b0, c0, k), align=1) for k in range(8)]
    # three rounds of interleaving: pairs of elements, then pairs of pairs, then halves
    for low, high, step in (([0, 8, 1, 9, 2, 10, 3, 11], [4, 12, 5, 13, 6, 14, 7, 15], 1),
                            ([0, 1, 8, 9, 2, 3, 10, 11], [4, 5, 12, 13, 6, 7, 14, 15], 2),
                            ([0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15], 4)):
        rows = _interleaved_round(builder, rows, step, low, high)
    for k in range(8):
        builder.store(rows[k], at(out_type, out, c0, b0, k), align=1)
    return context.get_dummy_value()


def _interleaved_round(builder, rows, step, low, high):
    """One round of the 8 x 8 transpose: rows k and k + step (k in the lower half of each
    group of 2 * step) shuffled by the ``low`` and ``high`` masks, the two results side by
    side, pair after pair."""
    masks = [ir.Constant(ir.VectorType(ir.IntType(32), 8), mask) for mask in (low, high)]
    result = []
    for group in range(0, 8, 2 * step):
        for k in range(group, group + step):
            result += [builder.shuffle_vector(rows[k], rows[k + step], mask) for mask in masks]
    return result


@intrinsic
def _transpose8(typingctx, source, b0, c0, out):
    """out[c0 + i, b0 + j] = source[b0 + j, c0 + i] for i, j < 8 (2-D arrays, their rows
    contiguous): eight vector loads, 24 shuffles, eight vector stores, instead of 64 strided
    scalar moves."""
    if not (isinstance(source, types.Array) and source.ndim == out.ndim == 2
            and source.dtype == out.dtype):
        return None
    return types.void(source, b0, c0, out), _transpose8_codegen


# A transpose's item: TRANSPOSE_ROWS rows x TRANSPOSE_COLS columns of the source. Items run
# along a band of source rows first, so that the source is read in order, a band at a time, and
# each item writes TRANSPOSE_COLS rows of out a few cache lines each. (32 x 32 tiles taken down
# the columns first read the source in strides: (32, 3136, 256) float32 NHWC -> NCHW 18-20 ms,
# these 11-12 ms, and the reverse 19 -> 12 ms. 256 rows, not 128: a source of 256 channels'
# rows (NCHW -> NHWC) then writes whole rows of out in one item, (32, 256, 3136) float32
# 10.4 -> 8.7 ms, bfloat16 6.6 -> 4.8 ms; docs/internals.md.)
TRANSPOSE_ROWS, TRANSPOSE_COLS = 256, 64


@njit(**_JIT)
def transpose_item(item, source, out):
    """Tile ``item`` of out[a, q, p] = source[a, p, q], both C-contiguous: 8 x 8 blocks
    (_transpose8: (16, 64, 3136) float32 2.51 -> 0.95 ms, int16 2.49 -> 0.25 ms on two
    threads; benchmarks/results/2026-12-01-session9.txt) down each block of 8 columns, the
    edges element by element."""
    A, C, B = out.shape
    n_c = (C + TRANSPOSE_COLS - 1) // TRANSPOSE_COLS
    n_b = (B + TRANSPOSE_ROWS - 1) // TRANSPOSE_ROWS
    rest, jc = item // n_c, item % n_c
    src, dst, jb = source[rest // n_b], out[rest // n_b], rest % n_b
    c_start, b_start = jc * TRANSPOSE_COLS, jb * TRANSPOSE_ROWS
    c_end, b_end = min(C, c_start + TRANSPOSE_COLS), min(B, b_start + TRANSPOSE_ROWS)
    c8 = c_start + (c_end - c_start) // 8 * 8
    b8 = b_start + (b_end - b_start) // 8 * 8
    for c in range(c_start, c8, 8):
        for b in range(b_start, b8, 8):
            _transpose8(src, b, c, dst)
    for c in range(c_start, c_end):  # the edges: columns b8.. of every row, then rows c8..
        for b in range(b8 if c < c8 else b_start, b_end):
            dst[c, b] = src[b, c]


# ---------------------------------------------------------------------------------------------
# launchers: who runs the items 0..n-1. In parallel: kernels._launch (Numba's pool or
# PyTorch's team), which compiles the items into its own launchers.
# Serial launchers: the same items in the same order on the calling thread, for calls too small
# for a parallel launch to pay (kernels._plan.runs_serial decides, kernels.launcher picks).
# Plain @njit loops: they never enter a pool (no wake-up, no set_num_threads), and since each
# item writes only its own outputs and the combination happens afterwards, their results are
# bitwise those of the parallel launchers. Both hand the items borrowed arrays: the serial
# ones through _in_order, the loop of the one-call passes' run_items (below) on this thread.

def borrowed_codegen(context, builder, typ, value):
    """``value`` of Numba type ``typ`` with every array in it (at any depth of tuples) a
    borrowed view: no meminfo, so that the slices the items take cost no reference counting.
    Counting is an atomic add and subtract on the array's meminfo (Numba's NRT_incref and
    NRT_decref skip a null one): a team's threads would all write that one cache line for
    every row or run they slice (a (64, 32, 256) float32 forward took 1383 us on a team of 2,
    345 us on one thread), and on one thread the locked instructions alone made a (64, 64, 8, 8)
    float32 backward 1.7x slower (293 against 173 us, 2026-12-02). The launcher's caller holds
    the arrays until the launch returns, as Numba's own parallel loops do."""
    if isinstance(typ, types.Array):
        array = context.make_array(typ)(context, builder, value)
        array.meminfo = cgutils.get_null_value(array.meminfo.type)
        array.parent = cgutils.get_null_value(array.parent.type)
        return array._getvalue()
    if isinstance(typ, types.BaseTuple):
        return context.make_tuple(builder, typ, [
            borrowed_codegen(context, builder, member, builder.extract_value(value, i))
            for i, member in enumerate(typ)])
    return value


@intrinsic
def borrowed(typingctx, args):
    """The tuple ``args`` with its arrays borrowed (borrowed_codegen): for items run on this
    thread while the caller holds the arrays."""
    if not isinstance(args, types.BaseTuple):
        return None

    def codegen(context, builder, signature, llargs):
        return borrowed_codegen(context, builder, args, llargs[0])
    return args(args), codegen


@intrinsic
def _hold(typingctx, args):
    """Nothing at run time: a use of ``args`` after the loop over their borrowed views, so
    that Numba keeps the arrays the caller's own code made (a one-call pass's coefficient
    lanes) alive until the loop is done, rather than freeing them after their last use."""
    def codegen(context, builder, signature, llargs):
        return context.get_dummy_value()
    return types.none(args), codegen


# Inlined by Numba from its IR, untyped: an @overload(inline="always") (run_items) is compiled
# whole once more per argument types just to type it (Numba's overload templates), which was
# ~15% of the test suite's compile time when the serial launchers used it.
@njit(inline="always", **_JIT)
def _in_order(item, n, args):
    """item(i, *args) for i in 0..n-1, on this thread."""
    views = borrowed(args)
    for i in range(n):
        item(i, *views)
    _hold(args)


@njit(inline="always", **_JIT)
def _last_to_first(item, n, args):
    """item(i, *args) for i in n-1..0, on this thread (:data:`LAST_TO_FIRST`)."""
    views = borrowed(args)
    for i in range(n - 1, -1, -1):
        item(i, *views)
    _hold(args)


# The second passes over data a first pass has just read (grad_input after the sums, the
# normalized output after the moments) take their items last to first, on a team each thread
# its own share last to first (kernels._launch): the first pass's last rows are the ones still
# in cache, where in the first pass's order the second pass's own reads and writes evict each
# row just before it is needed. Bits unchanged (each item writes only its own outputs).
LAST_TO_FIRST = frozenset({"elementwise_runs_item", "elementwise_lanes_item"})


def last_to_first(item: Any) -> bool:
    """Whether the items of ``item`` (an njit dispatcher) run last to first."""
    return item.py_func.__name__ in LAST_TO_FIRST


@njit(**_JIT)
def reduce_runs_serial(n, *args):
    _in_order(reduce_runs_item, n, args)


@njit(**_JIT)
def reduce_short_serial(n, *args):
    _in_order(reduce_short_item, n, args)


@njit(**_JIT)
def reduce_lanes_serial(n, *args):
    _in_order(reduce_lanes_item, n, args)


@njit(**_JIT)
def elementwise_runs_serial(n, *args):
    _last_to_first(elementwise_runs_item, n, args)


@njit(**_JIT)
def elementwise_lanes_serial(n, *args):
    _last_to_first(elementwise_lanes_item, n, args)


@njit(**_JIT)
def backward_fused_serial(n, *args):
    _in_order(backward_fused_item, n, args)


@njit(**_JIT)
def backward_fused_short_serial(n, *args):
    _in_order(backward_fused_short_item, n, args)


@njit(**_JIT)
def forward_fused_serial(n, *args):
    _in_order(forward_fused_item, n, args)


@njit(**_JIT)
def forward_fused_short_serial(n, *args):
    _in_order(forward_fused_short_item, n, args)


@njit(**_JIT)
def copy_rows_serial(n, *args):
    _in_order(copy_rows_item, n, args)


@njit(**_JIT)
def transpose_last_two_serial(n, *args):
    _in_order(transpose_item, n, args)


# The lane reduction's combination (kernels.reduce): per sum, the row blocks' lane sums in block
# order, then each channel's lanes in lane order into its total. One call (its two former steps
# cost four dispatches, which matters on small arrays), the same adds in the same order, so the
# same bits. Serial: the partial sums are at most a few MiB, and a parallel launch costs more
# (measured 77 us for (32, 2, 4096)).
@njit(**_JIT)
def combine_lanes(partial, repeat, times, sum_dy, sum_dy_xmu):
    """sum_dy[c] (sum_dy_xmu[c]) += partial[:, 0 (1), lanes of c] over blocks, then lanes;
    lane ``c*times + t`` of channel c where ``repeat``, else lane ``t*C + c``."""
    C, L = sum_dy.shape[0], partial.shape[2]
    lanes = np.empty(L)
    for i in range(2):
        total = sum_dy if i == 0 else sum_dy_xmu
        lanes[:] = 0.0
        for j in range(partial.shape[0]):
            for q in range(L):
                lanes[q] += partial[j, i, q]
        for t in range(times):
            for c in range(C):
                total[c] += lanes[c * times + t] if repeat else lanes[t * C + c]


@njit(**_JIT)
def spread_lanes(values, repeat, times, lanes):
    """lanes[r, c*times + t] (repeat) or lanes[r, t*C + c] = values[r, c], for every t < times:
    per-channel values spread over a piece's lanes (kernels._spread)."""
    C = values.shape[1]
    # Element by element: slice assignment compiles Numba's shape checks and their error
    # messages (3-4 s of a fresh process's first call), and ran 15x slower for "tile" pieces
    # (23 us against 1.5 us for 512 channels x 16, which a call spreads five times).
    for r in range(values.shape[0]):
        if repeat:
            for c in range(C):
                v = values[r, c]
                for t in range(times):
                    lanes[r, c * times + t] = v
        else:
            for t in range(times):
                for c in range(C):
                    lanes[r, t * C + c] = values[r, c]


@njit(inline="always", **_JIT)
def _finite(shift):
    """A moments' shift, or 0 where it is inf or NaN (bngrad.api._moments): x - inf would make
    every sum NaN, and an infinite mean NaN; a shift only buys accuracy."""
    return shift if np.isfinite(shift) else 0.0


# The forward's per-channel statistics and coefficients in one call each (bngrad.api): a dozen
# NumPy operations on (C,) vectors cost more than a small call's kernels. The same IEEE
# operations in the same order as the NumPy expressions they replace, so the same bits; NaN
# stays NaN (not max()). forward_fused_item finishes each channel with the same helpers.
@njit(inline="always", **_JIT)
def _finish_moment(c, shift, sum_d, sum_d2, count, mean, var):
    """Channel c of finish_moments, from its scalar sums."""
    mean[c] = shift + sum_d / count
    v = sum_d2 - sum_d * sum_d / count
    if sum_d2 == np.inf and np.isfinite(sum_d):  # finite data whose squares overflow: inf,
        v = np.inf  # as the reference's and PyTorch's variance (not inf - inf = NaN)
    var[c] = (0.0 if v < 0.0 else v) / count  # not max(): a NaN must stay NaN, as np.maximum's


@njit(**_JIT)
def finish_moments(shift, sum_d, sum_d2, count, mean, var):
    """mean = shift + sum_d / count; var = max(sum_d2 - sum_d * sum_d / count, 0) / count."""
    for c in range(mean.shape[0]):
        _finish_moment(c, shift[c], sum_d[c], sum_d2[c], count, mean, var)


@njit(inline="always", **_JIT)
def _inv_std(var, eps, train):
    """1 / sqrt(var + eps), var >= 0 (or NaN), eps >= 0; where both are 0, as PyTorch: 0 in
    training (its InvStd: the channel's output is then its bias), inf in eval."""
    v = var + eps
    if v == 0.0:  # (a test, not a division by zero: Numba would raise, in a worker unseen)
        return 0.0 if train else np.inf
    return 1.0 / np.sqrt(v)


@njit(**_JIT)
def inv_stds(var, eps, train, invstd):
    """invstd = _inv_std(var, eps, train), elementwise (kernels.inv_std)."""
    for c in range(var.shape[0]):
        invstd[c] = _inv_std(var[c], eps, train)


@njit(inline="always", **_JIT)
def _normalize_coefficient(c, mean, var, eps, weight, bias, invstd, coef, train=True):
    """Channel c of normalize_coefficients."""
    s = _inv_std(var[c], eps, train)
    invstd[c] = s
    coef[SCALE, c] = s * weight[c]
    coef[PROJ, c] = 0.0
    coef[BIAS, c] = bias[c]
    coef[MEAN, c] = mean[c]


@njit(**_JIT)
def normalize_coefficients(mean, var, eps, weight, bias, invstd, coef, train):
    """invstd = 1 / sqrt(var + eps) (_inv_std); the normalize pass's coefficient rows (coef's
    dtype)."""
    for c in range(mean.shape[0]):
        _normalize_coefficient(c, mean, var, eps, weight, bias, invstd, coef, train)


# ---------------------------------------------------------------------------------------------
# one-call passes: a call on the lanes path whose passes take one piece each, the whole array
# (KernelPlan.one_call), runs a plain training backward or forward (no fused operands) in one
# compiled call. Its steps were a dozen dispatches and as many NumPy calls from Python, about
# 100 us of a mid-size channels-last call and more than a small array's work; here they are the
# same compiled steps in the same order (kernels.reduce, elementwise, backward_train,
# bngrad.api._moments), so they give the same bits. Their items run on this thread (``launch``
# None: a serial call) or on a team (``launch`` = (parallel, thread_num, team), as
# kernels._launch._run_items takes them); a serial call compiles no parallel code, so it starts
# no pool. The fused variants keep the launchers: each variant would be another 3-5 s of
# compile per dtype.

def run_items(item: Any, launch: Any, n: Any, args: Any) -> None:
    """``item(i, *args)`` for i in 0..n-1: on this thread where ``launch`` is None, else on the
    team ``launch`` names (kernels._launch._run_items) (jitted)."""
    raise NotImplementedError


# Inlined by Numba: a jitted function passed as a value is compiled in as its object's address,
# which Numba will not cache; inlined, that value is never used, and the item is called as the
# global it is.
@overload(run_items, inline="always")
def _run_items_impl(item, launch, n, args):
    if isinstance(launch, types.NoneType):
        call = item.dispatcher
        loop = _last_to_first if last_to_first(call) else _in_order

        def on_this_thread(item, launch, n, args):
            loop(call, n, args)
        return on_this_thread
    from ._launch import _run_items  # (kernels._launch imports this module)

    def on_team(item, launch, n, args):
        _run_items(item, launch[0], launch[1], launch[2], n, args)
    return on_team


@njit(inline="always", **_JIT)
def _spread1(values, repeat, times, L):
    """values (C,) over L lanes, as kernels._spread does for one row."""
    lanes = np.empty((1, L))
    spread_lanes(values.reshape((1, values.shape[0])), repeat, times, lanes)
    return lanes[0]


@njit(inline="always", **_JIT)
def _lane_sums(x, dy, lane_mean, lane_shift, repeat, times, rows, cols, sum_dy, sum_dy_xmu,
               launch):
    """kernels.reduce over one piece, its rows of lanes x: added into sum_dy, sum_dy_xmu."""
    L = x.shape[1]
    partial = np.empty(((x.shape[0] + rows - 1) // rows, 2, L))
    run_items(reduce_lanes_item, launch, partial.shape[0] * ((L + cols - 1) // cols),
              (x, dy, None, lane_mean, lane_shift, rows, cols, partial))
    combine_lanes(partial, repeat, times, sum_dy, sum_dy_xmu)


@njit(inline="always", **_JIT)
def _elementwise_one_call(x, dy, out, coef, repeat, times, rows, cols, launch):
    """kernels.elementwise over one piece, its rows of lanes out."""
    L = out.shape[1]
    lanes = np.empty((coef.shape[0], L), coef.dtype)
    spread_lanes(coef, repeat, times, lanes)
    run_items(elementwise_lanes_item, launch,
              ((out.shape[0] + rows - 1) // rows) * ((L + cols - 1) // cols),
              (x, dy, None, None, out, None, lanes, rows, cols))


@njit(inline="always", **_JIT)
def _lane_rows(a, lanes):
    """Canonical array ``a`` (C-contiguous) as rows of ``lanes`` lanes (0: of its last axis),
    as kernels._lanes views it: made here, where five NumPy reshapes cost a small call 0.8 us."""
    L = max(1, lanes if lanes > 0 else a.shape[a.ndim - 1])
    return a.reshape((a.size // L, L))


@njit(**_JIT)
def backward_one_call(x, dy, out, mean, invstd, weight, count, lanes, tiles, sums, coef,
                      launch):
    """kernels.backward_train in one call: canonical x, dy and out viewed as the reduction's
    piece views them (lanes[0]) and as the elementwise pass's does (lanes[1]), as
    KernelPlan.one_call_lanes says; ``tiles`` the pieces' spread and tiles
    (KernelPlan.one_call_tiles); sums (2, C) zeros, made (sum_dy, sum_dy_xmu)."""
    repeat_r, times_r, rows_r, cols_r, repeat_e, times_e, rows_e, cols_e = tiles
    xr, dyr = _lane_rows(x, lanes[0]), _lane_rows(dy, lanes[0])
    xe, dye, out = _lane_rows(x, lanes[1]), _lane_rows(dy, lanes[1]), _lane_rows(out, lanes[1])
    sum_dy, sum_dy_xmu = sums[0], sums[1]
    _lane_sums(xr, dyr, _spread1(mean, repeat_r, times_r, xr.shape[1]), None, repeat_r,
               times_r, rows_r, cols_r, sum_dy, sum_dy_xmu, launch)
    train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, coef)
    _elementwise_one_call(xe, dye, out, coef, repeat_e, times_e, rows_e, cols_e, launch)


@njit(**_JIT)
def forward_one_call(x, out, first, weight, bias, eps, count, lanes, tiles, stats, coef, launch):
    """The training forward in one call: bngrad.api._moments (shifted by each channel's first
    element, or for float64 data, given ``first`` (C,) zeros, by the mean of a first pass,
    which ``first`` None compiles away), the coefficients, the normalize pass
    (kernels.elementwise); canonical x and out viewed as backward_one_call views them
    (``lanes``, ``tiles``). Writes stats (3, C) = (mean, biased var, invstd) in float64, and
    coef."""
    repeat_r, times_r, rows_r, cols_r, repeat_e, times_e, rows_e, cols_e = tiles
    xr, xe, out = _lane_rows(x, lanes[0]), _lane_rows(x, lanes[1]), _lane_rows(out, lanes[1])
    mean, var, invstd = stats[0], stats[1], stats[2]
    C, L = mean.shape[0], xr.shape[1]
    shift = np.zeros(C)
    if first is not None:  # shift 0 on every lane
        unused, zeros = np.zeros(C), np.zeros(L)
        _lane_sums(xr, None, zeros, zeros, repeat_r, times_r, rows_r, cols_r, first, unused,
                   launch)
        for c in range(C):
            shift[c] = _finite(first[c] / count)
    else:
        for c in range(C):
            shift[c] = _finite(np.float64(to_float(xr[0, c * times_r if repeat_r else c])))
    sum_d, sum_d2 = np.zeros(C), np.zeros(C)
    lanes = _spread1(shift, repeat_r, times_r, L)
    _lane_sums(xr, None, lanes, lanes, repeat_r, times_r, rows_r, cols_r, sum_d, sum_d2, launch)
    finish_moments(shift, sum_d, sum_d2, count, mean, var)
    normalize_coefficients(mean, var, eps, weight, bias, invstd, coef, True)
    _elementwise_one_call(xe, None, out, coef, repeat_e, times_e, rows_e, cols_e, launch)


def _like(array: Any, value: Any) -> Any:
    """``value`` as a scalar of ``array``'s dtype (jitted)."""
    raise NotImplementedError


@overload(_like)
def _like_impl(array, value):
    dtype = array.dtype
    return lambda array, value: dtype(value)


# The running statistics' update (bngrad.api), in one call per statistic for float32 and
# float64 running statistics: four NumPy operations on (C,) vectors cost more than a small
# call's kernels. The same IEEE operations as NumPy's ``(1 - momentum) * running + momentum *
# batch`` on a ``running`` of that dtype (the Python float is rounded to the dtype and the
# product taken in it; the sum in float64, rounded once more when stored), so the same bits.
@njit(**_JIT)
def first_negative(values):
    """Index of the first entry < 0 (NaN is not), or -1: bngrad._validate.running_var's scan
    of float32/float64 variances, where NumPy's (values < 0).any() costs 1.6 us a call."""
    for c in range(values.shape[0]):
        if values[c] < 0:
            return c
    return -1


@njit(**_JIT)
def param_grads(sum_dy, sum_dy_xmu, invstd, grad_weight, grad_bias):
    """grad_weight = sum_dy_xmu * invstd and grad_bias = sum_dy, each rounded once to its
    float32 or float64 array (None: skipped), as NumPy's product and astype give them, inf and
    NaN included, but without their warnings' np.errstate (1 us of a small call's ~15)."""
    for c in range(sum_dy.shape[0]):
        if grad_weight is not None:
            grad_weight[c] = sum_dy_xmu[c] * invstd[c]
        if grad_bias is not None:
            grad_bias[c] = sum_dy[c]


@njit(**_JIT)
def update_running_pair(running_mean, running_var, mean, var, momentum, count):
    """update_running on both running statistics in one call (None: skipped; a None argument
    compiles its update away), the variance's batch statistic unbiased."""
    if running_mean is not None:
        update_running(running_mean, mean, momentum, count, False)
    if running_var is not None:
        update_running(running_var, var, momentum, count, True)


@njit(**_JIT)
def update_running(running, stat, momentum, count, unbiased):
    """running = (1 - momentum) * running + momentum * batch, batch = stat, or with
    ``unbiased`` stat * count / (count - 1) (NaN for count 1, as in PyTorch)."""
    keep = _like(running, 1.0 - momentum)
    for c in range(running.shape[0]):
        batch = stat[c]
        if unbiased:
            batch = batch * count / (count - 1) if count > 1 else np.nan
        running[c] = np.float64(keep * running[c]) + momentum * batch


lock_cache_files(globals())  # (kernels._cache: safe between processes)
