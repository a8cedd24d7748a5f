"""Numba kernels: pure functions over validated, canonical arrays; outputs are passed in.

Two canonical layouts (see bngrad._layout):
- channels-first ``(A, C, B)``, C-contiguous: channel c of row a is the run ``x[a, c, :]``;
- channels-last ``(M, C)``, C-contiguous: every row holds one element of each channel.

Determinism: every reduction is cut into tiles whose bounds depend on the data's shape only
(never on the thread count), each tile is summed in a fixed order, and the tile sums are added
in a fixed order. The fused and the two-phase channels-first paths use the same tiles and the
same order, so they give the same bits, whichever the planner picks.

Sums are float64 for every dtype. Elementwise arithmetic runs in ``coef``'s dtype: float64 for
float64 data, float32 otherwise. Per-channel coefficient rows (indices named below):

- training backward: ``dx = (dy - GRAD_MEAN - (x - MEAN)*PROJ) * SCALE`` with
  ``SCALE = invstd*weight``, ``GRAD_MEAN = sum_dy/count``, ``PROJ = sum_dy_xmu/count*invstd**2``;
- eval backward: ``dx = dy*SCALE``;
- forward: ``y = (x - MEAN)*SCALE + BIAS``.

The backward subtracts the mean gradient from dy before scaling, and ``(x - MEAN)*PROJ`` by
one fused multiply-add, as PyTorch's CPU kernel does (its compiler contracts it): where
grad_input cancels (a channel of one or two elements) it then cancels exactly instead of
leaving the rounding errors of separately scaled terms (one element: exactly 0). Keeping
``x - mean`` explicit avoids the cancellation of ``a*dy + b*x + c`` when |mean| >> std.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic

from ._elements import from_float, to_float

_JIT = dict(cache=True, nogil=True)

# Rows of ``coef`` (see the module docstring). GRAD_MEAN and BIAS share a row: the backward
# uses one, the forward the other.
SCALE, PROJ, GRAD_MEAN, MEAN = 0, 1, 2, 3
BIAS = 2


# ---------------------------------------------------------------------------------------------
# scalar helpers

@intrinsic
def _fma(typingctx, a, b, c):
    """a*b + c rounded once (llvm.fma: one instruction on CPUs with FMA, exact everywhere)."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None

    def codegen(context, builder, signature, args):
        fma = builder.module.declare_intrinsic("llvm.fma", [args[0].type] * 3)
        return builder.call(fma, args)
    return a(a, b, c), codegen


# Reassociation lets LLVM vectorise this reduction (4x faster than a fixed-lane scalar loop).
# The vector order is fixed in the compiled code and the runs are fixed by the data, so the
# result still does not depend on the thread count.
@njit(fastmath={"reassoc"}, **_JIT)
def _run_sums(xr, dr, m, shift, b0, b1):
    """(sum (dy - shift), sum (dy - shift)*(x - m)) over xr[b0:b1], dr[b0:b1], in float64."""
    # Slicing first gives LLVM indices that start at 0 and are non-negative, so it vectorises.
    xr, dr = xr[b0:b1], dr[b0:b1]
    sum_dy = 0.0
    sum_dy_xmu = 0.0
    for i in range(dr.shape[0]):
        d = np.float64(to_float(dr[i])) - shift
        sum_dy += d
        sum_dy_xmu += d * (np.float64(to_float(xr[i])) - m)
    return sum_dy, sum_dy_xmu


@njit(**_JIT)
def _tile_sums(x, dy, m, shift, c, a0, a1, b0, b1):
    sd = 0.0
    sx = 0.0
    for a in range(a0, a1):
        p, q = _run_sums(x[a, c], dy[a, c], m, shift, b0, b1)
        sd += p
        sx += q
    return sd, sx


@njit(**_JIT)
def _train_coefficients(sum_dy, sum_dy_xmu, invstd, weight, count, mean, coef, c):
    """coef[:, c] for dx = (dy - GRAD_MEAN - (x - MEAN)*PROJ) * SCALE, from float64."""
    coef[SCALE, c] = invstd * weight
    coef[PROJ, c] = sum_dy_xmu / count * invstd * invstd
    coef[GRAD_MEAN, c] = sum_dy / count
    coef[MEAN, c] = mean


@njit(**_JIT)
def _train_dx(x, dy, scale, proj, grad_mean, m):
    """(dy - grad_mean - (x - m)*proj) * scale, the product subtracted without rounding it
    first (as PyTorch's CPU build does, where its compiler contracts it into an FMA): where
    the two terms cancel, the product's rounding error would be all that is left."""
    return _fma(m - x, proj, dy - grad_mean) * scale


