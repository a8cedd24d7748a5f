"""Arrays that must be copied (grad_out in another layout than input, a sliced input) are
copied a chunk of rows at a time once they are larger than ``Config.copy_chunk_bytes``
(bngrad._layout.RowCopies; docs/internals.md): the same bits as one whole copy, less memory.

Every function that takes chunks, on every kernel path, is run with a chunk budget of one
reduction row block (the smallest a copy is chunked with), of a third of the array (several
blocks, whole samples where they fit) and with no chunking, and must give the same bits; a few
of the chunked results are also held to bngrad.reference. The extra memory is measured with
tracemalloc (NumPy reports its buffers to it).
"""

from __future__ import annotations

import contextlib
import math
import tracemalloc

import numpy as np
import pytest

import bngrad
import bngrad.fused
from bngrad import _layout, kernels
from conftest import check_backward, make_case
from tolerances import assert_bitwise_equal

WHOLE, CHUNKS = 1 << 40, 1

# (id, shape, channel axis, tuning overrides, forced path or None): small arrays that still make
# several row blocks on each path (the overrides shrink the tiles)
GRIDS = [
    ("runs", (9, 5, 40), 1, dict(tile=80), "runs"),
    ("fused", (9, 5, 40), 1, dict(tile=80), "fused"),
    ("short", (11, 5, 40), 1, dict(tile=120, short_group_lanes=80), "short"),
    ("lanes", (11, 5, 6), 1, dict(tile=60, min_block_rows=2), "lanes"),
    # channels-last rows, folded for reductions with a leftover piece (input chlast; 175
    # rows, as no fold down to half as wide divides them)
    ("nhwc", (5, 6, 5, 7), 1, dict(fold_lanes=24, elemt_lanes=12, tile=24, min_block_rows=4,
                                   column_group=16), None),
    ("2-D", (45, 7), 1, dict(fold_lanes=14, elemt_lanes=14, tile=28, min_block_rows=4), None),
]
# (input layout, grad_out layout) that copy something
PAIRS = [("contig", "chlast"), ("chlast", "contig"), ("sliced", "contig"), ("sliced", "sliced"),
         ("flipped", "chlast"), ("fortran", "contig")]  # fortran: A's axes reversed
VARIANTS = ["float32", "float64", "bfloat16-p32"]
# a channels-last input is seen as 2-D rows, which only the lanes path takes
CASES = [(g, p) for g in GRIDS for p in PAIRS
         if not (p[0] == "chlast" and g[4] not in (None, "lanes"))
         and not (p[0] == "fortran" and len(g[1]) == 2)]


@contextlib.contextmanager
def _grid(grid, budget):
    _, shape, _, overrides, path = grid
    with kernels.override(copy_chunk_bytes=budget, **overrides), (
            kernels.forced_path(path) if path else contextlib.nullcontext()):
        yield


def _case(grid, pair, variant, mode="train"):
    _, shape, axis, _, _ = grid
    layouts = pair if len(shape) > 2 or "chlast" not in pair else ("contig", "sliced")
    return make_case(shape, axis, variant, mode, layouts=layouts)


def _everything(case):
    """Every result of every function that takes chunks, on 1 and 2 threads."""
    results = []
    C = case.input.shape[case.channel_axis]
    x, dy, w = case.input, case.grad_out, case.weight
    for threads in (1, 2):
        kw = dict(channel_axis=case.channel_axis, num_threads=threads)
        rm, rv = case.running_mean.copy(), case.running_var.copy()
        results += bngrad.batch_norm_forward(x, w, None, rm, rv, True, **kw)
        results += [rm, rv]
        results += bngrad.batch_norm_forward(x, w, None, rm, rv, False, **kw)[:1]
        results += bngrad.batch_norm_moments(x, **kw)
        for mask in ((True, True, True), (False, True, True), (True, False, False)):
            for stats in ((case.save_mean, case.save_invstd), (None, None)):
                results += bngrad.batch_norm_backward(dy, x, w, None, None, *stats, True,
                                                      output_mask=mask, **kw)
            results += bngrad.batch_norm_backward(dy, x, w, rm, rv, None, None, False,
                                                  output_mask=mask, **kw)
        mean, invstd = case.save_mean, case.save_invstd
        sum_dy, sum_dy_xmu, _, _ = bngrad.batch_norm_backward_reduce(dy, x, mean, invstd, w, **kw)
        results += [sum_dy, sum_dy_xmu]
        count = x.size // C
        results.append(bngrad.batch_norm_backward_elemt(dy, x, mean, invstd, w, sum_dy,
                                                        sum_dy_xmu, count, **kw))
    return [r for r in results if r is not None]


