"""bngrad.torch's kernels on PyTorch's OpenMP team (bngrad._gomp, kernels._launch).

Every launcher on the team gives bitwise the results of Numba's pool, on any team size; every
item runs exactly once, on either pool, and Numba's pool shares the items between its threads
(kernels._launch serves both pools with the same compiled launchers); the team is PyTorch's
(no second pool of threads); a forked child finishes (a DataLoader worker with one thread, and
one left at two threads, one calling the NumPy API, which goes back to Numba's pool there);
Python threads calling bngrad.torch at once get the serial results; NumPy calls join the team
once PyTorch is imported, not before; where PyTorch's libgomp is missing, bngrad.torch falls
back to Numba's pool and says so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading

import numba
import numpy as np
import pytest
from numba import njit

from bngrad import _gomp, kernels
from bngrad.kernels import _launch
from conftest import bits_of, run_child

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not _gomp.available(),
                                reason=f"bngrad._gomp unavailable: {_gomp.unavailable_reason()}")
bt = pytest.importorskip("bngrad.torch")

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD_ENV = {**os.environ, "BNGRAD_TORCH_POOL": "torch"}  # the default, whatever the caller set


@pytest.fixture(autouse=True)
def torch_pool():
    """These tests run bngrad.torch on PyTorch's team (the default), whatever the environment
    set, and leave the pool as they found it."""
    previous = "numba" if bt.kernel_pool().startswith("numba") else "torch"
    bt.set_kernel_pool("torch")
    yield
    bt.set_kernel_pool(previous)


# --- every launcher, bitwise against Numba's pool ----------------------------------------------

# test_determinism's shapes (every path, both layouts, fused or not, several row blocks), and
# the layout's parallel copies: a cropped input, copied by rows (copy_rows), and grad_out
# channels-last beside a channels-first input, transposed (transpose_last_two).
EXTRA_SHAPES = [("cropped-6x5x7x40", (6, 5, 7, 40), 1, "cropped"),
                ("mixed-8x64x16x16", (8, 64, 16, 16), 1, "mixed")]
TEAM_THREADS = (2, 3, 4)


def _case(variant, shape, axis, layout):
    from conftest import make_case
    if layout == "mixed":
        return make_case(shape, axis, variant, "train", True, layouts=("contig", "chlast"),
                         seed=21)
    if layout != "cropped":
        return make_case(shape, axis, variant, "train", True, layouts=(layout, layout), seed=21)
    case = make_case(shape, axis, variant, "train", True, seed=21)
    big = np.zeros(shape[:-1] + (shape[-1] + 8,), dtype=case.input.dtype)
    big[..., :shape[-1]] = case.input
    return dataclasses.replace(case, input=big[..., :shape[-1]])


def child_main(out_path, variants=None):  # runs in a child process with NUMBA_NUM_THREADS=4
    import numba
    import test_determinism as td

    report = {"numba_threads": numba.config.NUMBA_NUM_THREADS, "cases": {}}
    # The same compiled launchers serve both pools: count the launches on the team.
    launched = dict.fromkeys(kernels.LAUNCHERS, 0)

    def counting(name, launch):
        def counted(*args):
            launched[name] += 1
            launch(*args)
        return counted

    for name in kernels.LAUNCHERS:
        setattr(_launch.torch_team, name, counting(name, getattr(_launch.torch_team, name)))
    # serial_elements=0: every launch of these small arrays goes to a pool, never serial.
    with kernels.override(serial_elements=0):
        for variant in variants or td.VARIANTS:
            for shape_id, shape, axis, layout in td.SHAPES + EXTRA_SHAPES:
                case = _case(variant, shape, axis, layout)
                for path in td.PATHS:
                    base = td._run_path(path, case, 2)  # Numba's pool
                    problem = None
                    for t in TEAM_THREADS:
                        got = _gomp.on_torch_team(td._run_path)(path, case, t)
                        for i, (a, b) in enumerate(zip(base, got)):
                            if a.dtype != b.dtype or a.shape != b.shape:
                                problem = f"output {i}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
                            elif not np.array_equal(bits_of(a), bits_of(b)):
                                differ = int(np.sum(bits_of(a) != bits_of(b)))
                                problem = (f"output {i}: {differ} of "
                                           f"{a.size} elements differ on a team of {t}")
                            if problem:
                                break
                        if problem:
                            break
                    report["cases"][f"{variant}-{shape_id}-{path}"] = problem
    report["launched"] = launched
    with open(out_path, "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def child_report(tmp_path_factory):
    return run_child("test_gomp", tmp_path_factory.mktemp("gomp"),
                     {**CHILD_ENV, "NUMBA_NUM_THREADS": "4"}, timeout=1200)


def test_team_results_are_numbas_bitwise(child_report):
    """Each path, dtype variant and layout on teams of 2, 3 and 4 vs Numba's pool on 2."""
    assert child_report["numba_threads"] == 4
    problems = {case: p for case, p in child_report["cases"].items() if p}
    assert not problems, problems
    assert len(child_report["cases"]) > 400