@njit(**_JIT)
def _apply_run(xr, dr, outr, scale, proj, grad_mean, m, b0, b1):
    xr, dr, outr = xr[b0:b1], dr[b0:b1], outr[b0:b1]
    for i in range(outr.shape[0]):
        outr[i] = from_float(_train_dx(to_float(xr[i]), to_float(dr[i]), scale, proj, grad_mean,
                                       m), outr)


@njit(**_JIT)
def _scale_run(dr, outr, a, b0, b1):
    dr, outr = dr[b0:b1], outr[b0:b1]
    for i in range(outr.shape[0]):
        outr[i] = from_float(a * to_float(dr[i]), outr)


@njit(**_JIT)
def _normalize_run(xr, outr, a, d, m, b0, b1):
    xr, outr = xr[b0:b1], outr[b0:b1]
    for i in range(outr.shape[0]):
        outr[i] = from_float((to_float(xr[i]) - m) * a + d, outr)


@njit(**_JIT)
def add_lanes(total, per_lane):
    """total[c] += per_lane[i, c], for i = 0, 1, 2, ... in that order."""
    for i in range(per_lane.shape[0]):
        for c in range(per_lane.shape[1]):
            total[c] += per_lane[i, c]


# ---------------------------------------------------------------------------------------------
# coefficients (shared by every path, so that all paths round identically)

@njit(**_JIT)
def train_coefficients(sum_dy, sum_dy_xmu, mean, invstd, weight, count, coef):
    for c in range(coef.shape[1]):
        _train_coefficients(sum_dy[c], sum_dy_xmu[c], invstd[c], weight[c], count, mean[c],
                            coef, c)


# ---------------------------------------------------------------------------------------------
# channels-first (A, C, B)

@njit(parallel=True, **_JIT)
def reduce_channels_first(x, dy, mean, shift, rows, seg, partial):
    """partial[j, s, c] = (sum dy', sum dy'*(x-mean)), dy' = dy - shift, over tile (j, s, c)."""
    A, C, B = x.shape
    n_blocks, n_segs = partial.shape[0], partial.shape[1]
    for item in prange(n_blocks * n_segs * C):
        c = item % C
        t = item // C
        s = t % n_segs
        j = t // n_segs
        p, q = _tile_sums(x, dy, mean[c], shift[c], c, j * rows, min(A, j * rows + rows),
                          s * seg, min(B, s * seg + seg))
        partial[j, s, c, 0] = p
        partial[j, s, c, 1] = q


@njit(**_JIT)
def combine_channels_first(partial, sum_dy, sum_dy_xmu):
    n_blocks, n_segs, C = partial.shape[0], partial.shape[1], partial.shape[2]
    for c in range(C):
        sd = 0.0
        sx = 0.0
        for j in range(n_blocks):
            for s in range(n_segs):
                sd += partial[j, s, c, 0]
                sx += partial[j, s, c, 1]
        sum_dy[c] = sd
        sum_dy_xmu[c] = sx


@njit(parallel=True, **_JIT)
def backward_channels_first_fused(x, dy, out, mean, invstd, weight, count, rows, seg,
                                  sum_dy, sum_dy_xmu, coef):
    """Training backward, one channel per task: reduce it, then apply while it is in cache.

    Same tiles and order as reduce_channels_first + combine_channels_first.
    """
    A, C, B = x.shape
    n_blocks = (A + rows - 1) // rows
    n_segs = (B + seg - 1) // seg
    for c in prange(C):
        m = mean[c]
        sd = 0.0
        sx = 0.0
        for j in range(n_blocks):
            for s in range(n_segs):
                p, q = _tile_sums(x, dy, m, 0.0, c, j * rows, min(A, j * rows + rows),
                                  s * seg, min(B, s * seg + seg))
                sd += p
                sx += q
        sum_dy[c] = sd
        sum_dy_xmu[c] = sx
        _train_coefficients(sd, sx, invstd[c], weight[c], count, m, coef, c)
        for r in range(A):
            _apply_run(x[r, c], dy[r, c], out[r, c], coef[SCALE, c], coef[PROJ, c],
                       coef[GRAD_MEAN, c], coef[MEAN, c], 0, B)


