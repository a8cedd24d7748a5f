"""Concurrency: several Python threads calling at once, and fork() after the parent has called.

Numba's threading layers differ (workqueue is not thread-safe, OpenMP is not fork-safe);
bngrad must be correct under both uses and must never hang. Every wait has a timeout so a
hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import bngrad
from conftest import bits_of, make_case

TIMEOUT = 120  # seconds; generous for a loaded 2-core machine, finite for a hang
needs_fork_and_alarms = pytest.mark.skipif(
    not hasattr(signal, "setitimer") or not hasattr(os, "fork"),
    reason="needs os.fork and signal.setitimer")


def _same(xs, ys):
    return all((x is None and y is None) or np.array_equal(bits_of(x), bits_of(y))
               for x, y in zip(xs, ys))


def _work(i):
    """A different problem per worker: dtype, layout and shape vary with i."""
    variant = ["float32", "bfloat16-p32", "float64", "float16"][i % 4]
    layout = ["contig", "chlast"][i % 2]
    case = make_case((6 + i, 16, 20, 30), 1, variant, "train", True, layouts=(layout, layout),
                     seed=i)
    return case


def _call(case, num_threads):
    back = bngrad.batch_norm_backward(*case.args(), num_threads=num_threads)
    rm, rv = case.running_mean.copy(), case.running_var.copy()
    fwd = bngrad.batch_norm_forward(case.input, case.weight, case.weight, rm, rv, True,
                                    num_threads=num_threads)
    return list(back) + list(fwd) + [rm, rv]


def test_several_python_threads_at_once():
    n_workers, repeats = 4, 8
    cases = [_work(i) for i in range(n_workers)]
    thread_counts = [None, 1, 2, 3]
    expected = [_call(c, 1) for c in cases]  # serial results first
    errors: list[str] = []
    barrier = threading.Barrier(n_workers)

    def worker(i):
        try:
            barrier.wait(timeout=TIMEOUT)
            for r in range(repeats):
                got = _call(cases[i], thread_counts[(i + r) % len(thread_counts)])
                if not _same(got, expected[i]):
                    errors.append(f"worker {i}, repeat {r}: result differs from the serial one")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"worker {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n_workers)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + TIMEOUT
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "threads still running: a hang?"
    assert not errors, "\n".join(errors)


def _child_check(case, expected) -> int:
    """Exit status for a forked child: 0 ok, 1 wrong result, 2 exception."""
    try:
        got = _call(case, None)
        got_one = _call(case, 1)
        return 0 if _same(got, expected) and _same(got_one, expected) else 1
    except BaseException:  # noqa: BLE001
        return 2


def _wait_or_kill(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_os_fork_after_parent_called():
    case = _work(1)
    expected = _call(case, None)  # the parent has started its thread pool
    pid = os.fork()
    if pid == 0:  # child: never return into pytest
        code = 3
        try:
            code = _child_check(case, expected)
        finally:
            os._exit(code)
    code = _wait_or_kill(pid, TIMEOUT)
    assert code is not None, f"forked child hung for {TIMEOUT} s"
    assert code == 0, {1: "forked child got a different result", 2: "forked child raised"}.get(
        code, f"forked child exited with {code}")
    # and the parent still works after the fork
    assert _same(_call(case, None), expected)


def _mp_target(queue, seed):
    case = _work(seed)
    got = _call(case, None)
    queue.put([None if g is None else g.astype(np.float64) for g in got])


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                    reason="no fork start method")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_multiprocessing_fork_context_after_parent_called():
    ctx = multiprocessing.get_context("fork")
    seeds = [0, 1, 2]
    expected = {s: _call(_work(s), None) for s in seeds}
    queues, procs = {}, {}
    for s in seeds:
        queues[s] = ctx.Queue()
        procs[s] = ctx.Process(target=_mp_target, args=(queues[s], s), daemon=True)
        procs[s].start()
    try:
        for s in seeds:
            got = queues[s].get(timeout=TIMEOUT)
            want = [None if e is None else e.astype(np.float64) for e in expected[s]]
            assert _same(got, want), f"child {s}: different result"
        for s in seeds:
            procs[s].join(timeout=TIMEOUT)
            assert procs[s].exitcode == 0, f"child {s} exit code {procs[s].exitcode}"
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)


_WORKQUEUE_SCRIPT = """
import threading
import numpy as np
import bngrad
from bngrad import _threads