def test_every_launcher_ran_on_the_team(child_report):
    assert all(child_report["launched"].values()), child_report["launched"]


# --- the launch itself -------------------------------------------------------------------------

@njit(nogil=True)
def _count_item(item, hits):
    hits[item] += 1  # each item's own slot: a second run of an item would show as 2


@njit(nogil=True)
def _count(pool, team, n, *args):
    _launch._run_items(_count_item, pool[0], pool[1], team, n, args)


def _pool_address(pool):
    """The addresses _run_items takes: GOMP_parallel's and omp_get_thread_num's, or 0 and 0
    for Numba's pool."""
    if pool == "torch":
        return _gomp.parallel_address(), _gomp.thread_num_address()
    _launch._start_layer()  # Numba's layer registers numba_parallel_for
    return 0, 0


@pytest.mark.parametrize("n_items", [0, 1, 2, 3, 7, 17, 1000])
@pytest.mark.parametrize("team", [1, 2, 4])
@pytest.mark.parametrize("pool", ["torch", "numba"])
def test_every_item_runs_exactly_once(pool, n_items, team):
    hits = np.zeros(n_items, dtype=np.int64)
    _count(_pool_address(pool), team, n_items, hits)
    np.testing.assert_array_equal(hits, 1)


@njit(nogil=True)
def _thread_item(item, spin, thread, sink):
    thread[item] = numba.get_thread_id()
    s = 0.0
    for k in range(spin):  # about a millisecond: time enough for the team to wake
        s += np.sqrt(k + item)
    sink[item] = s


@njit(nogil=True)
def _threads_of(pool, team, n, *args):
    _launch._run_items(_thread_item, pool[0], pool[1], team, n, args)


def test_numbas_pool_shares_the_items():
    """On Numba's pool, a team of two runs the items on both threads (numba.get_thread_id:
    0 for the calling thread, 1 for the other)."""
    thread, sink = np.full(64, -1, dtype=np.int64), np.zeros(64)
    _threads_of(_pool_address("numba"), 2, 64, 1 << 20, thread, sink)
    assert (thread >= 0).all() and len(set(thread.tolist())) == 2, thread


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_runs_on_pytorchs_team_not_a_new_pool():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (torch.ones(1 << 20) * 2).sum()  # PyTorch's team of 2 exists from here on
        before = set(os.listdir("/proc/self/task"))
        hits = np.zeros(64, dtype=np.int64)
        _count(_pool_address("torch"), 2, 64, hits)
        # no thread of its own (threads of earlier tests may end meanwhile: a set, not a count)
        assert not set(os.listdir("/proc/self/task")) - before
        np.testing.assert_array_equal(hits, 1)
    finally:
        torch.set_num_threads(previous)


# --- who runs what -----------------------------------------------------------------------------

def test_every_call_gets_the_team_once_pytorch_is_imported():
    """bngrad.torch's calls, and the NumPy API's in a process that imported PyTorch (this
    one), run on PyTorch's team; small work stays serial; pool "numba" sends both back."""
    assert _gomp.on_torch_team(kernels.launcher)(False, 10) is _launch.torch_team
    assert kernels.launcher(False, 10) is _launch.torch_team
    assert _gomp.on_torch_team(kernels.launcher)(True, 10) is kernels.serial  # small: serial
    assert kernels.launcher(True, 10) is kernels.serial
    assert bt.kernel_pool() == "torch"
    bt.set_kernel_pool("numba")
    assert kernels.launcher(False, 10) is kernels.launch
    assert _gomp.on_torch_team(kernels.launcher)(False, 10) is kernels.launch


