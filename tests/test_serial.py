"""Serial calls: the serial launchers give the parallel launchers' bits, the threshold chooses
between them as documented, and a serial call never touches Numba's thread pool.

Small calls (and every call on one thread) run their work items on the calling thread
(``kernels.serial``, chosen by ``kernels._plan.runs_serial``: ``Config.serial_elements``). The
items, their order and the combination of their results are those of the parallel launchers,
so every result must be bitwise the same either way. Checked here on every kernel path
(tests/test_paths.py's grids, whose shrunk constants give several items per launch), forced
serial and forced parallel through ``kernels.override(serial_elements=...)``, for every dtype
variant and every operation of tests/test_determinism.py; and without overrides, on shapes
just below and above the default threshold. No test here depends on timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import bngrad
from bngrad import kernels
from bngrad.kernels import _plan
from conftest import DTYPE_VARIANTS, make_case
from test_determinism import PATHS, _run_path
from test_paths import CASES, _case_id, _on_path
from tolerances import assert_bitwise_equal

VARIANTS = [v.id for v in DTYPE_VARIANTS]
ALWAYS_SERIAL = 1 << 62  # serial_elements: every call serial
NEVER_SERIAL = 0         # every call parallel (bar launches of a single item)


def _all_paths(case, threads):
    return {path: _run_path(path, case, threads) for path in PATHS}


def _assert_same(a, b):
    for path in a:
        assert len(a[path]) == len(b[path]), path
        for i, (x, y) in enumerate(zip(a[path], b[path])):
            assert_bitwise_equal(x, y, f"{path}, output {i}")


def test_runs_serial_formula():
    S = kernels.Config().serial_elements
    assert _plan.runs_serial(10 ** 12, 1)  # one thread: always serial
    assert _plan.runs_serial(2 * S - 1, 2) and not _plan.runs_serial(2 * S, 2)
    assert _plan.runs_serial(4 * S // 3 - 1, 4) and not _plan.runs_serial(4 * S // 3 + 1, 4)
    with kernels.override(serial_elements=100):
        assert _plan.runs_serial(199, 2) and not _plan.runs_serial(200, 2)
        # a fused path's training calls launch once: half the threshold
        assert _plan._runs_serial(kernels.config(), 99, 2, one_launch=True)
        assert not _plan._runs_serial(kernels.config(), 100, 2, one_launch=True)
    with kernels.override(serial_elements=NEVER_SERIAL):
        assert not _plan.runs_serial(1, 2) and _plan.runs_serial(1, 1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_serial_and_parallel_launchers_give_the_same_bits(case, variant):
    """Every path, operation and dtype variant: forced serial == forced parallel, bitwise."""
    grid, path = case
    c = make_case(grid[1], 1, variant, "train", True, layouts=(grid[2], grid[2]), seed=13)
    results = {}
    for limit in (ALWAYS_SERIAL, NEVER_SERIAL):
        with _on_path(grid, path), kernels.override(serial_elements=limit):
            plan_text = bngrad.explain(c.input, c.grad_out, num_threads=2)
            assert f"path={path!r}" in plan_text, plan_text
            # a 2-core machine caps 2 threads at 2; a 1-core machine runs everything serially
            serial = limit == ALWAYS_SERIAL or bngrad._threads.resolve_num_threads(2) == 1
            assert ("(serial)" in plan_text) == serial, plan_text
            results[limit] = _all_paths(c, 2)
    _assert_same(results[ALWAYS_SERIAL], results[NEVER_SERIAL])


# One-call passes (KernelPlan.one_call: lanes, one piece per pass): channels-first runs as
# lanes (several row blocks), and channels-last rows folded whole for both passes (32 rows of
# 6 channels: 4 into 24 lanes, two column groups, for reductions; 2 into 12 for elementwise)
ONE_CALL_GRIDS = [
    ("chfirst", (11, 5, 6), "contig", dict(tile=60, min_block_rows=2)),
    ("nhwc-folded-whole", (8, 6, 2, 2), "chlast",
     dict(fold_lanes=24, elemt_lanes=12, tile=24, min_block_rows=4, column_group=16)),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("grid", ONE_CALL_GRIDS, ids=[g[0] for g in ONE_CALL_GRIDS])
def test_one_call_passes_give_the_launchers_bits(grid, variant, monkeypatch):
    """A call whose passes take one piece each runs its plain training backward and forward
    as one compiled call (kernels.batchnorm.backward_one_call, forward_one_call; the fused
    variants take the launchers), serially or on a team: bitwise the results of the same call
    through the launchers, for every operation and dtype."""
    import dataclasses

    from bngrad.kernels import batchnorm
    ran = []
    for name in ("backward_one_call", "forward_one_call"):
        real = getattr(batchnorm, name)
        monkeypatch.setattr(batchnorm, name,
                            lambda *a, _real=real, _name=name: (ran.append(_name), _real(*a)))
    real_plan = _plan._plan
    c = make_case(grid[1], 1, variant, "train", True, layouts=(grid[2], grid[2]), seed=19)
    results = {}
    for limit in (ALWAYS_SERIAL, NEVER_SERIAL):
        for one_call in (True, False):
            monkeypatch.setattr(_plan, "_plan", lambda *a, _on=one_call: dataclasses.replace(
                real_plan(*a), one_call=real_plan(*a).one_call and _on))
            with kernels.override(serial_elements=limit, **grid[3]):
                plan = bngrad._layout.plan(c.input, c.grad_out, 1, 2).kernel
                assert plan.one_call == one_call
                ran.clear()
                results[limit, one_call] = _all_paths(c, 2)
                assert set(ran) == ({"backward_one_call", "forward_one_call"} if one_call
                                    else set())
    first = results[ALWAYS_SERIAL, False]
    for got in results.values():
        _assert_same(first, got)


def _threshold_shapes():
    """Shapes just below and at the default threshold for 2 threads: channels-first short runs
    (a fused path's, one launch: serial_elements) and channels-last 2-D (two launches:
    2 * serial_elements)."""
    S = kernels.Config().serial_elements
    return [("chfirst-below", (S // 4096 - 1, 64, 64)), ("chfirst-at", (S // 4096, 64, 64)),
            ("2d-below", (2 * S // 64 - 1, 64)), ("2d-above", (2 * S // 64 + 1, 64))]


@pytest.mark.parametrize("variant", ["float32", "bfloat16-p32", "float64"])
@pytest.mark.parametrize("name,shape", _threshold_shapes(), ids=[s[0] for s in _threshold_shapes()])
def test_across_the_default_threshold(name, shape, variant):
    """Without overrides: the plan is serial below the threshold and parallel from it on
    (2 threads), and either way the results are those of one thread (always serial)."""
    if bngrad._threads.resolve_num_threads(2) < 2:
        pytest.skip("one core: every call is serial")
    c = make_case(shape, 1, variant, "train", True, layouts=("contig", "contig"), seed=17)
    plan_text = bngrad.explain(c.input, num_threads=2)
    assert ("(serial)" in plan_text) == name.endswith("below"), plan_text
    assert "(serial)" in bngrad.explain(c.input, num_threads=1)
    _assert_same(_all_paths(c, 1), _all_paths(c, 2))


_CHILD = r"""
import json, sys
import numpy as np
import numba
import bngrad
from bngrad import _threads
rng = np.random.default_rng(0)
x = rng.standard_normal((4, 8, 5, 5)).astype(np.float32)
big = rng.standard_normal((64, 64, 32, 32)).astype(np.float32)  # far above the threshold
set_calls = []
real_set = numba.set_num_threads
numba.set_num_threads = lambda n: (set_calls.append(n), real_set(n))[1]
for a, t in ((x, 2), (x, 1), (big, 1), (x.transpose(0, 2, 3, 1), 2), (x[:, :, ::2], 2)):
    y, m, s = bngrad.batch_norm_forward(a, num_threads=t)
    bngrad.batch_norm_backward(a, a, None, None, None, m, s, num_threads=t)
    bngrad.batch_norm_backward(a, a, None, None, None, None, None, num_threads=t)
    bngrad.batch_norm_moments(a, num_threads=t)