assert not _threads._LAUNCH_IS_THREAD_SAFE, "workqueue launches must be serialised"
rng = np.random.default_rng(0)
arrays = [(rng.standard_normal((8, 16, 50)).astype(np.float32),
           rng.standard_normal((8, 16, 50)).astype(np.float32)) for _ in range(4)]
expected = [bngrad.batch_norm_backward(dy, x, num_threads=1) for dy, x in arrays]
failures = []

def worker(i):
    dy, x = arrays[i]
    for _ in range(20):
        got = bngrad.batch_norm_backward(dy, x, num_threads=2)
        if not all(np.array_equal(g, e) for g, e in zip(got, expected[i])):
            failures.append(i)

threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert not failures, failures
print("layer", _threads.threading_layer())
"""


def test_workqueue_fallback_is_serialised_and_correct():
    """Without TBB (here: the user forces workqueue), concurrent calls take turns, correctly."""
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue")
    result = subprocess.run([sys.executable, "-c", _WORKQUEUE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "layer workqueue" in result.stdout


def _nested_in_signal_handler(outer_shape, inner_shape, dtype, channel_axis):
    """Run outer calls while SIGALRM keeps firing a small call on the same thread; return
    (how often the handler ran, list of outer results that differ from an undisturbed one)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(outer_shape).astype(dtype)
    dy = rng.standard_normal(outer_shape).astype(dtype)
    small = rng.standard_normal(inner_shape).astype(dtype)
    kw = dict(channel_axis=channel_axis)
    expected = bngrad.batch_norm_backward(dy, x, **kw)
    small_expected = bngrad.batch_norm_backward(small, small, **kw)
    fired, wrong, inside = [0], [], [False]

    def handler(signum, frame):
        if inside[0]:  # the timer fired again during the handler's own call: no deeper nesting
            return
        inside[0] = True
        fired[0] += 1
        got = bngrad.batch_norm_backward(small, small, **kw)
        if not _same(got, small_expected):
            wrong.append("nested call")
        inside[0] = False

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.0003, 0.0003)
        deadline = time.monotonic() + 10
        for i in range(200):  # bounded: stop once the handler has run often enough
            got = bngrad.batch_norm_backward(dy, x, **kw)
            if not _same(got, expected):
                wrong.append(f"outer call {i}")
            if fired[0] >= 100 or time.monotonic() > deadline:
                break
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return fired[0], wrong


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("outer_shape, inner_shape, channel_axis", [
    ((4096, 256), (64, 8), 1),             # channels-last reduction (partial sums per row block)
    ((16, 64, 100), (4, 8, 50), 1),        # short channels-first runs
    ((8, 4, 3000), (4, 8, 50), 1),         # channels-first tiles, too few channels to fuse
])
def test_call_nested_in_a_signal_handler_leaves_the_outer_call_intact(
        outer_shape, inner_shape, channel_axis):
    """A call made by a signal handler (or a finaliser) while another call is running on the
    same thread must not share the outer call's scratch buffers: both give their own results."""
    fired, wrong = _nested_in_signal_handler(outer_shape, inner_shape, np.float32, channel_axis)
    assert fired > 0, "the signal handler never ran: the test proves nothing"
    assert not wrong, f"{len(wrong)} results changed by nested calls: {wrong[:5]}"


# A thread keeps making small calls (many kernel launches, so TBB's workers keep waking and
# going to sleep) while the main thread forks; every child makes a call and exits. Before
# bngrad closed a gate around fork(), children hung in a few percent of forks (more with more
# worker threads: NUMBA_NUM_THREADS=8 below) and now and then the parent did too.
_FORK_RACE_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np
import bngrad

MIN_FORKS, SECONDS, CHILD_TIMEOUT = {min_forks}, {seconds}, {child_timeout}
rng = np.random.default_rng(0)
busy_x = rng.standard_normal((8, 16, 50)).astype(np.float32)
small = rng.standard_normal((4, 8, 50)).astype(np.float32)
expected = bngrad.batch_norm_backward(small, small)
stop = threading.Event()
calls = [0]

def busy():
    while not stop.is_set():
        bngrad.batch_norm_backward(busy_x, busy_x)
        calls[0] += 1

def child():
    try:
        got = bngrad.batch_norm_backward(small, small)
        os._exit(0 if all(np.array_equal(g, e) for g, e in zip(got, expected)) else 1)
    finally:
        os._exit(2)

