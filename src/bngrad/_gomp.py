"""PyTorch's OpenMP runtime, and which pool runs bngrad.torch's kernels (issue 12, item 1).

Inside a PyTorch program, bngrad's kernels on Numba's TBB pool and PyTorch's operators on its
GNU OpenMP team compete: each pool spins after its work and takes the cores from the other.
Under ``bngrad.torch`` the kernels can therefore run on PyTorch's own team: this module finds
it and says when to use it; kernels._launch has the launchers.

- **The runtime**: the ``libgomp`` PyTorch loaded (next to ``torch.__file__``: ``torch/lib``
  in the CPU wheels, ``torch.libs`` in repaired ones), opened with ``RTLD_NOLOAD``, so never a
  second copy of the runtime; compiled launchers call its ``GOMP_parallel`` by address
  (:func:`parallel_address`). :func:`available` is False, with :func:`unavailable_reason`
  saying why, when PyTorch is not installed, not built with OpenMP, or its libgomp cannot be
  found or is not loaded; bngrad.torch then falls back to Numba's pool, silently, and
  :func:`kernel_pool` (``bngrad.torch.kernel_pool()``) says so.
- **The choice**: ``kernels.launcher`` asks :func:`use_torch_team` at every parallel launch.
  bngrad.torch's entry points run under :func:`on_torch_team` (a context variable: each
  Python thread and asyncio task has its own) and take the team. NumPy callers take it too in
  a process that has imported PyTorch (:func:`_numpy_calls_may_join`): there PyTorch's team
  already spins on the cores after its operators, and a launch on Numba's pool would fight
  it, or wait for TBB workers that went to sleep (a 4096x1024 float32 backward, 2 threads,
  2 ms after PyTorch's last operator: 3.9 ms on Numba's pool, 2.7 ms on the team; 256x4096
  0.95 vs 0.52 ms; benchmarks/results/2026-12-04-session29.txt). A process that has not
  imported PyTorch keeps Numba's TBB pool and never imports PyTorch for it. The team is the
  default (docs/torch.md, "Threads", has the measurements): :func:`set_kernel_pool`
  ``("numba")`` (or the environment variable ``BNGRAD_TORCH_POOL=numba``) goes back to
  Numba's pool for every call.
- **Fork**: GNU OpenMP is not fork-safe: a team the parent had (PyTorch's or bngrad's) refers,
  in the child, to threads that no longer exist, and a parallel region there never ends
  (PyTorch's own operators hang the same way, which is why DataLoader workers set one
  thread). Whether the parent had a team cannot be asked, so in a process forked after this
  module was imported bngrad.torch's launches run serially (:func:`forked`): slower, same
  bits, never a hang; NumPy callers there go back to Numba's pool (TBB is fork-safe), as
  they do in any child of ``multiprocessing`` (which may have been forked before this module
  was imported, unseen).
- **Threads**: several Python threads may launch at once: each becomes the master of its own
  team (libgomp keeps one pool per initial thread); the launchers release the GIL.
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import glob
import inspect
import os
import sys
import threading
import warnings
from typing import Any, Callable, Optional, TypeVar, cast

__all__ = ["POOLS", "available", "forked", "on_torch_team", "parallel_address",
           "set_kernel_pool", "thread_num_address", "kernel_pool", "unavailable_reason",
           "use_torch_team"]

_F = TypeVar("_F", bound=Callable[..., Any])


# --- finding PyTorch's OpenMP runtime ------------------------------------------------------------

class _Runtime:
    """The GNU OpenMP entry points of the library PyTorch loaded."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        # Addresses only: compiled code calls them (kernels._launch).
        self.parallel: int = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value or 0
        self.thread_num: int = ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value or 0


def _libgomp_candidates(torch_dir: str) -> list[str]:
    """libgomp files shipped with PyTorch: ``torch/lib/libgomp.so.1`` in the CPU wheels,
    ``torch.libs/libgomp-<hash>.so.1`` in auditwheel-repaired ones."""
    patterns = [os.path.join(torch_dir, "lib", "libgomp*.so*"),
                os.path.join(os.path.dirname(torch_dir), "torch.libs", "libgomp*.so*")]
    return [path for pattern in patterns for path in sorted(glob.glob(pattern))]


def _find_runtime(torch_dir: str) -> tuple[Optional[_Runtime], str]:
    """(runtime, "") or (None, why not), for the libgomp PyTorch in ``torch_dir`` loaded."""
    nolo = getattr(os, "RTLD_NOLOAD", None)
    if nolo is None:
        return None, "this platform cannot look up an already loaded library (no RTLD_NOLOAD)"
    candidates = _libgomp_candidates(torch_dir)
    if not candidates:
        return None, f"no libgomp next to PyTorch (looked in {torch_dir}/lib and torch.libs)"
    for path in candidates:
        try:
            # RTLD_NOLOAD: only a library already in the process, i.e. the one PyTorch uses.
            lib = ctypes.CDLL(path, mode=nolo | os.RTLD_LOCAL)
            return _Runtime(lib, path), ""
        except (OSError, AttributeError):
            continue
    return None, f"PyTorch's libgomp is not loaded in this process ({', '.join(candidates)})"


_lock = threading.Lock()
_runtime: Optional[_Runtime] = None
_reason: Optional[str] = None  # None: not looked up yet


def _load() -> Optional[_Runtime]:
    global _runtime, _reason
    if _reason is not None:  # looked up already: no lock on the launch path
        return _runtime
    with _lock:
        if _reason is None:
            try:
                import torch
            except ImportError:
                _runtime, _reason = None, "PyTorch is not installed"
            else:
                if "OpenMP" not in torch.__config__.parallel_info():
                    _runtime, _reason = None, "PyTorch is not built with OpenMP"
                else:
                    _runtime, _reason = _find_runtime(os.path.dirname(torch.__file__))
        return _runtime


