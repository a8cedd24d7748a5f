"""bngrad._gomp: kernels launched on PyTorch's OpenMP team (issue 12, item 1 prototype).

Results must be bitwise those of the prange kernels on any team size, every item must run
exactly once, the team must be PyTorch's (no second pool of threads), a forked child must
finish, and Python threads launching at once must not disturb each other.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from numba import carray, njit

from bngrad import _gomp

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not _gomp.available(),
                                reason=f"bngrad._gomp unavailable: {_gomp.unavailable_reason()}")

THREADS = [1, 2, 4]
# (A, C, B), seg: one segment per run, runs cut in segments with a ragged last one, tiny.
CASES = [((4, 8, 256), 256), ((3, 5, 300), 128), ((1, 1, 7), 7)]


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape, dtype=np.float32) * 3 + 1
    dy = rng.standard_normal(shape, dtype=np.float32)
    coef = rng.standard_normal((4, shape[1])).astype(np.float32)
    return x, dy, coef


def _bits(a):
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


def _elemt_numpy(x, dy, coef):
    """a*dy - b*(x - mean) - d in float32, operation by operation, as the kernel does it."""
    a, b, d, m = (coef[i][None, :, None] for i in range(4))
    return a * dy - b * (x - m) - d


def _reduce_numpy(x, dy, mean, rows, seg):
    """The kernel's tile sums, each added in element order (cumsum adds sequentially)."""
    A, C, B = x.shape
    tiles = np.empty((-(-A // rows), -(-B // seg), C, 2))
    for j in range(tiles.shape[0]):
        for s in range(tiles.shape[1]):
            for c in range(C):
                d = dy[j * rows:(j + 1) * rows, c, s * seg:(s + 1) * seg].astype(np.float64)
                xc = x[j * rows:(j + 1) * rows, c, s * seg:(s + 1) * seg].astype(np.float64)
                tiles[j, s, c, 0] = np.cumsum(d.ravel())[-1]
                tiles[j, s, c, 1] = np.cumsum((d * (xc - mean[c])).ravel())[-1]
    return tiles


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("shape,seg", CASES)
def test_elemt_bitwise_equals_numpy(shape, seg, threads):
    x, dy, coef = _data(shape)
    out = np.full_like(x, np.nan)
    _gomp.elemt_channels_first(x, dy, out, coef, seg, num_threads=threads)
    np.testing.assert_array_equal(_bits(out), _bits(_elemt_numpy(x, dy, coef)))


@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("shape,seg", CASES)
def test_reduce_bitwise_equals_numpy(shape, seg, threads):
    x, dy, _ = _data(shape, seed=1)
    mean = np.random.default_rng(2).standard_normal(shape[1])
    rows = 3
    ref = _reduce_numpy(x, dy, mean, rows, seg)
    out = np.full_like(ref, np.nan)
    _gomp.reduce_channels_first(x, dy, mean, rows, seg, out, num_threads=threads)
    np.testing.assert_array_equal(_bits(out), _bits(ref))


def test_wrong_arguments_are_refused():
    x, dy, coef = _data((2, 3, 4))
    with pytest.raises(ValueError, match="float32"):
        _gomp.elemt_channels_first(x, dy.astype(np.float64), x.copy(), coef, 4)
    with pytest.raises(ValueError, match="shapes differ"):
        _gomp.elemt_channels_first(x, dy[:1].copy(), x.copy(), coef, 4)
    with pytest.raises(ValueError, match="seg must be at least 1"):
        _gomp.elemt_channels_first(x, dy, x.copy(), coef, 0)
    with pytest.raises(ValueError, match="partial"):
        _gomp.reduce_channels_first(x, dy, np.zeros(3), 1, 4, np.zeros((2, 1, 3, 1)))


@njit(nogil=True, error_model="numpy")
def _count_body(item, args):
    hits = carray(_gomp.voidptr(args[0]), args[1], np.int64)
    hits[item] += 1  # each item's own slot: a second run of an item would show as 2


_count = _gomp.kernel(_count_body)


@pytest.mark.parametrize("n_items", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize("threads", THREADS)
def test_every_item_runs_exactly_once(n_items, threads):
    hits = np.zeros(n_items, dtype=np.int64)
    _count.launch(np.array([_gomp.address(hits), n_items]), n_items, threads)
    np.testing.assert_array_equal(hits, 1)


def test_no_items_is_a_no_op():
    _count.launch(np.array([0, 0]), 0, 2)  # the null address is never read


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_runs_on_pytorchs_team_not_a_new_pool():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (torch.ones(1 << 20) * 2).sum()  # PyTorch's team of 2 exists from here on
        before = len(os.listdir("/proc/self/task"))
        hits = np.zeros(64, dtype=np.int64)
        _count.launch(np.array([_gomp.address(hits), 64]), 64, 2)
        assert len(os.listdir("/proc/self/task")) == before
        np.testing.assert_array_equal(hits, 1)
    finally:
        torch.set_num_threads(previous)


def test_python_threads_launching_at_once_match_serial():
    shapes = [((8, 16, 300), 128), ((4, 32, 256), 256), ((16, 8, 100), 100), ((2, 3, 1000), 512)]
    inputs = [_data(shape, seed=i) for i, (shape, _) in enumerate(shapes)]
    serial = []
    for (_, seg), (x, dy, coef) in zip(shapes, inputs):
        ref = np.empty_like(x)
        _gomp.elemt_channels_first(x, dy, ref, coef, seg, num_threads=1)
        serial.append(ref)
    results = [[] for _ in shapes]
    start = threading.Barrier(len(shapes))

    def worker(i):
        (_, seg), (x, dy, coef) = shapes[i], inputs[i]
        start.wait()
        for _ in range(20):
            out = np.full_like(x, np.nan)
            _gomp.elemt_channels_first(x, dy, out, coef, seg, num_threads=2)
            results[i].append(out)

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(len(shapes))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a launching thread never finished"
    for ref, outs in zip(serial, results):
        assert len(outs) == 20
        for out in outs:
            np.testing.assert_array_equal(_bits(out), _bits(ref))


_FORK_CHILD = textwrap.dedent("""
    import os, signal, sys, time
    import numpy as np
    import torch
    from bngrad import _gomp

    torch.set_num_threads(2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 32, 300), dtype=np.float32)
    dy = rng.standard_normal((16, 32, 300), dtype=np.float32)
    coef = rng.standard_normal((4, 32)).astype(np.float32)
    a, b, d, m = (coef[i][None, :, None] for i in range(4))
    ref = a * dy - b * (x - m) - d
    # The parent's team of 2 exists (PyTorch's and ours) before the fork.
    (torch.ones(1 << 20) * 2).sum()
    _gomp.elemt_channels_first(x, dy, np.empty_like(x), coef, 128, num_threads=2)
    for child in ("one-thread", "default-threads"):
        pid = os.fork()
        if pid == 0:
            if child == "one-thread":
                torch.set_num_threads(1)  # what a DataLoader worker does
            out = np.empty_like(x)
            _gomp.elemt_channels_first(x, dy, out, coef, 128)
            os._exit(0 if np.array_equal(out.view(np.uint32), ref.view(np.uint32)) else 3)
        deadline = time.monotonic() + 30
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
    """Children forked after both PyTorch and bngrad._gomp ran teams of 2 finish, with the
    same bits: one set to one thread as a DataLoader worker is, and one left at two (where a
    PyTorch operator would hang; bngrad._gomp runs serially in a forked child)."""
    proc = subprocess.run([sys.executable, "-c", _FORK_CHILD], capture_output=True, text=True,
                          timeout=90)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def test_unavailable_without_torch():
    code = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch now raises ImportError
        import numpy as np
        from bngrad import _gomp
        assert not _gomp.available()
        assert _gomp.unavailable_reason() == "PyTorch is not installed", _gomp.unavailable_reason()
        try:
            _gomp.elemt_channels_first(*(np.zeros((1, 1, 1), np.float32),) * 3,
                                       np.zeros((4, 1), np.float32), 1)
        except RuntimeError as exc:
            assert "PyTorch is not installed" in str(exc)
        else:
            raise AssertionError("launch without PyTorch did not raise")
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