def wait(pid, what):
    deadline = time.monotonic() + CHILD_TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            if code:
                sys.exit(f"{{what}}: child exited with {{code}}")
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            sys.exit(f"{{what}}: child hung")
        time.sleep(0.002)

thread = threading.Thread(target=busy, daemon=True)
thread.start()
while not calls[0]:
    time.sleep(0.001)
forks, end = 0, time.monotonic() + SECONDS
while forks < MIN_FORKS or time.monotonic() < end:
    time.sleep(0.001 * (forks % 5))  # at different points of the busy thread's calls
    pid = os.fork()
    if pid == 0:
        child()
    forks += 1
    wait(pid, f"fork {{forks}}")
stop.set()
thread.join(CHILD_TIMEOUT)
assert not thread.is_alive(), "the busy thread is stuck"
print("ok:", forks, "forks,", calls[0], "calls in the busy thread")
"""


def _run_script(script: str, env_extra: dict) -> tuple[int, str]:
    """(exit status, output) of ``script`` in a new Python process; a hang fails the test,
    after killing the process and any children it forked (its own process group)."""
    proc = subprocess.Popen([sys.executable, "-W", "ignore::DeprecationWarning", "-c", script],
                            env=dict(os.environ, **env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the parent process hung (no result in {TIMEOUT} s)")
    return proc.returncode, output


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
@pytest.mark.parametrize("layer, seconds", [("tbb", 6), ("workqueue", 2)])
def test_fork_while_another_thread_is_calling(layer, seconds):
    # TBB: forks for 6 s (at least 30), as a few percent of them hung before: all but
    # certainly one. The workqueue fallback hung at once (the child inherited the launch lock
    # held by the busy thread).
    env = {"NUMBA_NUM_THREADS": "8"}
    if layer == "workqueue":
        env["NUMBA_THREADING_LAYER"] = "workqueue"
    code, output = _run_script(_FORK_RACE_SCRIPT.format(min_forks=30, seconds=seconds,
                                                        child_timeout=10), env)
    assert code == 0 and "ok:" in output, output[-2000:]


# The main thread is inside a large call when SIGALRM's handler forks: the fork comes from a
# thread whose own parallel region is open, and must not wait for it (it would wait forever).
# The timer is one-shot, re-armed per call, so that the handler never runs nested.
_FORK_IN_REGION_SCRIPT = """
import os, signal, sys, time
import numpy as np
import bngrad

rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 256)).astype(np.float32)
small = rng.standard_normal((4, 8, 50)).astype(np.float32)
expected = bngrad.batch_norm_backward(small, small)
outer = bngrad.batch_norm_backward(x, x)
forks = []

