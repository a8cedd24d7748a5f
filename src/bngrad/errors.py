"""bngrad's exceptions: ValueError / TypeError subclasses, so callers catch them as usual."""

from __future__ import annotations

__all__ = ["BngradError", "ArgumentValueError", "ArgumentTypeError", "NestedCallError"]


class BngradError(Exception):
    """Base class of every exception bngrad raises on purpose."""


class ArgumentValueError(BngradError, ValueError):
    """An argument has the right type but an unusable value (shape, length, range, ...)."""


class ArgumentTypeError(BngradError, TypeError):
    """An argument has the wrong type or dtype."""


class NestedCallError(BngradError, RuntimeError):
    """A call made on a thread whose interrupted call (e.g. by a signal handler) is compiling
    or loading a kernel, which Numba cannot do twice at once on one thread."""
