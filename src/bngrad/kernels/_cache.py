"""Numba's disk cache of the kernels, invalidated by the sources they inline, safe between
processes.

Numba stamps a cached function with the contents of the file that defines it, and nothing
else. The loops of kernels.batchnorm link in the per-element maths of ``_ops`` and the codecs of
``_elements`` (``@overload``s, compiled into the loop's machine code), and its one-call passes
the parallel region of ``_launch``, so an edit there left the cached loops as they were: a
maintainer's change that silently did not run. :func:`install` wraps whichever locator Numba
picks for a function defined in this package, adding the contents of :data:`INLINED` to its
stamp. Imported by the package before the kernels are defined (the locator is chosen when a
function is decorated).

Numba's cache keeps, per function, an index (signature -> data file) and numbered data files.
A process that saves a new signature reads the index, takes the first free number, writes the
index, then the data: two processes compiling different signatures of one function at once
(pytest's workers, ranks of a distributed job, workers started together on a cold cache) can
take the same number, and the index then names a file that holds the other signature's code,
which a later process loads: an "can't unbox array" TypeError at best (seen in this project's
test suite, 2026-12-02). :func:`lock_cache_files` puts each kernel's index and data under a
file lock (:class:`LockedCacheFile`): saving holds it exclusively, loading shared.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Iterator, Optional

from numba.core.caching import CacheImpl, IndexDataCacheFile

try:
    import fcntl
except ImportError:  # not a POSIX system: Numba's cache as it is
    fcntl = None  # type: ignore[assignment]

HERE = os.path.dirname(os.path.abspath(__file__))
INLINED = ("_ops.py", "_elements.py", "_launch.py")


def sources_stamp(paths: tuple[str, ...]) -> str:
    """One digest of the files' contents, in order."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


class InlinedSourcesLocator:
    """Numba's own locator for the function, with :data:`INLINED` added to its stamp."""

    def __init__(self, inner: Any):
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_source_stamp(self) -> Any:
        return (self._inner.get_source_stamp(),
                sources_stamp(tuple(os.path.join(HERE, name) for name in INLINED)))

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Optional[InlinedSourcesLocator]:
        if os.path.dirname(os.path.abspath(py_file)) != HERE:
            return None
        locator_classes: list[Any] = CacheImpl._locator_classes
        for locator_class in locator_classes:
            if locator_class is not cls:
                inner = locator_class.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
        return None


def install() -> None:
    """Put the locator first in Numba's list (once)."""
    if InlinedSourcesLocator not in CacheImpl._locator_classes:
        locator_classes: list[Any] = CacheImpl._locator_classes
        locator_classes.insert(0, InlinedSourcesLocator)


class LockedCacheFile(IndexDataCacheFile):
    """Numba's index-and-data cache file of one function, read and written under a lock on
    ``<index>.lock`` beside it (module docstring). Where the lock file cannot be opened (a
    read-only cache, no POSIX locks) it behaves as Numba's own."""

    def save(self, key: Any, data: Any) -> None:
        with self._locked(exclusive=True):
            super().save(key, data)

    def load(self, key: Any) -> Any:
        with self._locked(exclusive=False):
            return super().load(key)

    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        try:
            lock = open(self._index_path + ".lock", "a") if fcntl is not None else None
        except OSError:  # no cache directory yet (nothing to load), or not writable
            lock = None
        if lock is None:
            yield
            return
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def lock_cache_files(namespace: dict) -> None:
    """Give every cached Numba function in ``namespace`` (a module's globals, once its
    functions are defined) a :class:`LockedCacheFile`."""
    for value in list(namespace.values()):
        cache_file = getattr(getattr(value, "_cache", None), "_cache_file", None)
        if type(cache_file) is IndexDataCacheFile:
            cache_file.__class__ = LockedCacheFile