def handler(signum, frame):
    pid = os.fork()
    if pid == 0:
        try:
            got = bngrad.batch_norm_backward(small, small)
            os._exit(0 if all(np.array_equal(g, e) for g, e in zip(got, expected)) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 10
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            forks.append(os.waitstatus_to_exitcode(status))
            return
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            sys.exit("child hung")
        time.sleep(0.002)

signal.signal(signal.SIGALRM, handler)
deadline = time.monotonic() + 20
while len(forks) < 10 and time.monotonic() < deadline:
    signal.setitimer(signal.ITIMER_REAL, 0.001)
    got = bngrad.batch_norm_backward(x, x)
    signal.setitimer(signal.ITIMER_REAL, 0)
    assert all(np.array_equal(g, e) for g, e in zip(got, outer)), "outer call changed"
assert len(forks) >= 10 and not any(forks), f"child exit codes {forks}"
print("ok")
"""


@needs_fork_and_alarms
def test_fork_from_a_signal_handler_during_a_call():
    code, output = _run_script(_FORK_IN_REGION_SCRIPT, {})
    assert code == 0 and "ok" in output, output[-2000:]


# A signal handler that calls bngrad while its thread is inside os.fork()'s preparation
# (bngrad's before-fork hook waits there for another thread's call, or for the pool's threads
# to sleep): the handler's call waited for the fork, which waited for the handler (a hang), or,
# where the fork held Numba's compiler lock, was refused as nested in a compile. (Signals now
# wait until the fork is done, and the handler calls after it.)
_CALL_IN_FORK_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np
import bngrad

rng = np.random.default_rng(0)
x = rng.standard_normal((4096, 256)).astype(np.float32)
small = rng.standard_normal((4, 8, 50)).astype(np.float32)
expected = bngrad.batch_norm_backward(small, small)
bngrad.batch_norm_backward(x, x)
calls, errors = [], []

def handler(signum, frame):
    try:
        calls.append(bngrad.batch_norm_backward(small, small))
    except Exception as e:
        errors.append(repr(e))

signal.signal(signal.SIGALRM, handler)
delay = [0.001]
os.register_at_fork(before=lambda: signal.setitimer(signal.ITIMER_REAL, delay[0]))
stop = threading.Event()
busy = threading.Thread(target=lambda: [bngrad.batch_norm_backward(x, x)
                                        for _ in iter(stop.is_set, True)])
for with_busy_thread in (False, True):
    if with_busy_thread:
        busy.start()
    for i in range(8):
        delay[0] = (0.0002, 0.001, 0.003, 0.01)[i % 4]
        pid = os.fork()
        if pid == 0:
            got = bngrad.batch_norm_backward(small, small)
            os._exit(0 if all(np.array_equal(g, e) for g, e in zip(got, expected)) else 1)
        deadline = time.monotonic() + 10
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                sys.exit("child hung")
            time.sleep(0.002)
        signal.setitimer(signal.ITIMER_REAL, 0)
stop.set()
busy.join()
assert not errors, errors
assert calls and all(all(np.array_equal(g, e) for g, e in zip(c, expected)) for c in calls)
print("ok", len(calls))
"""


@needs_fork_and_alarms
def test_call_in_a_signal_handler_while_its_thread_forks():
    code, output = _run_script(_CALL_IN_FORK_SCRIPT, {"NUMBA_NUM_THREADS": "2"})
    assert code == 0 and "ok" in output and "Exception ignored" not in output, output[-2000:]


_NESTED_WORKQUEUE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from bngrad import _threads
from test_concurrency import _nested_in_signal_handler

assert not _threads._LAUNCH_IS_THREAD_SAFE, "workqueue launches must be serialised"
fired, wrong = _nested_in_signal_handler((4096, 256), (64, 8), np.float32, 1)
assert fired and not wrong, (fired, wrong)
print("ok", fired)
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_call_nested_in_a_signal_handler_with_the_workqueue_fallback():
    """The workqueue fallback's launch lock is held through a call: a nested call on the same
    thread must take it again, not wait for itself."""
    script = _NESTED_WORKQUEUE_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)))
    code, output = _run_script(script, {"NUMBA_THREADING_LAYER": "workqueue"})
    assert code == 0 and "ok" in output, output[-2000:]


