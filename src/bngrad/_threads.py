"""Numba threading: pick a layer that is safe from several Python threads and after fork().

Numba's layers differ: workqueue is not thread-safe, GNU OpenMP is not fork-safe, TBB is both.
The ``tbb`` wheel puts ``libtbb.so.12`` in ``<prefix>/lib``, which the dynamic loader does not
search, so we load it by path before Numba looks for it. Where TBB cannot be loaded we fall back
to workqueue and serialise kernel launches with a lock, which is safe but runs one call at a time.
This module must be imported before the first parallel kernel runs (bngrad/__init__ does that).

TBB is fork-safe only while no launch is in flight: a fork() while another thread is inside a
kernel leaves the child unable to start its threads (it hangs) and, now and then, the parent
too. bngrad therefore closes a gate around fork(): parallel regions are readers, fork() the
writer (see _ForkGate). TBB may still print "Unable to join threads to shut down before
fork()" when its worker threads have not gone to sleep by then; with the gate closed, the
children it warns about run normally (60 forks under 4 calling threads, 2026-12-03).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import site
import signal
import sys
import threading
import time
from typing import Any, Optional

import numba
from numba.core import event as _numba_event
from numba.core import compiler_lock as _compiler_lock
from numba.np.ufunc import parallel as _numba_parallel

from .errors import NestedCallError

# Numba's global compiler lock (a re-entrant lock; None in a Numba without the attribute, where
# the fork and the nested-call check below go as they would without it)
_COMPILER_LOCK: Optional[Any] = getattr(_compiler_lock.global_compiler_lock, "_lock", None)
# The lock Numba holds while it starts its threading layer (a re-entrant lock: a call nested
# on the thread that holds it would start the layer a second time; None if absent)
_POOL_START_LOCK: Optional[Any] = getattr(_numba_parallel, "_backend_init_thread_lock", None)

_TBB_NAMES = ("libtbb.so.12", "libtbb.12.dylib", "tbb12.dll")


def _tbb_search_dirs() -> list[str]:
    prefixes = [sys.prefix, sys.base_prefix, getattr(site, "USER_BASE", None) or ""]
    dirs = []
    for prefix in prefixes:
        if prefix:
            dirs += [os.path.join(prefix, "lib"), os.path.join(prefix, "Library", "bin")]
    return dirs


def _load_tbb() -> bool:
    try:  # already loadable the ordinary way (conda, system package, LD_LIBRARY_PATH)
        from numba.np.ufunc import tbbpool  # type: ignore[attr-defined]  # noqa: F401
        return True
    except ImportError:
        pass
    for directory in _tbb_search_dirs():
        for name in _TBB_NAMES:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    from numba.np.ufunc import tbbpool  # type: ignore[attr-defined]  # noqa: F401
                    return True
                except (OSError, ImportError):
                    continue
    return False


def _configure() -> bool:
    """Select the threading layer; returns True where launches need no lock."""
    requested = os.environ.get("NUMBA_THREADING_LAYER", "").lower()
    if requested and requested not in ("default", "safe", "tbb"):
        # The user chose a layer explicitly: respect it, and serialise to stay thread-safe.
        return False
    if _load_tbb():
        numba.config.THREADING_LAYER = "tbb"
        return True
    numba.config.THREADING_LAYER = "workqueue"
    return False


_LAUNCH_IS_THREAD_SAFE = _configure()
# Reentrant: a signal handler or finaliser may call bngrad on a thread that is inside a call
# (between two of its kernels, never during one).
_launch_lock = threading.RLock()


def _native_thread_states() -> list[str]:
    """Scheduler states (R, S, D, ...) of this process's threads that Python did not start
    (TBB's workers among them); empty where /proc is missing."""
    python_threads = {t.native_id for t in threading.enumerate()}
    states: list[str] = []
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return states
    for tid in tids:
        if int(tid) in python_threads:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (OSError, IndexError):
            continue  # the thread has just ended
    return states


def _wait_for_native_threads_to_sleep(timeout: float = 0.2) -> None:
    """Wait (at most ``timeout`` s) until every native thread sleeps in two polls in a row.

    After the last launch TBB's workers spin a little, then go to sleep, briefly holding an
    internal lock on the way (a worker preempted there holds it longer); a fork() at that
    moment copies the lock held, and the child hangs at its first launch. Measured on a loaded
    2-core machine: with the gate alone about 1 fork in 100 racing a busy thread hung (the
    fork test in tests/test_concurrency.py failed 4 runs of 4), with this wait none in about
    2,000. A sleeping thread holds no such lock. Other native threads (another library's pool)
    are waited for too: at worst ``timeout`` per fork.
    """
    deadline = time.monotonic() + timeout
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        quiet = quiet + 1 if all(state == "S" for state in _native_thread_states()) else 0
        time.sleep(0.0005)


class _ForkGate:
    """Parallel regions are readers, fork() is the writer: os.fork() waits until the regions
    in flight have ended and holds new ones until it is done, so that no kernel launch is in
    flight when the process forks.

    Each thread that runs parallel regions has its own re-entrant lock, its gate lock, which
    it holds for each region (nested ones re-enter it), and fork() takes every thread's gate
    lock (its own too), waiting for each region in flight to end; a thread that enters a
    region meanwhile waits for the fork. A lock held by the forking thread itself is re-entered
    there: a fork from inside a region goes on without waiting for itself.
    With Numba's workqueue layer, which is not thread-safe, every thread's gate lock is the one
    launch lock, which serialises the launches too.

    The lock is a C lock held by a ``with`` statement (:func:`gate`), not state kept by Python
    code: an exception raised by a signal handler (KeyboardInterrupt, a timeout) can interrupt
    Python code between any two calls, and a count or flag updated by Python code could be
    left counting a region that had ended, so that every later fork, or every later call from
    another thread, waited forever. A ``with`` statement releases a C lock whatever
    interrupts its body, and nothing can interrupt between the acquisition and the body
    (Python checks for signals after calls and on loops only). The fork's own steps, in
    Python, run with the main thread's signals held back (_DeferSignals; see before_fork).
    Every wait is a lock's acquire, which releases the GIL. The child, where only the forking
    thread survives, starts with a fresh gate.
    """

    def __init__(self) -> None:
        self._local = threading.local()  # this thread's gate lock, and whether it is forking
        self._used = False               # whether any thread ever made a gate lock
        self._reset()

    def _reset(self) -> None:
        self._locks: dict[int, Any] = {}  # each thread's gate lock, by thread ident
        # re-entrant, both: a signal handler may fork, or make its thread's first gate lock
        # while the fork waits, on a thread that holds them
        self._registry = threading.RLock()
        self._forking = threading.RLock()  # one fork at a time
        self._forkers: set[int] = set()  # threads in before_fork (waiting, or forking)
        self._held: list[Any] = []  # what a fork in progress holds: _forking, the gate locks

    def lock(self) -> Any:
        """This thread's gate lock, to hold (``with``) around a parallel region."""
        lock = getattr(self._local, "lock", None)
        return lock if lock is not None else self._new_lock()

    def _new_lock(self) -> Any:
        lock = threading.RLock() if _LAUNCH_IS_THREAD_SAFE else _launch_lock
        with self._forking, self._registry:  # (not while a fork gathers the locks)
            if len(self._locks) >= 64:  # (threads come and go: the ended ones' locks go too)
                self._forget_ended_threads()
            self._locks[threading.get_ident()] = lock
            self._used = True
        self._local.lock = lock
        return lock

    def _forget_ended_threads(self) -> None:
        # (threads with a Python frame: every thread inside a region has one, those started
        # outside the threading module too, which threading.enumerate() leaves out)
        alive = set(sys._current_frames())
        for ident in [i for i in list(self._locks) if i not in alive]:
            self._locks.pop(ident, None)

    def forking_here(self) -> bool:
        """Whether this thread is in os.fork()'s preparation (before_fork)."""
        return getattr(self._local, "forking", False)

    def before_fork(self) -> None:
        # Nor may another thread be compiling or loading a kernel: its locks (Numba's compiler
        # lock, llvmlite's, LLVM's own) would stay held in the child, whose first call would
        # wait forever. So the fork also holds Numba's compiler lock, taken without waiting
        # while holding the gate locks (a thread that holds it may need a region to finish).
        # The main thread's signals (whose handlers run there) are held back for the fork's
        # steps and delivered after them, in the after-fork hook, where Python drops a
        # handler's exception with a message, as any fork hook's: an exception a handler
        # raised in the middle of these steps would leave gate locks held. One raised before
        # the handlers are held back (while they are swapped) is dropped, and they are held
        # back again (a few times: then the fork goes on without); one raised as this hook
        # starts, or at that retry's loop, ends the hook before it takes anything: that fork
        # is not gated, and after_fork_* do nothing.
        for _ in range(3):
            try:
                _deferred_signals.on_start(None)
                break
            except BaseException:  # noqa: BLE001 - see above (a fork hook's: dropped anyway)
                continue
        compiler = _COMPILER_LOCK
        me = threading.get_ident()
        self._local.forking = True
        with self._registry:
            self._forkers.add(me)
        while True:
            locks = self._take_gate_locks(me)
            if locks is None:  # (it gave way to another fork: see there)
                time.sleep(0.001)
                continue
            if compiler is None or compiler.acquire(blocking=False):
                break
            for lock in reversed(locks):
                lock.release()
            compiler.acquire()  # (the compile in flight ends; then try again)
            compiler.release()
        self._held = locks
        self._local.gated = True
        if self._used:
            _wait_for_native_threads_to_sleep()

    def _take_gate_locks(self, me: int) -> Optional[list[Any]]:
        """One fork at a time (``_forking``), every thread's gate lock (waiting for the regions
        in flight); returns them, ``_forking`` first. Or None, having given back what it took,
        where it waits for a lock while another thread is forking too: one forking from inside
        a region (a signal handler's fork, on the main thread) holds its own lock and waits
        for ``_forking``, and both would wait for ever (the other then tries again)."""
        while not self._forking.acquire(timeout=0.002):
            pass  # (a thread forking from inside a region waits here, holding its own lock)
        taken = [self._forking]
        with self._registry:  # (threads that have ended hold no region)
            self._forget_ended_threads()
            locks = list({id(lock): lock for lock in list(self._locks.values())}.values())
        for lock in locks:
            while not lock.acquire(timeout=0.002):
                if len(self._forkers) > 1:
                    for held in reversed(taken):
                        held.release()
                    return None
            taken.append(lock)
        return taken

    def before_fork_unless_done(self) -> None:
        """before_fork again, where it did not run (see the hooks' registration)."""
        if not getattr(self._local, "gated", False):
            self.before_fork()

    def after_fork_in_parent(self) -> None:
        if not getattr(self._local, "gated", False):  # (before_fork did not run: see there)
            return
        self._local.gated = self._local.forking = False
        if _COMPILER_LOCK is not None:
            _COMPILER_LOCK.release()
        held, self._held = self._held, []
        for lock in reversed(held):  # (the gate locks, then _forking)
            lock.release()
        with self._registry:
            self._forkers.discard(threading.get_ident())
        _deferred_signals.on_end(None)  # (and the signals recorded meanwhile are delivered)

    def after_fork_in_child(self) -> None:
        global _launch_lock
        if not getattr(self._local, "gated", False):  # (before_fork did not run: see there)
            return
        self._local.gated = self._local.forking = False
        if _COMPILER_LOCK is not None:
            _COMPILER_LOCK.release()  # (this thread's, from the fork)
        _deferred_signals.forget_pending()  # (the parent's signals, delivered there)
        # Only this thread is left. The fork holds every gate lock there was (the other
        # threads' go with them); this thread's own it releases, which a region it is in
        # still holds
        own: Any = getattr(self._local, "lock", None)
        for lock in self._held:
            if lock is own:
                lock.release()
        self._reset()
        if own is not None:
            self._locks[threading.get_ident()] = own
        elif not _LAUNCH_IS_THREAD_SAFE:  # (the fork's, held for the other threads)
            _launch_lock = threading.RLock()
        _deferred_signals.on_end(None)


_fork_gate = _ForkGate()
if hasattr(os, "register_at_fork"):
    # Before-fork hooks run last registered first: this one runs after before_fork, and takes
    # the gate where an exception a signal handler raised as before_fork started (Python checks
    # for signals as a function starts) ended it before it took anything.
    os.register_at_fork(before=_fork_gate.before_fork_unless_done)
    os.register_at_fork(before=_fork_gate.before_fork,
                        after_in_parent=_fork_gate.after_fork_in_parent,
                        after_in_child=_fork_gate.after_fork_in_child)


class _DeferSignals(_numba_event.Listener):
    """Signals with a Python handler (Ctrl-C's KeyboardInterrupt, an alarm, ...) wait while
    Numba holds its compiler lock on the main thread (compiling or loading a kernel, a
    process's first calls), then go to their handlers, in order. An exception raised by a
    handler in the middle of Numba's and llvmlite's bookkeeping left objects freed twice (the
    process aborted: "double free detected") or Numba's modules half registered (every later
    call failed: "duplicate registration"); kernels running already hold signals until they
    return, so this only delays them by the rest of the compile. Python runs handlers on the
    main thread only; ignored and default dispositions are left alone."""

    def __init__(self) -> None:
        self._depth = 0  # compiler-lock acquisitions on the main thread (it is re-entrant)
        self._handlers: dict[int, Any] = {}  # the handlers replaced, by signal
        self._pending: list[int] = []

    def on_start(self, event: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        # Counted first: a signal arriving while the handlers are swapped goes to its own
        # handler, which may call bngrad, which compiles: that nested start and its end must
        # see a deferral in progress, not begin and end one of their own (which emptied the
        # replaced handlers midway, left the recorder installed for good and lost the signals
        # it recorded: a KeyError in on_end, found by tests/test_concurrency.py's signals).
        self._depth += 1
        if self._depth == 1:
            try:
                for signum in _HANDLED_SIGNALS:
                    handler = signal.getsignal(signum)
                    if callable(handler) and handler != self._record:
                        self._handlers[signum] = handler
                        signal.signal(signum, self._record)
            except BaseException:
                self._depth -= 1
                self._restore()
                raise

    def on_end(self, event: Any) -> None:
        if threading.current_thread() is not threading.main_thread() or self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0:
            handlers = self._restore()
            # (taken after the restore: signals recorded until then are delivered here; a
            # nested deferral started by a handler meanwhile delivers what it finds itself)
            pending, self._pending = self._pending, []
            for signum in pending:  # (Python's default SIGINT handler raises KeyboardInterrupt)
                handler = handlers.get(signum, signal.getsignal(signum))
                if callable(handler) and handler != self._record:
                    handler(signum, None)

    def _restore(self) -> dict[int, Any]:
        """Put the replaced handlers back (all of them, even if one that is back already
        raises meanwhile); returns them."""
        handlers, self._handlers = self._handlers, {}
        remaining = list(handlers.items())
        try:
            while remaining:
                signal.signal(*remaining[-1])
                remaining.pop()
        finally:
            for signum, handler in remaining:
                signal.signal(signum, handler)
        return handlers

    def _record(self, signum: int, frame: Any) -> None:
        self._pending.append(signum)

    def forget_pending(self) -> None:
        """Drop the signals recorded so far (a forked child's copy of its parent's)."""
        self._pending = []

    # Also a context manager, for the start of Numba's threading layer (its own lock, and a
    # handler's exception there is taken for an OS error: a warning and no process lock)
    def __enter__(self) -> None:
        self.on_start(None)

    def __exit__(self, *exc: object) -> None:
        self.on_end(None)


_HANDLED_SIGNALS = tuple(s for s in signal.valid_signals()
                         if s not in (signal.SIGKILL, signal.SIGSTOP))
_deferred_signals = _DeferSignals()
_numba_event.register("numba:compiler_lock", _deferred_signals)


def gate() -> Any:
    """The fork gate's lock for a parallel call of this thread, to hold by a ``with`` statement
    of the lock itself around its kernels (see _ForkGate: nothing can leave it held)."""
    return _fork_gate.lock()


class _ThreadCount:
    """Numba's thread count set to ``wanted`` for the enclosed launches, and set back. A class
    rather than a generator-based context manager: it costs less. Python code: an exception
    from a signal handler raised once the count is set, before ``__enter__`` returns, sets it
    back (``with`` runs no ``__exit__`` then); one raised inside the set-back itself can still
    leave the count changed on this thread (the gate's lock, held apart by :func:`gate`,
    cannot be left held)."""

    __slots__ = ("_wanted", "_previous")

    def __init__(self, wanted: int) -> None:
        self._wanted = wanted
        self._previous: Optional[int] = None

    def __enter__(self) -> None:
        previous = current_num_threads()
        if self._wanted != previous:
            self._previous = previous
            try:
                numba.set_num_threads(self._wanted)
            except BaseException:
                self.__exit__()
                raise

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            numba.set_num_threads(self._previous)
            self._previous = None


_SAME_COUNT = contextlib.nullcontext()


def thread_count(num_threads: Optional[int]) -> Any:
    """What a parallel call on ``num_threads`` threads (None: the count in force) runs its
    kernels in, inside its :func:`gate`: Numba's thread count set where it differs (capped
    at the size of Numba's pool, NUMBA_NUM_THREADS); thread-local, so concurrent callers do
    not disturb each other."""
    if num_threads is None:
        return _SAME_COUNT
    wanted = min(num_threads, numba.config.NUMBA_NUM_THREADS)
    return _SAME_COUNT if wanted == current_num_threads() else _ThreadCount(wanted)


def resolve_num_threads(num_threads: Optional[int]) -> int:
    """The threads a call asked to run on ``num_threads`` (None: the count in force) gets:
    what the plan and the choice of a serial call read. Reads Numba's count only for None, so
    that a call given its count never touches Numba's thread pool.

    Every call that runs kernels asks this first, so this is also where a call nested in the
    middle of a kernel's compiling or loading on its own thread (a signal handler's) is refused
    with NestedCallError: Numba's compiler lock is re-entrant, and a second compile on the
    same thread corrupts its state (aborts, broken imports, every later call failing)."""
    refuse_nested_call()
    if num_threads is None:
        return current_num_threads()
    return min(num_threads, numba.config.NUMBA_NUM_THREADS)


def refuse_nested_call() -> None:
    """NestedCallError where this thread is compiling or loading a kernel (see
    :func:`resolve_num_threads`): asked before any compiled function a call runs, argument
    checks' included (bngrad._validate.running_var's scan)."""
    if _compiler_lock_is_mine() or (_POOL_START_LOCK is not None
                                    and _POOL_START_LOCK._is_owned()):
        raise NestedCallError(
            "bngrad was called while this thread's interrupted bngrad call (e.g. by a signal "
            "handler) is compiling or loading a kernel, or starting Numba's threads, which "
            "cannot be done twice at once; run the first call before installing the handler, "
            "or `bngrad precompile` (with --fused for the fused forms)")


def _compiler_lock_is_mine() -> bool:
    # (not where the lock is this thread's fork's, held while no compile runs: _ForkGate)
    return (_COMPILER_LOCK is not None and _COMPILER_LOCK._is_owned()
            and not _fork_gate.forking_here())


def current_num_threads() -> int:
    # numba.get_num_threads() takes two locks, one of them a process lock, on every call to
    # make sure the pool is started: ~2 us of a small call's ~25. Once it is started, ask the
    # threading layer directly (the same function Numba calls next).
    if getattr(_numba_parallel, "_is_initialized", False):
        count = _numba_parallel._get_num_threads()  # type: ignore[attr-defined]
        if count > 0:
            return count
    with _deferred_signals:  # (which starts Numba's threading layer: _DeferSignals)
        return numba.get_num_threads()


def threading_layer() -> str:
    """The Numba threading layer in use (after the first parallel launch)."""
    try:
        return numba.threading_layer()
    except ValueError:
        return numba.config.THREADING_LAYER