def test_numpy_calls_without_pytorch_keep_numbas_pool():
    """In a process that has not imported PyTorch the NumPy API runs on Numba's pool and does
    not import PyTorch; once PyTorch is imported it joins PyTorch's team, same bits."""
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import bngrad
        from bngrad import _gomp, kernels
        from bngrad.kernels import _launch
        x = np.random.default_rng(0).standard_normal((32, 64, 16, 16)).astype(np.float32)
        def step():
            out, mean, invstd = bngrad.batch_norm_forward(x, train=True, num_threads=2)
            return [out, *bngrad.batch_norm_backward(x[::-1].copy(), x, None, None, None,
                                                     mean, invstd, num_threads=2)]
        assert kernels.launcher(False, 10) is kernels.launch
        before = step()
        assert "torch" not in sys.modules, "the NumPy API imported PyTorch"
        import torch
        torch.set_num_threads(2)
        (torch.ones(1 << 20) * 2).sum()  # PyTorch's team of 2 exists
        assert kernels.launcher(False, 10) is _launch.torch_team
        after = step()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_switch_and_the_default():
    bt.set_kernel_pool("numba")
    assert bt.kernel_pool() == "numba"
    assert _gomp.on_torch_team(kernels.launcher)(False, 10) is kernels.launch
    with pytest.raises(ValueError, match="expected one of"):
        bt.set_kernel_pool("openmp")
    code = ("import os; os.environ.pop('BNGRAD_TORCH_POOL', None); import bngrad.torch as bt; "
            "assert bt.kernel_pool() == 'torch', bt.kernel_pool()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the team unless told otherwise
    code = ("import os; os.environ['BNGRAD_TORCH_POOL'] = 'numba'; import bngrad.torch as bt; "
            "assert bt.kernel_pool() == 'numba', bt.kernel_pool()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_custom_ops_keep_their_schemas():
    schema = str(torch.ops.bngrad.batch_norm_forward.default._schema)
    assert schema.startswith("bngrad::batch_norm_forward(Tensor input, Tensor? weight"), schema


def test_falls_back_to_numbas_pool_without_pytorchs_libgomp():
    code = textwrap.dedent("""
        import numpy as np, torch
        from bngrad import _gomp, kernels
        _gomp._runtime, _gomp._reason = None, "no libgomp (test)"  # as if it were not found
        import bngrad.torch as bt
        assert not _gomp.use_torch_team()
        assert bt.kernel_pool() == "numba (PyTorch's OpenMP team is unavailable: no libgomp (test))"
        assert _gomp.on_torch_team(kernels.launcher)(False, 10) is kernels.launch
        x = torch.randn(32, 64, 16, 16, requires_grad=True)
        bt.BatchNorm2d(64)(x).square().sum().backward()
        assert torch.isfinite(x.grad).all()
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_unavailable_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch now raises ImportError
        from bngrad import _gomp
        assert not _gomp.available()
        assert _gomp.unavailable_reason() == "PyTorch is not installed", _gomp.unavailable_reason()
        _gomp.set_kernel_pool("torch")
        assert _gomp.kernel_pool().startswith("numba (PyTorch's OpenMP team is unavailable")
        try:
            _gomp.parallel_address()
        except RuntimeError as exc:
            assert "PyTorch is not installed" in str(exc)
        else:
            raise AssertionError("no error without PyTorch")
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_libgomp_missing_or_not_loaded(tmp_path):
    runtime, reason = _gomp._find_runtime(str(tmp_path))
    assert runtime is None and "no libgomp" in reason
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libgomp.so.1").write_bytes(b"")  # present, but never loaded
    runtime, reason = _gomp._find_runtime(str(tmp_path))
    assert runtime is None and "not loaded" in reason


def test_finds_the_library_pytorch_loaded():
    path = _gomp._load().path
    assert path.startswith(os.path.dirname(torch.__file__))
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as maps:
            assert os.path.realpath(path) in maps.read()


def test_cache_stamp_covers_the_inlined_files():
    """An edit to the items' files must recompile the launchers (Numba stamps a cache with
    the function's own file only)."""
    from bngrad.kernels._cache import HERE, InlinedSourcesLocator, sources_stamp
    cache = _launch._reduce_runs._cache
    assert isinstance(cache._impl.locator, InlinedSourcesLocator)  # _ops.py, _elements.py
    assert cache._cache_file._source_stamp[1] == sources_stamp((os.path.join(HERE,
                                                                             "batchnorm.py"),))



# --- threads and fork --------------------------------------------------------------------------

# Large enough that every call runs in parallel (kernels._plan.runs_serial), on the team.
SHAPES = [(32, 64, 16, 16), (16, 128, 14, 14), (64, 256, 4, 4), (8, 32, 32, 32)]


def _step(x, grad):
    """bngrad.torch forward + backward: (output, grad_input, grad_weight, grad_bias)."""
    m = bt.BatchNorm2d(x.shape[1])
    with torch.no_grad():
        m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    x = x.detach().requires_grad_(True)
    y = m(x)
    y.backward(grad)
    return [t.detach().clone() for t in (y, x.grad, m.weight.grad, m.bias.grad)]


def _inputs(shape, seed, channels_last=False):
    g = torch.Generator().manual_seed(seed)
    x, grad = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    if channels_last:
        x, grad = (t.to(memory_format=torch.channels_last) for t in (x, grad))
    return x, grad


def test_python_threads_at_once_match_serial():
    """8 Python threads calling bngrad.torch at once (each its own team) get the results of
    the same calls made one at a time."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        work = [_inputs(SHAPES[i % len(SHAPES)], i, channels_last=i % 3 == 2) for i in range(8)]
        serial = [_step(x, g) for x, g in work]
        results: list[list] = [[] for _ in work]
        start = threading.Barrier(len(work))

        def worker(i):
            torch.set_num_threads(2)  # per thread in PyTorch too
            start.wait()
            for _ in range(5):
                results[i].append(_step(*work[i]))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(work))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert not any(t.is_alive() for t in threads), "a calling thread never finished"
        for ref, outs in zip(serial, results):
            assert len(outs) == 5
            for out in outs:
                for a, b in zip(ref, out):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    finally:
        torch.set_num_threads(previous)


def _numpy_step(x, grad, team=True):
    """The NumPy API's forward + backward as bngrad.torch runs them (on the team), or as a
    NumPy caller does (``team=False``: the pool _gomp.use_torch_team chooses)."""
    import bngrad

    def step():
        out, mean, invstd = bngrad.batch_norm_forward(x, train=True, num_threads=2)
        return [out, *bngrad.batch_norm_backward(grad, x, None, None, None, mean, invstd,
                                                 num_threads=2)]
    return _gomp.on_torch_team(step)() if team else step()


_FORK_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np, torch
    sys.path.insert(0, {here!r})
    import test_gomp as tg

    torch.set_num_threads(2)
    inputs = tg._inputs((32, 64, 16, 16), 0)
    ref = tg._step(*inputs)  # the parent's team of 2 (PyTorch's, running bngrad) exists
    arrays = [t.numpy() for t in inputs]
    ref_np = tg._numpy_step(*arrays)
    ref_plain = tg._numpy_step(*arrays, team=False)  # the NumPy API: on the team here too
    for child in ("one-thread", "two-threads", "numpy-api"):
        pid = os.fork()
        if pid == 0:
            if child == "one-thread":  # what a DataLoader worker does, then bngrad.torch
                torch.set_num_threads(1)
                ok = all(all(torch.equal(a, b) for a, b in zip(ref, tg._step(*inputs)))
                         for _ in range(2))
            elif child == "two-threads":  # bngrad's kernels alone (PyTorch's would hang here)
                ok = all(all(np.array_equal(a, b) for a, b in zip(ref_np,
                                                                   tg._numpy_step(*arrays)))
                         for _ in range(2))
            else:  # the NumPy API: back on Numba's pool (fork-safe), in parallel
                ok = not tg._gomp.use_torch_team() and all(
                    all(np.array_equal(a, b) for a, b in zip(
                        ref_plain, tg._numpy_step(*arrays, team=False))) for _ in range(2))
            os._exit(0 if ok else 3)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:  # hung: kill it rather than leave it behind
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = 124
                break
            time.sleep(0.01)
        print(child, "exit", code)
        if code:
            sys.exit(code)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_children_complete():
    """Children forked after bngrad.torch ran on PyTorch's team of 2 finish with the parent's
    bits: one set to one thread as a DataLoader worker is runs bngrad.torch forward and
    backward; one left at two threads runs bngrad's kernels as bngrad.torch calls them (on the
    team: serially in a forked child), where a PyTorch operator would hang."""
    proc = subprocess.run([sys.executable, "-c", _FORK_CHILD.format(here=HERE)],
                          capture_output=True, text=True, timeout=300, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.split() == ["one-thread", "exit", "0", "two-threads", "exit", "0",
                                   "numpy-api", "exit", "0"]


_MULTIPROCESSING_CHILD = textwrap.dedent("""
    import multiprocessing, sys
    import torch

    def work(queue):
        import numpy as np
        import bngrad
        from bngrad import _gomp
        x = np.random.default_rng(0).standard_normal((32, 64, 16, 16)).astype(np.float32)
        out, mean, invstd = bngrad.batch_norm_forward(x, train=True, num_threads=2)
        bngrad.batch_norm_backward(x, x, None, None, None, mean, invstd, num_threads=2)
        queue.put(_gomp.use_torch_team())

    if __name__ == "__main__":
        torch.set_num_threads(2)
        (torch.ones(1 << 20) * 2).sum()  # the parent has a team of 2, and no bngrad
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=work, args=(queue,))
        child.start()
        child.join(120)
        if child.is_alive():  # hung: kill it rather than leave it behind
            child.kill()
            child.join()
            sys.exit(124)
        print("exit", child.exitcode, "team", queue.get(timeout=10))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_multiprocessing_child_of_a_pytorch_parent_completes(tmp_path):
    """A multiprocessing child forked from a process that ran PyTorch's parallel operators
    before importing bngrad (so bngrad could not see the fork) runs the NumPy API to the
    end, on Numba's pool, where PyTorch's team would hang."""
    script = tmp_path / "mp_child.py"
    script.write_text(_MULTIPROCESSING_CHILD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=CHILD_ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout.split() == ["exit", "0", "team", "False"]