# Another thread is compiling (here: holds Numba's compiler lock, as a compile does) when the
# main thread forks: the fork waits for it to end, so that the child, whose first call must
# compile or load a kernel, does not wait forever for a lock that no thread of its holds.
_FORK_DURING_A_COMPILE_SCRIPT = """
import os, threading, time
import numpy as np
from numba.core.compiler_lock import global_compiler_lock
import bngrad
held = threading.Event()
def compiling():
    with global_compiler_lock:
        held.set()
        time.sleep(1.0)
threading.Thread(target=compiling).start()
held.wait()
pid = os.fork()
if pid == 0:
    x = np.random.default_rng(0).standard_normal((4, 3, 5)).astype(np.float32)
    bngrad.batch_norm_forward(x, num_threads=1)  # loads or compiles: takes the lock
    os._exit(0)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("ok" if os.waitstatus_to_exitcode(status) == 0 else "child failed")
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    print("the child hung")
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_fork_while_another_thread_compiles():
    code, output = _run_script(_FORK_DURING_A_COMPILE_SCRIPT, {})
    assert code == 0 and output.strip().endswith("ok"), output[-2000:]


def test_call_nested_in_a_compile_is_refused_clearly():
    """A call made on a thread whose interrupted call is compiling or loading a kernel (a
    signal handler's): NestedCallError, before it reaches Numba, whose compiler cannot be
    entered twice on one thread; once the compile is over, calls work."""
    from numba.core.compiler_lock import global_compiler_lock

    x = np.random.default_rng(0).standard_normal((4, 3, 5))
    with global_compiler_lock:
        for call in (lambda: bngrad.batch_norm_forward(x),
                     lambda: bngrad.batch_norm_backward(x, x),
                     lambda: bngrad.batch_norm_moments(x)):
            with pytest.raises(bngrad.NestedCallError, match="compiling or loading a kernel"):
                call()
    bngrad.batch_norm_forward(x)


def test_call_nested_in_a_load_is_refused_before_any_compiled_function(monkeypatch):
    """(Found by hostile testing.) The check came after the argument checks, whose scan of
    running_var is a compiled function: a signal handler's call during the first call's
    loading loaded it on the interrupted thread (an ImportError of a partially initialised
    Numba module, an LLVM assertion, a double free, a hang). Now NestedCallError before it;
    and also while Numba starts its threading layer on this thread (a re-entrant lock, under
    which a nested call started the layer a second time)."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.np.ufunc import parallel as numba_parallel
    from bngrad import _validate

    def not_now(values):
        raise AssertionError("a compiled function was called")
    monkeypatch.setattr(_validate, "first_negative", not_now)
    x = np.random.default_rng(0).standard_normal((4, 3, 5)).astype(np.float32)
    stats = np.zeros(3, np.float32), np.ones(3, np.float32)
    for lock in (global_compiler_lock, numba_parallel._backend_init_thread_lock):
        with lock:
            for train in (True, False):
                with pytest.raises(bngrad.NestedCallError, match="compiling or loading a kernel"):
                    bngrad.batch_norm_forward(x, None, None, *stats, train=train)
                with pytest.raises(bngrad.NestedCallError, match="compiling or loading a kernel"):
                    bngrad.batch_norm_backward(x, x, None, *stats, train=False)


_SIGNALS_DURING_THE_FIRST_CALL_SCRIPT = r"""
import signal, numpy as np, bngrad
x = np.random.default_rng(0).standard_normal((16, 32, 30, 30)).astype(np.float32)
w, b = np.ones(32, np.float32), np.zeros(32, np.float32)
outcomes = set()
def handler(sig, frame):
    try:
        bngrad.batch_norm_forward(x[:2, :, :4, :4], w, b, np.zeros(32, np.float32),
                                  np.ones(32, np.float32))
        outcomes.add("ran")
    except bngrad.NestedCallError:
        outcomes.add("refused")
signal.signal(signal.SIGALRM, handler)
signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0007)
first = bngrad.batch_norm_forward(x, w, b, np.zeros(32, np.float32), np.ones(32, np.float32))
signal.setitimer(signal.ITIMER_REAL, 0)
again = bngrad.batch_norm_forward(x, w, b, np.zeros(32, np.float32), np.ones(32, np.float32))
assert np.array_equal(first[0], again[0])
print(sorted(outcomes), "ok")
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_signal_handlers_calling_during_a_process_first_call():
    """(Found by hostile testing.) A handler calling bngrad every 0.7 ms during a fresh
    process's first call (kernels loading, Numba starting its threads): each nested call runs
    or is refused with NestedCallError; the first call completes with the right result (before
    the fix: double frees, hangs, partially initialised modules, in 4 runs of 4)."""
    code, output = _run_script(_SIGNALS_DURING_THE_FIRST_CALL_SCRIPT, {})
    assert code == 0 and output.strip().endswith("ok"), output[-2000:]


def test_deferred_signals_survive_a_handler_that_compiles_while_they_are_swapped(monkeypatch):
    """(Found by the test above, in one fresh-clone CI run: a KeyError in on_end.) A handler
    that runs while bngrad._threads' deferral swaps the handlers in and calls bngrad (a nested
    compile: a nested start and end of the compiler lock) must leave every handler as it was
    afterwards, and the signals recorded meanwhile must reach their handlers. Before the fix
    the nested end restored and emptied the replaced handlers midway: one handler stayed
    replaced for good and its recorded signal had none."""
    from bngrad import _threads
    defer, seen = _threads._DeferSignals(), []

    def handler(signum, frame):
        seen.append(signum)
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGALRM)}
    swap, nested = signal.signal, []

    def swap_after_a_nested_compile(signum, new):  # the first swap: a handler runs, compiling
        if not nested:
            nested.append(signum)
            defer.on_start(None)
            defer.on_end(None)
        return swap(signum, new)
    try:
        monkeypatch.setattr(_threads.signal, "signal", swap_after_a_nested_compile)
        defer.on_start(None)
        monkeypatch.setattr(_threads.signal, "signal", swap)
        assert nested and all(signal.getsignal(s) == defer._record for s in previous)
        for s in previous:  # signals arriving during the compile
            defer._record(s, None)
        defer.on_end(None)
        assert all(signal.getsignal(s) is handler for s in previous)
        assert sorted(seen) == sorted(previous)
    finally:
        for s, h in previous.items():
            swap(s, h)


_INTERRUPTS_DURING_FIRST_CALLS_SCRIPT = r"""
import os, signal, threading, time
import numpy as np, bngrad
rng = np.random.default_rng(0)
x, g = (rng.standard_normal((16, 64, 40, 40)).astype(np.float32) for _ in range(2))
w, b = np.ones(64, np.float32), np.zeros(64, np.float32)

