"""Every named kernel path, forced, against bngrad.reference: whichever path a machine's shapes
and core count would pick, each is held to the tolerance table here.

Matrix: path (kernels.PATHS, forced with ``kernels.forced_path``) x dtype variant x mode x
output mask for the backward; path x variant x train/eval x weight for the forward; path x
variant for reduce + elemt. The tuning constants are shrunk (``kernels.override``) so that
small arrays still make several row blocks (with 4-row passes and tails), run segments and
channel groups. Channels-last rows, which only the lanes path takes, are reached without
forcing, folded with a leftover piece.

Also: the one thread-dependent choice (fused or not: fused/runs, fused_short/short) gives the
same bits both ways, and the plan names the path it takes (``bngrad.explain``).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import bngrad
from bngrad import kernels, reference
from bngrad.kernels import _plan
from conftest import DTYPE_VARIANTS, MASKS, MODES, check_backward, make_case, mask_id
from test_forward import check_forward, make_forward_case
from tolerances import assert_bitwise_equal, assert_close

# (id, shape, layout, tuning overrides, paths): every tile kind on a few hundred elements.
GRIDS = [
    # rows blocks of 5 (4-row pass + 1-row tail, a last block of 1); short groups of 2 of 5
    ("blocks", (11, 5, 40), "contig", dict(tile=200, short_group_lanes=80), kernels.PATHS),
    # runs of 70 in segments of 32 (32, 32, 6), one row per block
    ("segments", (3, 3, 70), "contig", dict(tile=32, short_group_lanes=80), kernels.PATHS),
    # NHWC (35, 6) rows: 4 folded into 24 lanes for reductions (2 row blocks of 4, column
    # groups of 16 + 8; 3 leftover rows), 2 into 12 for elementwise passes (1 leftover row);
    # 35 rows, as no fold down to half as wide divides them (kernels._plan._lane_pieces)
    ("nhwc-folded", (1, 6, 5, 7), "chlast",
     dict(fold_lanes=24, elemt_lanes=12, tile=24, min_block_rows=4, column_group=16),
     ("lanes",)),
]
CASES = [(g, p) for g in GRIDS for p in g[4]]
VARIANTS = [v.id for v in DTYPE_VARIANTS]


def _case_id(case):
    grid, path = case
    return f"{path}-{grid[0]}"


@contextlib.contextmanager
def _on_path(grid, path):
    """Run on ``path`` (forced where the grid is channels-first) with the grid's constants."""
    with kernels.override(**grid[3]), (kernels.forced_path(path) if grid[2] == "contig"
                                       else contextlib.nullcontext()):
        yield


def _assert_path(x, path, grad_out=None):
    text = bngrad.explain(x, grad_out, num_threads=1)
    assert f"path={path!r}" in text, text