@njit(parallel=True, **_JIT)
def forward_channels_first_fused(x, out, weight, bias, eps, count, rows, seg, mean, var, coef):
    """Training forward of float64 data, one channel per task: its corrected two-pass moments
    (the first pass's mean is the shift of the second), then its output, all while the channel
    is in cache. Same tiles, order and arithmetic as reduce_channels_first (twice) followed by
    the moments, coefficients and normalize_channels_first that bngrad.api computes otherwise,
    so both give the same bits.
    """
    A, C, B = x.shape
    n_blocks = (A + rows - 1) // rows
    n_segs = (B + seg - 1) // seg
    for c in prange(C):
        total = 0.0
        for j in range(n_blocks):
            for t in range(n_segs):
                total += _tile_sums(x, x, 0.0, 0.0, c, j * rows, min(A, j * rows + rows),
                                    t * seg, min(B, t * seg + seg))[0]
        s = total / count
        sd = 0.0
        sx = 0.0
        for j in range(n_blocks):
            for t in range(n_segs):
                p, q = _tile_sums(x, x, s, s, c, j * rows, min(A, j * rows + rows),
                                  t * seg, min(B, t * seg + seg))
                sd += p
                sx += q
        m = s + sd / count
        v = sx - sd * sd / count
        if v < 0.0:  # not max(): a NaN must stay NaN, as with np.maximum
            v = 0.0
        v = v / count
        mean[c] = m
        var[c] = v
        scale = 1.0 / np.sqrt(v + eps) * weight[c]
        coef[SCALE, c] = scale
        coef[PROJ, c] = scale
        coef[BIAS, c] = bias[c]
        coef[MEAN, c] = m
        for r in range(A):
            _normalize_run(x[r, c], out[r, c], coef[SCALE, c], coef[BIAS, c], coef[MEAN, c], 0, B)


# Short runs (32 <= B < 256, e.g. 7x7 or 14x14 maps; see FUSED_MIN_RUN): one run at a time
# spends most of its time in per-run overhead and loop tails (49 = 32 + 17 scalar steps), so
# these kernels take a group of channels, whose runs are contiguous in every row, as one row of
# lanes.

@njit(parallel=True, **_JIT)
def reduce_channels_first_short(x, dy, mean, shift, rows, group, partial):
    """partial[j, 0, c] = (sum dy', sum dy'*(x-mean)), dy' = dy - shift, over rows block j.

    One task per (rows block j, group of channels): the group's lanes x[a, c0:c1, :] are
    summed over the block's rows (four at a time, in order) into per-lane float64 sums, then
    each channel adds its B lanes in order.
    """
    A, C, B = x.shape
    n_groups = (C + group - 1) // group
    for item in prange(partial.shape[0] * n_groups):
        g = item % n_groups
        j = item // n_groups
        c0 = g * group
        c1 = min(C, c0 + group)
        n = (c1 - c0) * B
        m = np.empty(n)
        s = np.empty(n)
        for c in range(c0, c1):
            m[(c - c0) * B:(c - c0 + 1) * B] = mean[c]
            s[(c - c0) * B:(c - c0 + 1) * B] = shift[c]
        psd = np.zeros(n)
        psx = np.zeros(n)
        # Rows of a C-contiguous 2-D view, so that Numba knows they are contiguous and vectorises.
        x2 = x.reshape(A, C * B)
        d2 = dy.reshape(A, C * B)
        l0 = c0 * B
        l1 = c1 * B
        a = j * rows
        a1 = min(A, a + rows)
        while a + 4 <= a1:
            _accumulate_4_rows(x2[a, l0:l1], x2[a + 1, l0:l1], x2[a + 2, l0:l1],
                               x2[a + 3, l0:l1], d2[a, l0:l1], d2[a + 1, l0:l1],
                               d2[a + 2, l0:l1], d2[a + 3, l0:l1], m, s, psd, psx)
            a += 4
        while a < a1:
            _accumulate_row(x2[a, l0:l1], d2[a, l0:l1], m, s, psd, psx)
            a += 1
        for c in range(c0, c1):
            sd = 0.0
            sx = 0.0
            for i in range((c - c0) * B, (c - c0 + 1) * B):
                sd += psd[i]
                sx += psx[i]
            partial[j, 0, c, 0] = sd
            partial[j, 0, c, 1] = sx


@njit(parallel=True, **_JIT)
def elemt_channels_first_short(x, dy, out, coef, group, train):
    """One task per (row, group of channels): no index arithmetic per run."""
    A, C, B = dy.shape
    n_groups = (C + group - 1) // group
    for item in prange(A * n_groups):
        g = item % n_groups
        a = item // n_groups
        for c in range(g * group, min(C, g * group + group)):
            if train:
                _apply_run(x[a, c], dy[a, c], out[a, c], coef[SCALE, c], coef[PROJ, c],
                           coef[GRAD_MEAN, c], coef[MEAN, c], 0, B)
            else:
                _scale_run(dy[a, c], out[a, c], coef[SCALE, c], 0, B)