def run(threads, fused):
    if fused:
        y, mean, invstd, mask = bngrad.batch_norm_relu_forward(x, w, b, num_threads=threads)
        return bngrad.batch_norm_relu_backward(g, x, w, None, None, mean, invstd,
                                               relu_mask=mask, num_threads=threads)[0]
    y, mean, invstd = bngrad.batch_norm_forward(x, w, b, num_threads=threads)
    return bngrad.batch_norm_backward(g, x, w, None, None, mean, invstd,
                                      num_threads=threads)[0]

# The handlers raise only while `armed`, i.e. inside the loop's try (a signal between two
# tries would end the script, not test bngrad)
armed = done = False
def interrupt(signum, frame):
    if armed:
        signal.default_int_handler(signum, frame)  # Ctrl-C: KeyboardInterrupt
def alarm(signum, frame):
    if armed:
        raise TimeoutError  # as a timeout decorator's handler does
def interrupter():
    while not done:
        time.sleep(0.003)
        os.kill(os.getpid(), signal.SIGINT)
if os.environ["SIGNAL"] == "SIGINT":
    signal.signal(signal.SIGINT, interrupt)
    threading.Thread(target=interrupter, daemon=True).start()
else:
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
interrupts, start = 0, time.time()
while time.time() - start < 8:
    try:
        armed = True
        run(interrupts % 3 + 1, bool(interrupts % 2))
        armed = False
    except (KeyboardInterrupt, TimeoutError):
        armed = False
        interrupts += 1
done = True
signal.setitimer(signal.ITIMER_REAL, 0)
for fused in (False, True):
    results = [run(threads, fused) for threads in (1, 2, 3)]
    assert all(np.array_equal(r, results[0]) for r in results), fused