@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_on_every_path(case, variant, mode, mask):
    grid, path = case
    # weight given or not along with grad_weight's mask bit: both kinds on every path
    c = make_case(grid[1], 1, variant, mode, with_weight=mask[1], output_mask=mask,
                  layouts=(grid[2], grid[2]), seed=len(grid[0]))
    with _on_path(grid, path):
        _assert_path(c.input, path, c.grad_out)
        check_backward(c, num_threads=2)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "noaffine"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_on_every_path(case, variant, train, affine):
    grid, path = case
    x, w, b, rm, rv = make_forward_case(grid[1], 1, variant, affine, True, grid[2], seed=3)
    with _on_path(grid, path):
        _assert_path(x, path)
        check_forward(x, w, b, rm, rv, train, num_threads=2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_reduce_and_elemt_on_every_path(case, variant):
    grid, path = case
    c = make_case(grid[1], 1, variant, "train", layouts=(grid[2], grid[2]), seed=7)
    args = (c.grad_out, c.input, c.save_mean, c.save_invstd, c.weight)
    scales = c.scales()
    with _on_path(grid, path):
        got = bngrad.batch_norm_backward_reduce(*args, num_threads=2)
        count = c.input.size // c.input.shape[1]
        dx = bngrad.batch_norm_backward_elemt(*args, got[0], got[1], count, num_threads=2)
    ref = reference.batch_norm_backward_reduce(*args)
    for name, g, r in zip(("sum_dy", "sum_dy_xmu", "grad_weight", "grad_bias"), got, ref):
        assert_close(g, r, g.dtype, name, scale=scales[name])
    ref_dx = reference.batch_norm_backward_elemt(*args, got[0], got[1], count)
    assert_close(dx, ref_dx, dx.dtype, "grad_input", scale=scales["grad_input"])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_wide_rows_of_short_runs_take_the_short_kernels(variant, mode):
    """Runs of ``wide_run``..``short_run`` in rows of at least ``wide_lanes`` lanes take the
    short kernels where the rows are few (not forced: the plan's own choice), lanes where they
    are many; either way the reference's results, and the same bits on 1 and 2 threads."""
    with kernels.override(wide_lanes=16 * 24, serial_elements=0):
        for shape, path in (((6, 24, 4, 4), "fused_short"), ((65, 24, 4, 4), "lanes")):
            c = make_case(shape, 1, variant, mode, seed=5)
            _assert_path(c.input, path)
            two = check_backward(c, num_threads=2)
            for a, b in zip(check_backward(c, num_threads=1), two):
                if a is not None:
                    assert_bitwise_equal(a, b, f"{shape} backward on 1 and 2 threads")
            x, w, b, rm, rv = make_forward_case(shape, 1, variant, True, True, seed=6)
            check_forward(x, w, b, rm, rv, mode != "eval", num_threads=2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pair", [("fused", "runs"), ("fused_short", "short")],
                         ids=["runs", "short"])
@pytest.mark.parametrize("grid", GRIDS[:2], ids=[g[0] for g in GRIDS[:2]])
def test_fused_and_two_phase_give_the_same_bits(grid, pair, variant):
    """The only choice that depends on the thread count must not change a bit; the fused
    items' groups of channels (of any size) neither. Backward and training forward (plain,
    with running statistics; and the fused ReLU's with a side input and mask bits, and its
    backward given those bits or the output)."""
    A, _, B = grid[1]
    shape = (A, 12, B)  # 12 channels: fused in groups of 5, 5 and 2, or of one
    groups = {5: dict(fused_channels_per_thread=1, fused_group_elements=5 * A * B,
                      fused_runs_group_bytes=40 * A * B, l3_bytes=1 << 40),
              1: dict(fused_group_elements=1, fused_runs_group_bytes=1)}
    c = make_case(shape, 1, variant, "train-nostats", layouts=("contig", "contig"), seed=11)
    results = []
    for path, group in [(pair[0], 5), (pair[0], 1), (pair[1], None)]:
        with _on_path(grid, path), kernels.override(**groups.get(group, {})):
            if group:
                explained = bngrad.explain(c.input, num_threads=2)
                assert f"fused in {-(-12 // group)} groups of {group}" in explained, explained
            stats = (np.zeros_like(c.weight), np.ones_like(c.weight))
            relu = bngrad.batch_norm_relu_forward(c.input, c.weight, c.weight,
                                                  side_input=c.grad_out, num_threads=2)
            y, mean, invstd, bits = relu
            results.append(
                bngrad.batch_norm_backward(*c.args(), num_threads=2)
                + bngrad.batch_norm_forward(c.input, c.weight, c.weight, *stats, num_threads=2)
                + stats + relu
                + bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                  mean, invstd, relu_mask=bits, num_threads=2)
                + bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                  mean, invstd, output=y, num_threads=2))
    fused_in_groups, fused_in_groups_of_one, two_phase = results
    for i, (a, b, t) in enumerate(zip(fused_in_groups, fused_in_groups_of_one, two_phase)):
        assert_bitwise_equal(a, t, f"output {i} (groups of 5 channels)")
        assert_bitwise_equal(b, t, f"output {i} (groups of one channel)")