def available() -> bool:
    """Whether kernels can run on PyTorch's OpenMP team (imports PyTorch on first call)."""
    return _load() is not None


def unavailable_reason() -> Optional[str]:
    """Why :func:`available` is False (None when it is True)."""
    return None if _load() is not None else _reason


# --- forked children run serially (see the module docstring) -------------------------------------

_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def forked() -> bool:
    """Whether this process was forked after this module was imported (launches run serially).
    A child forked before the import cannot be told from a fresh process (docs/torch.md)."""
    return _forked


def _loaded() -> _Runtime:
    """The runtime; RuntimeError where it is unavailable."""
    runtime = _load()
    if runtime is None:
        raise RuntimeError(f"bngrad._gomp is unavailable: {_reason}")
    return runtime


def parallel_address() -> int:
    """The address of ``GOMP_parallel`` in PyTorch's libgomp (for compiled launchers).

    Raises
    ------
    RuntimeError
        If PyTorch's OpenMP runtime is not available (see :func:`unavailable_reason`).
    """
    return _loaded().parallel


def thread_num_address() -> int:
    """The address of ``omp_get_thread_num`` in PyTorch's libgomp (for compiled launchers:
    which share of a launch's items a team thread starts on; kernels._launch).

    Raises
    ------
    RuntimeError
        If PyTorch's OpenMP runtime is not available (see :func:`unavailable_reason`).
    """
    return _loaded().thread_num


# --- who runs bngrad's kernels -------------------------------------------------------------------
#
# bngrad.torch's entry points run under on_torch_team (a context variable, so each Python thread
# and asyncio task has its own); kernels.__init__ reads use_torch_team() when it picks its
# launchers. NumPy callers never set it: they join the team only in a process that has imported
# PyTorch (_numpy_calls_may_join), else keep Numba's TBB pool.

POOLS = ("torch", "numba")
_ENV = "BNGRAD_TORCH_POOL"
# On by default: in a training step every launch on Numba's pool wakes workers that PyTorch's
# spinning team keeps from the cores; on PyTorch's team the step ratio improved on every model
# and layout measured (docs/torch.md, "Threads"). On a machine loaded by other processes every
# OpenMP region, PyTorch's own included, waits for a descheduled team thread: "numba" there.
_DEFAULT = "torch"
_pool = os.environ.get(_ENV, _DEFAULT).strip().lower() or _DEFAULT
if _pool not in POOLS:  # a typo must not silently change the pool: say so once, use the default
    warnings.warn(f"{_ENV}={_pool!r} is not one of {POOLS}; using {_DEFAULT!r}", stacklevel=1)
    _pool = _DEFAULT
_on_team: contextvars.ContextVar[bool] = contextvars.ContextVar("bngrad_torch_team",
                                                                default=False)


def set_kernel_pool(pool: str) -> None:
    """Choose the pool bngrad's kernels run on in a process that has imported PyTorch:
    ``"torch"`` (PyTorch's OpenMP team, the default, for bngrad.torch's calls and the NumPy
    API's alike) or ``"numba"`` (Numba's TBB pool, as in a process without PyTorch; better
    where other processes keep the cores busy). The environment variable
    ``BNGRAD_TORCH_POOL`` sets the pool at import. Results are bitwise the same either way.

    Raises
    ------
    ValueError
        For any other name.
    """
    global _pool
    if pool not in POOLS:
        raise ValueError(f"pool: expected one of {POOLS}, got {pool!r}")
    _pool = pool


def kernel_pool() -> str:
    """The pool bngrad.torch's kernels run on now (and the NumPy API's, where
    :func:`_numpy_calls_may_join`): ``"torch"``, or ``"numba"``, followed by why where
    ``"torch"`` was chosen but PyTorch's libgomp is unavailable (the silent fallback)."""
    if _pool == "numba":
        return "numba"
    if _load() is None:
        return f"numba (PyTorch's OpenMP team is unavailable: {_reason})"
    return "torch"


def use_torch_team() -> bool:
    """Whether the kernels called now run on PyTorch's team: with the pool set to ``"torch"``
    and PyTorch's libgomp available, inside :func:`on_torch_team` (bngrad.torch's calls), or
    for a NumPy caller where :func:`_numpy_calls_may_join`."""
    return (_pool == "torch" and (_on_team.get() or _numpy_calls_may_join())
            and _load() is not None)


def _numpy_calls_may_join() -> bool:
    """Whether a NumPy caller's kernels may run on PyTorch's team: PyTorch is imported (so
    its libgomp is loaded; checked without importing it), and this process is neither forked
    after this module's import (:func:`forked`) nor a ``multiprocessing`` child, which may have
    been forked from a process that had a team before bngrad was imported, where a parallel
    region would never end. (bngrad.torch's calls follow PyTorch instead: serial in the first
    case, DataLoader workers set one thread.)"""
    if sys.modules.get("torch") is None or _forked:
        return False
    # A multiprocessing child has the module (its bootstrap runs in it): no import for this.
    mp = sys.modules.get("multiprocessing")
    return mp is None or mp.parent_process() is None


def on_torch_team(fn: _F) -> _F:
    """Decorator: the kernels ``fn`` calls run on PyTorch's team (see :func:`use_torch_team`).

    The wrapper keeps ``fn``'s signature with its annotations evaluated (in ``fn``'s module),
    so that ``torch.library.custom_op`` infers the same schema from it as from ``fn``.
    """
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _on_team.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _on_team.reset(token)
    try:
        wrapper.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    except (NameError, TypeError, SyntaxError):  # a name defined later: left to the caller
        pass
    return cast(_F, wrapper)
