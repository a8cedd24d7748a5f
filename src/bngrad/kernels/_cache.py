"""Numba's disk cache of the kernels, invalidated by the sources they inline.

Numba stamps a cached function with the contents of the file that defines it, and nothing
else. The loops of kernels.batchnorm link in the per-element maths of ``_ops`` and the codecs of
``_elements`` (``@overload``s, compiled into the loop's machine code), and its one-call passes
the parallel region of ``_launch``, so an edit there left the cached loops as they were: a
maintainer's change that silently did not run. :func:`install` wraps whichever locator Numba
picks for a function defined in this package, adding the contents of :data:`INLINED` to its
stamp. Imported by the package before the kernels are defined (the locator is chosen when a
function is decorated).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

from numba.core.caching import CacheImpl

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