@njit(parallel=True, **_JIT)
def normalize_channels_first_short(x, out, coef, group):
    A, C, B = x.shape
    n_groups = (C + group - 1) // group
    for item in prange(A * n_groups):
        g = item % n_groups
        a = item // n_groups
        for c in range(g * group, min(C, g * group + group)):
            _normalize_run(x[a, c], out[a, c], coef[SCALE, c], coef[BIAS, c], coef[MEAN, c], 0, B)


@njit(**_JIT)
def _run_of(item, C, B, seg):
    """(a, c, b0, b1): the item-th segment of the runs of an (A, C, B) array."""
    n_segs = (B + seg - 1) // seg
    s = item % n_segs
    r = item // n_segs
    b0 = s * seg
    return r // C, r % C, b0, min(B, b0 + seg)


@njit(parallel=True, **_JIT)
def elemt_channels_first(x, dy, out, coef, seg, train):
    A, C, B = dy.shape
    for item in prange(A * C * ((B + seg - 1) // seg)):
        a, c, b0, b1 = _run_of(item, C, B, seg)
        if train:
            _apply_run(x[a, c], dy[a, c], out[a, c], coef[SCALE, c], coef[PROJ, c],
                       coef[GRAD_MEAN, c], coef[MEAN, c], b0, b1)
        else:
            _scale_run(dy[a, c], out[a, c], coef[SCALE, c], b0, b1)


@njit(parallel=True, **_JIT)
def normalize_channels_first(x, out, coef, seg):
    A, C, B = x.shape
    for item in prange(A * C * ((B + seg - 1) // seg)):
        a, c, b0, b1 = _run_of(item, C, B, seg)
        _normalize_run(x[a, c], out[a, c], coef[SCALE, c], coef[BIAS, c], coef[MEAN, c], b0, b1)


# ---------------------------------------------------------------------------------------------
# channels-last (M, C)

@njit(**_JIT)
def _accumulate_row(xr, dr, mean, shift, psd, psx):
    for c in range(dr.shape[0]):
        d = np.float64(to_float(dr[c])) - shift[c]
        psd[c] += d
        psx[c] += d * (np.float64(to_float(xr[c])) - mean[c])


@njit(**_JIT)
def _accumulate_4_rows(x0, x1, x2, x3, d0, d1, d2, d3, mean, shift, psd, psx):
    for c in range(d0.shape[0]):
        m = mean[c]
        s = shift[c]
        e0 = np.float64(to_float(d0[c])) - s
        e1 = np.float64(to_float(d1[c])) - s
        e2 = np.float64(to_float(d2[c])) - s
        e3 = np.float64(to_float(d3[c])) - s
        psd[c] += (e0 + e1) + (e2 + e3)
        psx[c] += ((e0 * (np.float64(to_float(x0[c])) - m) + e1 * (np.float64(to_float(x1[c])) - m))
                   + (e2 * (np.float64(to_float(x2[c])) - m)
                      + e3 * (np.float64(to_float(x3[c])) - m)))


@njit(**_JIT)
def _accumulate_block(x, dy, r0, r1, c0, c1, mean, shift, psd, psx):
    """Add rows r0..r1-1 of columns c0..c1-1 into psd, psx (per column, fixed order)."""
    r = r0
    while r + 4 <= r1:  # four rows per pass over the partial sums: a quarter of the stores
        _accumulate_4_rows(x[r, c0:c1], x[r + 1, c0:c1], x[r + 2, c0:c1], x[r + 3, c0:c1],
                           dy[r, c0:c1], dy[r + 1, c0:c1], dy[r + 2, c0:c1], dy[r + 3, c0:c1],
                           mean, shift, psd, psx)
        r += 4
    while r < r1:
        _accumulate_row(x[r, c0:c1], dy[r, c0:c1], mean, shift, psd, psx)
        r += 1


@njit(**_JIT)
def _tiles(M, C, rows, cols):
    """Number of (rows block, column group) tiles of an (M, C) array."""
    return ((M + rows - 1) // rows) * ((C + cols - 1) // cols)


@njit(**_JIT)
def _tile_of(item, M, C, rows, cols):
    """(j, r0, r1, c0, c1): the item-th tile, rows block j, of an (M, C) array."""
    n_groups = (C + cols - 1) // cols
    g = item % n_groups
    j = item // n_groups
    return j, j * rows, min(M, j * rows + rows), g * cols, min(C, g * cols + cols)


@njit(parallel=True, **_JIT)
def reduce_channels_last(x, dy, mean, shift, rows, cols, partial):
    """partial[j, 0/1, c] = (sum dy', sum dy'*(x-mean)), dy' = dy - shift, over rows block j."""
    M, C = x.shape
    for item in prange(_tiles(M, C, rows, cols)):
        j, r0, r1, c0, c1 = _tile_of(item, M, C, rows, cols)
        psd = partial[j, 0, c0:c1]
        psx = partial[j, 1, c0:c1]
        psd[:] = 0.0
        psx[:] = 0.0
        _accumulate_block(x, dy, r0, r1, c0, c1, mean[c0:c1], shift[c0:c1], psd, psx)


# Serial: the partial sums are at most a few MiB, and a parallel launch costs more (measured
# 77 us for (32, 2, 4096)).
@njit(**_JIT)
def combine_channels_last(partial, sum_dy, sum_dy_xmu):
    sum_dy[:] = 0.0
    sum_dy_xmu[:] = 0.0
    for j in range(partial.shape[0]):  # blocks in a fixed order
        pd = partial[j, 0]
        px = partial[j, 1]
        for c in range(sum_dy.shape[0]):
            sum_dy[c] += pd[c]
            sum_dy_xmu[c] += px[c]


@njit(**_JIT)
def _apply_row(xr, dr, outr, scale, proj, grad_mean, m):
    for c in range(outr.shape[0]):
        outr[c] = from_float(_train_dx(to_float(xr[c]), to_float(dr[c]), scale[c], proj[c],
                                       grad_mean[c], m[c]), outr)


@njit(**_JIT)
def _scale_row(dr, outr, a):
    for c in range(outr.shape[0]):
        outr[c] = from_float(a[c] * to_float(dr[c]), outr)


@njit(**_JIT)
def _normalize_row(xr, outr, a, d, m):
    for c in range(outr.shape[0]):
        outr[c] = from_float((to_float(xr[c]) - m[c]) * a[c] + d[c], outr)


@njit(parallel=True, **_JIT)
def elemt_channels_last(x, dy, out, coef, rows, cols, train):
    """One task per (rows block, column group), so that few rows still make many tasks."""
    M, C = dy.shape
    for item in prange(_tiles(M, C, rows, cols)):
        _, r0, r1, c0, c1 = _tile_of(item, M, C, rows, cols)
        scale, proj = coef[SCALE, c0:c1], coef[PROJ, c0:c1]
        grad_mean, m = coef[GRAD_MEAN, c0:c1], coef[MEAN, c0:c1]
        for r in range(r0, r1):
            if train:
                _apply_row(x[r, c0:c1], dy[r, c0:c1], out[r, c0:c1], scale, proj, grad_mean, m)
            else:
                _scale_row(dy[r, c0:c1], out[r, c0:c1], scale)


@njit(parallel=True, **_JIT)
def normalize_channels_last(x, out, coef, rows, cols):
    M, C = x.shape
    for item in prange(_tiles(M, C, rows, cols)):
        _, r0, r1, c0, c1 = _tile_of(item, M, C, rows, cols)
        scale, bias, m = coef[SCALE, c0:c1], coef[BIAS, c0:c1], coef[MEAN, c0:c1]
        for r in range(r0, r1):
            _normalize_row(x[r, c0:c1], out[r, c0:c1], scale, bias, m)


# ---------------------------------------------------------------------------------------------
# layout

@njit(parallel=True, **_JIT)
def copy_rows(source, out):
    """out[i, :] = source[i, :], rows in parallel; ``source`` may have any strides."""
    for i in prange(source.shape[0]):
        out[i, :] = source[i, :]


@njit(parallel=True, **_JIT)
def transpose_last_two(source, out):
    """out[a, q, p] = source[a, p, q], both C-contiguous, in tiles of 32 x 32 so that both
    sides are read and written a cache line at a time."""
    A, C, B = out.shape
    t = 32
    n_c = (C + t - 1) // t
    n_b = (B + t - 1) // t
    for item in prange(A * n_c * n_b):
        jb = item % n_b
        rest = item // n_b
        jc = rest % n_c
        a = rest // n_c
        src = source[a]
        dst = out[a]
        for c in range(jc * t, min(C, jc * t + t)):
            for b in range(jb * t, min(B, jb * t + t)):
                dst[c, b] = src[b, c]