@pytest.mark.parametrize("variant", VARIANTS)
def test_span_loops_give_the_run_loops_bits(variant):
    """fused_short's backward writes runs shorter than ``span_runs_below`` in one loop over a
    group's span of each row: bitwise what its run-by-run loop writes, for the plain backward
    and the fused ReLU's (given mask bits or the output; with the side input's gradient)."""
    c = make_case((5, 6, 40), 1, variant, "train-nostats", layouts=("contig", "contig"), seed=5)
    results = []
    for below in (0, 1 << 20):
        with kernels.forced_path("fused_short"), kernels.override(span_runs_below=below):
            assert ("span loops" in bngrad.explain(c.input, num_threads=2)) == bool(below)
            y, mean, invstd, bits = bngrad.batch_norm_relu_forward(
                c.input, c.weight, c.weight, side_input=c.grad_out, num_threads=2)
            results.append(
                bngrad.batch_norm_backward(*c.args(), num_threads=2)
                + bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                  mean, invstd, relu_mask=bits, num_threads=2)
                + bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                  mean, invstd, output=y, num_threads=2))
    for i, (runs, span) in enumerate(zip(*results)):
        assert_bitwise_equal(runs, span, f"output {i}")


@pytest.mark.parametrize("path", ["short", "fused_short"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_short_runs_elementwise_as_lanes_keeps_the_bits(variant, path):
    """The short kernels write the training grad_input of runs shorter than ``short_run`` (the
    wide rows that leave the lanes path) as the lanes path writes it: bitwise what their
    run-by-run loops write (short_run lowered to the run length), in the two-phase backward,
    the fused ReLU's, and batch_norm_backward_elemt."""
    c = make_case((5, 6, 20), 1, variant, "train-nostats", layouts=("contig", "contig"), seed=5)
    results = []
    for short_run in (20, 32):
        with kernels.forced_path(path), kernels.override(short_run=short_run):
            as_lanes = "training elementwise as lanes" in bngrad.explain(c.input, num_threads=2)
            assert as_lanes == (short_run > 20)
            y, mean, invstd, bits = bngrad.batch_norm_relu_forward(
                c.input, c.weight, c.weight, side_input=c.grad_out, num_threads=2)
            sums = bngrad.batch_norm_backward_reduce(c.grad_out, c.input, mean, invstd,
                                                     c.weight, num_threads=2)[:2]
            results.append(
                bngrad.batch_norm_backward(*c.args(), num_threads=2)
                + bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                  mean, invstd, output=y, num_threads=2)
                + bngrad.batch_norm_relu_backward(c.grad_out, c.input, c.weight, None, None,
                                                  mean, invstd, relu_mask=bits, num_threads=2)
                + (bngrad.batch_norm_backward_elemt(c.grad_out, c.input, mean, invstd,
                                                    c.weight, *sums, 5 * 20, num_threads=2),))
    for i, (runs, lanes) in enumerate(zip(*results)):
        assert_bitwise_equal(runs, lanes, f"output {i}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_lane_column_groups_follow_the_threads_without_changing_a_bit(variant):
    """Lane reductions with few row blocks split their lanes into column groups, more of them
    for more threads (reduce_items_per_thread): a lane's sum runs over the rows only, so the
    results are the bits of one column group on one thread."""
    c = make_case((16, 24, 7, 7), 1, variant, "train-nostats", layouts=("chlast", "chlast"),
                  seed=7)
    results, tiles = [], set()
    for threads, items in [(1, 0), (1, 2), (1, 4), (2, 4)]:
        with kernels.override(fold_lanes=384, min_reduce_cols=64, reduce_items_per_thread=items):
            tiles.add(bngrad.explain(c.input, num_threads=threads).splitlines()[3])
            results.append(bngrad.batch_norm_backward(*c.args(), num_threads=threads)
                           + bngrad.batch_norm_forward(c.input, c.weight, c.weight,
                                                       num_threads=threads)
                           + bngrad.batch_norm_moments(c.input, num_threads=threads))
    assert len(tiles) == 4, tiles  # four different column groups
    for got in results[1:]:
        for i, (a, b) in enumerate(zip(results[0], got)):
            assert_bitwise_equal(a, b, f"output {i}")


def test_path_depends_on_threads_only_through_fusing():
    cfg = kernels.Config()
    for shape in [(3, 20, 300), (4, 20, 49), (4, 5, 49), (4, 5, 7), (100, 3)]:
        paths = {_plan._plan(shape, threads, cfg, None).path for threads in (1, 2, 4, 8, 64)}
        assert (paths <= {"fused", "runs"} or paths <= {"fused_short", "short"}
                or len(paths) == 1), (shape, paths)
    assert _plan._plan((3, 20, 300), 1, cfg, None).path == "fused"
    assert _plan._plan((3, 20, 300), 8, cfg, None).path == "runs"
    assert _plan._plan((4, 20, 49), 1, cfg, None).path == "fused_short"
    assert _plan._plan((4, 20, 49), 8, cfg, None).path == "short"
    # many rows: the group would not stay in cache (Config.fused_short_max_rows)
    assert _plan._plan((64, 20, 49), 1, cfg, None).path == "fused_short"
    assert _plan._plan((65, 20, 49), 1, cfg, None).path == "short"


def test_fused_short_groups():
    """About fused_group_elements elements per group, and fused_channels_per_thread groups
    per thread where the channels allow."""
    cfg = kernels.Config(fused_group_elements=1 << 15)
    assert _plan._plan((64, 64, 64), 2, cfg, None).fused_group == 8  # 32768 // 4096
    assert _plan._plan((16, 512, 49), 2, cfg, None).fused_group == 41  # 32768 // 784
    assert _plan._plan((2, 64, 49), 2, cfg, None).fused_group == 8  # 64 / (4 * 2)
    assert _plan._plan((4096, 8, 49), 1, cfg, None).fused_group == 1


def test_fused_groups():
    """fused: about fused_runs_group_bytes of float32 x and dy per group, all threads' groups
    in at most a quarter of the L3 cache, and fused_channels_per_thread groups per thread
    where the channels allow."""
    cfg = kernels.Config(fused_runs_group_bytes=4 << 20, l3_bytes=32 << 20)
    assert _plan._plan((32, 512, 784), 2, cfg, None).fused_group == 20  # (4 MiB / 8) // 25088
    assert _plan._plan((32, 512, 784), 4, cfg, None).fused_group == 10  # L3 / 16 = 2 MiB
    assert _plan._plan((32, 64, 12544), 2, cfg, None).fused_group == 1
    assert _plan._plan((64, 32, 1024), 2, cfg, None).fused_group == 4  # 32 / (4 * 2)


def test_cache_sizes_from_sysfs(tmp_path):
    """The fused groups' defaults come from the L2 and L3 sizes the OS reports (else 1 MiB
    and 16 MiB); fused_short's, up to 1 MiB of float32 x and dy."""
    caches = [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "1280K"),
              ("3", "Unified", "32M")]
    for index, (level, kind, size) in enumerate(caches):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (folder / name).write_text(text + "\n")
    assert _plan.cache_bytes(2, str(tmp_path)) == 1280 << 10
    assert _plan.cache_bytes(3, str(tmp_path)) == 32 << 20
    assert _plan.cache_bytes(2, str(tmp_path / "missing"), default=12345) == 12345
    assert kernels.Config().fused_group_elements == min(_plan.cache_bytes(2) // 8, 1 << 17)
    assert kernels.Config().fused_runs_group_bytes == 4 * _plan.cache_bytes(2)
    assert kernels.Config().l3_bytes == _plan.cache_bytes(3, default=1 << 24)


def test_natural_paths_and_explain():
    """Which shapes reach which path with the default constants (docs/internals.md's map)."""
    expected = {(64, 3): "lanes", (8, 16, 5, 5): "lanes", (8, 16, 7, 7): "fused_short",
                (8, 3, 7, 7): "short", (2, 64, 16, 16): "fused", (2, 3, 16, 16): "runs",
                # runs of 16..31 in rows of >= 8192 lanes: short kernels where rows are few
                (16, 512, 4, 4): "fused_short", (64, 512, 4, 4): "fused_short",
                (65, 512, 4, 4): "lanes", (16, 511, 4, 4): "lanes", (16, 1024, 3, 5): "lanes",
                (16, 1024, 2, 8): "fused_short"}
    for shape, path in expected.items():
        _assert_path(np.zeros(shape, np.float32), path)
    text = bngrad.explain(np.zeros((4, 6, 10, 10))[:, :, ::2], num_threads=1)
    assert "copied: input" in text and "path='fused_short'" in text, text


def test_forcing_a_channels_first_path_on_rows_raises():
    with kernels.forced_path("short"), pytest.raises(ValueError, match="channels-first"):
        bngrad.explain(np.zeros((10, 3)))
    with pytest.raises(ValueError, match="unknown kernel path"):
        with kernels.forced_path("fast"):
            pass