print(json.dumps({"pool_started": bool(numba.np.ufunc.parallel._is_initialized),
                  "fork_gate_used": _threads._fork_gate._used, "set_calls": set_calls}))
"""


def test_serial_calls_never_touch_the_thread_pool():
    """In a fresh process, small calls on 2 threads (NCHW, NHWC, a sliced input that is
    copied) and a large one on 1 thread neither start Numba's pool, nor set its thread count,
    nor enter a parallel region (the fork gate)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"pool_started": False, "fork_gate_used": False, "set_calls": []}


def test_parallel_calls_still_enter_the_region():
    """The converse, so that the test above cannot pass vacuously: a call above the threshold
    on 2 threads holds this thread's fork-gate lock (bngrad._threads.gate)."""
    if bngrad._threads.resolve_num_threads(2) < 2:
        pytest.skip("one core: every call is serial")
    x = np.zeros((64, 64, 32, 32), np.float32)
    gate = bngrad._threads._fork_gate
    real = gate.lock
    held = []

    class Spy:
        def __init__(self, lock):
            self._lock = lock

        def __enter__(self):
            held.append(True)
            return self._lock.__enter__()

        def __exit__(self, *exc):
            return self._lock.__exit__(*exc)

    gate.lock = lambda: Spy(real())
    try:
        bngrad.batch_norm_forward(x, num_threads=2)
    finally:
        del gate.lock
    assert held


def test_serial_launchers_run_their_items_in_the_launchers_order():
    """The serial launchers name their loop themselves (``_in_order`` or ``_last_to_first``):
    each must run its item in the order ``kernels.batchnorm.LAST_TO_FIRST`` gives the parallel
    launchers and the one-call passes, so that a change to that set changes them too (the
    order changes no bits, so only the source can tell)."""
    import inspect
    import re

    from bngrad.kernels import batchnorm
    launchers = {name: f for name, f in vars(batchnorm).items()
                 if name.endswith("_serial") and hasattr(f, "py_func")}
    assert len(launchers) >= 10
    for name, launcher in launchers.items():
        loop = re.findall(r"(_in_order|_last_to_first)\((\w+), n, args\)",
                          inspect.getsource(launcher.py_func))
        assert len(loop) == 1, (name, loop)
        (order, item), = loop
        wanted = batchnorm.last_to_first(getattr(batchnorm, item))
        assert (order == "_last_to_first") == wanted, name