def _block_bytes(case) -> int:
    """Bytes of the canonical array in a reduction's largest row block (the smallest chunk)."""
    layout = _layout.plan(case.input, case.grad_out, case.channel_axis % case.input.ndim, 1)
    return (kernels.reduce_block_rows(layout.kernel) * case.input.itemsize
            * math.prod(layout.x.shape[1:]))


@pytest.mark.parametrize("budget", ["block", "sample"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("grid_pair", CASES, ids=lambda c: f"{c[0][0]}-{'/'.join(c[1])}")
def test_chunks_give_the_bits_of_a_whole_copy(grid_pair, variant, budget):
    """Budgets: one reduction block per chunk (elementwise chunks of rows), or a few blocks
    and whole samples where they fit."""
    grid, pair = grid_pair
    case = _case(grid, pair, variant)
    with _grid(grid, WHOLE):
        whole = _everything(case)
        block = _block_bytes(case)
    budget = block if budget == "block" else max(block, case.input.nbytes // 3)
    with _grid(grid, budget):
        text = bngrad.explain(case.input, case.grad_out, channel_axis=case.channel_axis)
        # (a single block is the whole array: nothing to chunk)
        assert ("(in chunks)" in text) == (case.input.nbytes > budget), text
        chunked = _everything(case)
    assert len(whole) == len(chunked)
    for i, (a, b) in enumerate(zip(whole, chunked)):
        assert_bitwise_equal(b, a, f"result {i}")


@pytest.mark.parametrize("mode", ["train", "train-nostats", "eval"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: g[0])
def test_chunked_backward_against_the_reference(grid, mode):
    case = _case(grid, ("sliced", "chlast"), "float32", mode)
    with _grid(grid, WHOLE):
        block = _block_bytes(case)
    with _grid(grid, block):
        text = bngrad.explain(case.input, case.grad_out)
        assert ("(in chunks)" in text) == (case.input.nbytes > block), text
        check_backward(case)


@pytest.mark.parametrize("layouts", [("contig", "chlast"), ("sliced", "contig")], ids="/".join)
@pytest.mark.parametrize("path", ["fused", "runs", "fused_short", "short"])
def test_the_copy_is_made_in_grad_input(path, layouts, monkeypatch):
    """A backward that computes grad_input copies grad_out (or a sliced input) into
    grad_input's buffer and computes in place, on every path: no chunks, and the bits of a
    separate copy (above). Without grad_input (or for the sums alone) it is copied a chunk
    at a time."""
    made = []
    rows = _layout.RowCopies.rows
    monkeypatch.setattr(_layout.RowCopies, "rows", lambda self, r0, r1: made.append(r0) or rows(
        self, r0, r1))
    case = make_case((9, 5, 40), layouts=layouts)
    with kernels.override(tile=80), kernels.forced_path(path):
        with kernels.override(copy_chunk_bytes=_block_bytes(case)):
            bngrad.batch_norm_backward(*case.args())
            case.train = False
            bngrad.batch_norm_backward(*case.args())
            bngrad.batch_norm_backward_elemt(case.grad_out, case.input, case.save_mean,
                                             case.save_invstd, case.weight,
                                             np.ones(5, np.float32), np.ones(5, np.float32),
                                             9 * 40)
            assert not made
            case.output_mask = (False, True, True)
            bngrad.batch_norm_backward(*case.args())
            assert made
            made.clear()
            bngrad.batch_norm_backward_reduce(case.grad_out, case.input, case.save_mean,
                                              case.save_invstd)
            assert made


def test_small_copies_stay_whole():
    """Below the budget a copy is made whole (one pass, fewer calls)."""
    case = make_case((4, 3, 5, 5), layouts=("contig", "chlast"))
    assert "(in chunks)" not in bngrad.explain(case.input, case.grad_out)


@pytest.mark.parametrize("shape", [(40, 7), (4, 3, 5, 5)])
def test_channels_outermost_in_memory_copy_whole(shape):
    """Chunks are of input's outermost memory axis: where that is the channel axis (a
    channels-first input, C order grad_out), the copy is whole, and right."""
    case = make_case(shape, layouts=("chfirst", "contig"))
    with kernels.override(copy_chunk_bytes=CHUNKS):
        assert "(in chunks)" not in bngrad.explain(case.input, case.grad_out)
        check_backward(case)


def _peak_bytes(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("pair", [("contig", "chlast"), ("chlast", "contig"), ("sliced", "contig")],
                         ids="/".join)
@pytest.mark.parametrize("mask", [(True, True, True), (False, True, True)], ids=["dx", "no-dx"])
def test_chunks_keep_the_extra_memory_small(pair, mask):
    """A backward with out= given allocates only its temporaries: a whole copy of the
    (8, 32, 32, 32) float32 array (1 MiB) without chunks, less than a quarter of it with
    chunks of 128 KiB (with tiles small enough that a reduction's row block is no larger: a
    sample, or 512 channels-last rows); and less than a quarter whatever the budget where a
    grad_input is computed (the copy is made in its buffer)."""
    case = make_case((8, 32, 32, 32), layouts=pair)
    case.output_mask = mask
    out = np.empty_like(case.input) if mask[0] else None

    def backward():
        bngrad.batch_norm_backward(*case.args(), out=out)
    size = case.input.nbytes
    in_output = mask[0]
    for budget, fits in ((WHOLE, lambda peak: (peak < size // 4) if in_output else peak >= size),
                         (1 << 17, lambda peak: peak < size // 4)):
        # not fused: chunks; channels-last rows not folded: lane partial sums of 32 KiB
        with kernels.override(copy_chunk_bytes=budget, tile=1024, min_block_rows=4,
                              fused_channels_per_thread=1 << 20, fold_lanes=32):
            backward()  # compiled, layout found and scratch allocated before measuring
            peak = _peak_bytes(backward)
            assert fits(peak), (budget, peak, size)


@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
@pytest.mark.parametrize("layouts", [("contig", "chlast"), ("chlast", "contig"),
                                     ("sliced", "contig")], ids="/".join)
def test_fused_backward_copies_into_grad_input(variant, layouts):
    """The fused backward, too, copies what must be copied (grad_out in another layout, a
    sliced input) into grad_input's buffer and computes in place: the bits of the call on the
    copies made beforehand, for each ReLU record (mask bits, mask bytes, the output y) with
    the side input's gradient, on 1 and 2 threads and each path the shapes take."""
    for shape in [(6, 24, 9, 9), (3, 20, 40, 40)]:
        case = make_case(shape, variant=variant, layouts=layouts)
        x, dy = case.input, case.grad_out
        dense = np.ascontiguousarray(x)  # (input's memory order, where x is dense)
        x_dense = dense if not x.flags.c_contiguous and layouts[0] == "sliced" else x
        dy_like_x = np.empty_like(x_dense)
        dy_like_x[...] = dy
        for fmt in ("bits", "bytes", None):
            y, mean, invstd, mask = bngrad.fused.batch_norm_relu_forward(
                x_dense, case.weight, mask_format=fmt or "bits")
            record = dict(output=y) if fmt is None else dict(relu_mask=mask)
            for threads in (1, 2):
                kw = dict(save_mean=mean, save_invstd=invstd, num_threads=threads, **record)
                expected = bngrad.fused.batch_norm_relu_backward(dy_like_x, x_dense,
                                                                  case.weight, **kw)
                got = bngrad.fused.batch_norm_relu_backward(dy, x, case.weight, **kw)
                for i, (a, b) in enumerate(zip(got, expected)):
                    assert_bitwise_equal(a, b, f"output {i}, record {fmt}, {threads} threads")
    out = np.empty_like(x_dense)  # grad_input given: no copy of the array's size is made

    def backward():
        bngrad.fused.batch_norm_relu_backward(dy, x, case.weight, save_mean=mean,
                                              save_invstd=invstd, output=y,
                                              output_mask=(True, True, True, False), out=out)
    backward()  # (a first call's own allocations: compiling, caching its plan)
    peak = _peak_bytes(backward)
    assert peak < x.nbytes / 2, (peak, x.nbytes)  # (a copy: x.nbytes more)


def test_fused_backward_into_its_own_output_with_a_copied_grad_out():
    """The fused backward keeps its own copy of grad_out where ``out`` may share memory with
    the ReLU's record it reads, e.g. the forward's output ``y`` (a copy made in out would
    overwrite y first)."""
    case = make_case((4, 6, 5, 7), layouts=("contig", "chlast"))
    y = bngrad.fused.batch_norm_relu_forward(case.input, case.weight)[0]
    expected = bngrad.fused.batch_norm_relu_backward(case.grad_out, case.input, case.weight,
                                                      save_mean=case.save_mean,
                                                      save_invstd=case.save_invstd, output=y)
    into_y = y.copy()
    got = bngrad.fused.batch_norm_relu_backward(case.grad_out, case.input, case.weight,
                                                save_mean=case.save_mean,
                                                save_invstd=case.save_invstd, output=into_y,
                                                out=into_y)
    assert got[0] is into_y
    for a, b in zip(got, expected):
        if a is not None:
            assert_bitwise_equal(a, b, "fused backward")


@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32"])
@pytest.mark.parametrize("layouts", [("contig", "contig"), ("chlast", "chlast"),
                                     ("contig", "chlast"), ("chlast", "contig"),
                                     ("sliced", "contig")], ids="/".join)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_in_place_gives_the_bits_of_a_separate_out(variant, layouts, mode):
    """out=input and out=grad_out (where that array is dense), and a copy made in grad_input,
    read through out (kernels.batchnorm._map), give the bits of a separate out, on 1 and 2
    threads and on each path the shape takes."""
    for shape in [(6, 24, 9, 9), (3, 20, 40, 40)]:
        case = make_case(shape, variant=variant, mode=mode, layouts=layouts)
        for threads in (1, 2):
            expected = bngrad.batch_norm_backward(*case.args(), num_threads=threads)
            for name in ("input", "grad_out"):
                target = getattr(case, name)
                if not any(target.transpose(order).flags.c_contiguous
                           for order in [(0, 1, 2, 3), (0, 2, 3, 1)]):
                    continue  # (a sliced input: out= must be dense to be written in place)
                kept = target.copy()
                got = bngrad.batch_norm_backward(*case.args(), num_threads=threads,
                                                 out=target)
                assert got[0] is target
                assert_bitwise_equal(got[0], expected[0], f"out={name}, {threads} threads")
                target[...] = kept


def test_out_the_same_elements_by_other_strides_on_length_one_axes():
    """The stride of an axis of length 1 is never used: out holding grad_out's very elements
    in the same order is in place, not a partial overlap (it was refused as one)."""
    case = make_case((1, 6, 5), variant="float32", mode="train")
    expected = bngrad.batch_norm_backward(*case.args(), num_threads=1)
    grad_out = case.grad_out
    out = np.lib.stride_tricks.as_strided(grad_out, grad_out.shape,
                                          (12345 * 4,) + grad_out.strides[1:])
    got = bngrad.batch_norm_backward(*case.args(), num_threads=1, out=out)
    assert_bitwise_equal(got[0], expected[0], "out=grad_out by other strides")
