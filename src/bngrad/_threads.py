"""Numba threading: pick a layer that is safe from several Python threads and after fork().

Numba's layers differ: workqueue is not thread-safe, GNU OpenMP is not fork-safe, TBB is both.
The ``tbb`` wheel puts ``libtbb.so.12`` in ``<prefix>/lib``, which the dynamic loader does not
search, so we load it by path before Numba looks for it. Where TBB cannot be loaded we fall back
to workqueue and serialise kernel launches with a lock, which is safe but runs one call at a time.
This module must be imported before the first parallel kernel runs (bngrad/__init__ does that).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import site
import sys
import threading
from typing import Iterator, Optional

import numba

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
        from numba.np.ufunc import tbbpool  # noqa: F401
        return True
    except ImportError:
        pass
    for directory in _tbb_search_dirs():
        for name in _TBB_NAMES:
            path = os.path.join(directory, name)
            if os.path.exists(path):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                    from numba.np.ufunc import tbbpool  # noqa: F401
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
_launch_lock = threading.Lock()


@contextlib.contextmanager
def parallel_region(num_threads: Optional[int]) -> Iterator[None]:
    """Run the enclosed kernels on ``num_threads`` threads (None: all), safely.

    Numba's thread count is thread-local, so concurrent callers do not disturb each other.
    The count is capped at the size of Numba's pool (NUMBA_NUM_THREADS, the machine's cores).
    """
    lock = contextlib.nullcontext() if _LAUNCH_IS_THREAD_SAFE else _launch_lock
    with lock:
        if num_threads is None:
            yield
            return
        previous = numba.get_num_threads()
        numba.set_num_threads(min(num_threads, numba.config.NUMBA_NUM_THREADS))
        try:
            yield
        finally:
            numba.set_num_threads(previous)


def current_num_threads() -> int:
    return numba.get_num_threads()


def threading_layer() -> str:
    """The Numba threading layer in use (after the first parallel launch)."""
    try:
        return numba.threading_layer()
    except ValueError:
        return numba.config.THREADING_LAYER