print(interrupts, "interrupts ok")
"""


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("signame", ["SIGINT", "SIGALRM"])
def test_interrupts_during_first_calls_leave_bngrad_working(signame):
    """(Found by hostile testing.) SIGINT every 3 ms (Ctrl-C), or an alarm whose handler
    raises, while a fresh process makes its first calls (kernels compiling or loading) aborted
    it ("double free detected": llvmlite objects freed twice after an exception raised in
    Numba's bookkeeping), or left Numba's registries half loaded (every later call failing):
    signals now wait while Numba holds its compiler lock on the main thread; afterwards every
    call works, bitwise the same on 1-3 threads."""
    code, output = _run_script(_INTERRUPTS_DURING_FIRST_CALLS_SCRIPT,
                               {"NUMBA_NUM_THREADS": "3", "SIGNAL": signame})
    assert code == 0 and output.strip().endswith("interrupts ok"), output[-2000:]


def test_importing_bngrad_imports_what_a_call_would_import_lazily():
    """numpy.ma (NumPy imports it lazily, on first use of np.ma) is imported with bngrad: its
    first import inside a call nested in a signal handler re-entered the import system of the
    interrupted call (RecursionError)."""
    code = "import sys, bngrad; print('numpy.ma' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True"]
    plain = "import sys, numpy; print('numpy.ma' in sys.modules)"  # the test can fail
    out = subprocess.run([sys.executable, "-c", plain], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


# Alarms at random points of calls whose handler raises (as a KeyboardInterrupt or a timeout
# decorator does), then a call and a fork from another thread. The fork gate's Python-kept
# state (a Condition's lock, a count of regions in flight) was left held or counting a region
# that had ended when an exception landed between its steps: every later call from another
# thread, or every fork, then waited forever (3 runs of 3, after 90-260 interrupted calls).
# (the scripts' start: an alarm whose handler raises while armed)
_ARMED_ALARM = """
import os, random, signal, sys, threading, time
import numpy as np
import bngrad

armed = [False]

def handler(signum, frame):
    if armed[0]:
        raise KeyboardInterrupt

signal.signal(signal.SIGALRM, handler)
"""
_INTERRUPTED_REGIONS_SCRIPT = _ARMED_ALARM + """
rng = np.random.default_rng(0)
x = rng.standard_normal((16, 32, 40, 40)).astype(np.float32)
dy = rng.standard_normal(x.shape).astype(np.float32)
expected = bngrad.batch_norm_backward(dy, x)
random.seed(0)
interrupted = 0
for i in range(1000):
    try:  # (armed inside: an alarm before the try would end the script)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.00005, 0.003))
        bngrad.batch_norm_backward(dy, x)
        bngrad.batch_norm_forward(x)
    except KeyboardInterrupt:
        interrupted += 1
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
assert interrupted >= 50, interrupted  # (else the test would prove nothing)
got = []
caller = threading.Thread(target=lambda: got.append(bngrad.batch_norm_backward(dy, x)),
                          daemon=True)
caller.start()
caller.join(30)
assert not caller.is_alive(), "a call from another thread hung"
assert all(np.array_equal(g, e) for g, e in zip(got[0], expected))
codes = []

def fork_and_wait():
    pid = os.fork()
    if pid == 0:
        os._exit(0 if all(np.array_equal(g, e) for g, e in
                          zip(bngrad.batch_norm_backward(dy, x), expected)) else 1)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

forker = threading.Thread(target=fork_and_wait, daemon=True)
forker.start()
forker.join(30)
assert not forker.is_alive(), "a fork from another thread hung"
assert codes == [0], codes
print(interrupted, "interrupted calls ok")
"""


@needs_fork_and_alarms
def test_exceptions_from_a_signal_handler_leave_calls_and_forks_working():
    """(Found by hostile testing.) After hundreds of calls interrupted at random points by an
    exception from a signal handler, a call from another thread and a fork from another
    thread still work (the fork gate is a C lock held by ``with``: bngrad._threads)."""
    code, output = _run_script(_INTERRUPTED_REGIONS_SCRIPT, {})
    assert code == 0 and output.strip().endswith("interrupted calls ok"), output[-2000:]


# The main thread forks while alarms whose handler raises fire and another thread calls: an
# exception landing in the fork hooks' bookkeeping left the fork ungated (a child hung, or the
# next fork) or released locks it had not taken. Signals now wait until the fork is done.
_FORKS_UNDER_INTERRUPTS_SCRIPT = _ARMED_ALARM + """
x = np.random.default_rng(0).standard_normal((16, 32, 40, 40)).astype(np.float32)
expected = bngrad.batch_norm_backward(x, x)
stop = threading.Event()

def busy():
    while not stop.is_set():
        bngrad.batch_norm_backward(x, x)

thread = threading.Thread(target=busy, daemon=True)
thread.start()
random.seed(0)
for i in range(200):
    try:  # (armed inside: an alarm before the try would end the script)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.00001, 0.002))
        pid = os.fork()
        if pid == 0:
            got = bngrad.batch_norm_backward(x, x)
            os._exit(0 if all(np.array_equal(g, e) for g, e in zip(got, expected)) else 1)
        armed[0] = False
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                sys.exit(f"fork {i}: the child hung")
            time.sleep(0.001)
        assert os.waitstatus_to_exitcode(status) == 0, f"fork {i}: the child's result differs"
    except KeyboardInterrupt:
        pass
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
stop.set()
thread.join(30)
assert not thread.is_alive(), "the calling thread hung"
print("forks under interrupts ok")
"""


@needs_fork_and_alarms
def test_forks_interrupted_by_a_signal_handlers_exception_stay_gated():
    """(Found while fixing the above.) 200 forks from the main thread, each with an alarm
    at a random point whose handler raises, while another thread calls: every child works,
    and so does the calling thread (the old gate: a child hung within a few dozen forks)."""
    code, output = _run_script(_FORKS_UNDER_INTERRUPTS_SCRIPT, {})
    assert code == 0 and "forks under interrupts ok" in output, output[-2000:]


# Two forks at once: the main thread's from a signal handler in the middle of a call (inside a
# parallel region, holding its gate lock), another thread's in a loop. The other fork held
# the one-fork-at-a-time lock and waited for the main thread's gate lock, the main thread's
# fork waited for that lock: both for ever, at the first such pair (found by a review helper).
_TWO_FORKS_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np
import bngrad

x = np.random.default_rng(0).standard_normal((32, 64, 64, 64)).astype(np.float32)
bngrad.batch_norm_backward(x, x)
counts = {"handler": 0, "thread": 0}

def fork_and_reap(key):
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    counts[key] += 1

def handler(signum, frame):
    fork_and_reap("handler")
    signal.setitimer(signal.ITIMER_REAL, 0.005)  # (re-armed here: never nested)

stop = threading.Event()

def forker():
    while not stop.is_set():
        fork_and_reap("thread")

signal.signal(signal.SIGALRM, handler)
thread = threading.Thread(target=forker, daemon=True)
thread.start()
signal.setitimer(signal.ITIMER_REAL, 0.005)
end = time.monotonic() + 3
while time.monotonic() < end:
    bngrad.batch_norm_backward(x, x)
signal.setitimer(signal.ITIMER_REAL, 0)
stop.set()
thread.join(30)
assert not thread.is_alive() and counts["handler"] >= 10 and counts["thread"] >= 10, counts
print("two forks ok", counts)
"""


@needs_fork_and_alarms
def test_a_fork_from_inside_a_call_and_another_threads_fork_at_once():
    code, output = _run_script(_TWO_FORKS_SCRIPT, {})
    assert code == 0 and "two forks ok" in output, output[-2000:]


# Calls that set Numba's thread count (num_threads other than the count in force) under raising
# alarms, then a fork from another thread; and a thread started outside the threading module
# (not in threading.enumerate()) inside a region when another thread forks: the fork must wait
# for it (found by a review helper: the gate's lock was left held by the former, the latter's
# forgotten).
_COUNTS_AND_FOREIGN_THREADS_SCRIPT = _ARMED_ALARM + """
import _thread
import numba
from bngrad import _threads

numba.set_num_threads(1)
x = np.random.default_rng(0).standard_normal((8, 32, 32, 32)).astype(np.float32)
expected = bngrad.batch_norm_backward(x, x, num_threads=2)
random.seed(0)
for i in range(400):
    try:  # (armed inside: an alarm before the try would end the script)
        armed[0] = True
        signal.setitimer(signal.ITIMER_REAL, random.uniform(0.00002, 0.0005))
        bngrad.batch_norm_backward(x, x, num_threads=2)
    except KeyboardInterrupt:
        pass
    finally:
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
lock = _threads._fork_gate.lock()
assert lock.acquire(blocking=False), "this thread's gate lock was left held"
lock.release()
entered, release = threading.Event(), threading.Event()

def foreign():
    with _threads.gate():
        entered.set()
        release.wait(10)

_thread.start_new_thread(foreign, ())
entered.wait(10)
threading.Timer(0.5, release.set).start()
codes = []

def fork_and_wait():
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os._exit(0 if all(np.array_equal(g, e) for g, e in zip(
            bngrad.batch_norm_backward(x, x, num_threads=2), expected)) else 1)
    codes.append((os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), time.monotonic() - start))

forker = threading.Thread(target=fork_and_wait, daemon=True)
forker.start()
forker.join(30)
assert not forker.is_alive(), "the fork hung"
assert codes[0][0] == 0 and codes[0][1] >= 0.4, codes  # (it waited for the foreign region)
print("counts and foreign threads ok")
"""


@needs_fork_and_alarms
def test_thread_count_calls_under_alarms_and_foreign_threads_keep_the_gate():
    code, output = _run_script(_COUNTS_AND_FOREIGN_THREADS_SCRIPT, {})
    assert code == 0 and "counts and foreign threads ok" in output, output[-2000:]


def test_thread_count_set_back_when_an_exception_interrupts_setting_it(monkeypatch):
    """An exception a signal handler raises just after Numba's thread count was changed, before
    the call's ``with`` block was entered, left the count changed for this thread's later calls
    (``with`` runs no ``__exit__`` when ``__enter__`` raises)."""
    import numba

    from bngrad import _threads
    before = _threads.current_num_threads()
    wanted = 1 if before != 1 else 2
    if wanted > numba.config.NUMBA_NUM_THREADS:
        pytest.skip("needs a pool of two threads")
    set_num_threads = numba.set_num_threads
    calls = []

    def interrupted(n):
        set_num_threads(n)
        calls.append(n)
        if len(calls) == 1:
            raise KeyboardInterrupt  # as a handler would, once the count is changed

    monkeypatch.setattr(_threads.numba, "set_num_threads", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with _threads.thread_count(wanted):
            pass
    assert calls == [wanted, before]
    assert _threads.current_num_threads() == before
