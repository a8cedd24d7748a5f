"""Prototype: run Numba kernels on PyTorch's own OpenMP team (issue 12, item 1).

Inside a PyTorch program bngrad's kernels run on Numba's TBB pool while PyTorch's operators run
on its GNU OpenMP team; each pool spins after its work and takes the cores from the other. This
module launches a kernel on PyTorch's team instead, with nothing compiled ahead of time:

- the kernel is a loop over independent work items ``0..n-1`` whose body, ``body(item, args)``,
  is a Numba ``njit`` function that writes only its item's own outputs (so which thread runs
  which item cannot change the result);
- :func:`kernel` wraps the body in a Numba ``cfunc(void(voidptr))``, the "outlined function"
  of an OpenMP parallel region: it reads a small int64 header, asks the OpenMP runtime for its
  thread number and team size, and runs its contiguous share of the items;
- :meth:`Kernel.launch` (or :func:`launch_in_numba`, from Numba code) calls
  ``GOMP_parallel(fn, header, num_threads, 0)`` in the ``libgomp`` that PyTorch loaded (found
  next to ``torch.__file__`` and opened with ``RTLD_NOLOAD``, so never a second copy of the
  runtime), by its address, from compiled code: a launch costs one Numba dispatch.

The cfunc reaches ``omp_get_thread_num``/``omp_get_num_threads`` through their addresses, which
the launcher puts in the header, so the compiled code is bound to exactly the library PyTorch
uses, whatever other OpenMP runtimes the process holds.

Header (int64): ``[n_items, &omp_get_thread_num, &omp_get_num_threads, &args[0], len(args)]``.
``args`` is the body's own int64 block: sizes and array addresses (:func:`address`), turned
back into arrays inside the body with ``numba.carray(voidptr(addr), shape, dtype)``.

Where it runs on one thread:

- ``num_threads == 1`` (or a single item): the outlined function is called directly on the
  calling thread (outside a parallel region the runtime reports thread 0 of 1), which costs
  no team at all;
- in a forked child (of a process that had imported this module): GNU OpenMP is not
  fork-safe, a team the parent had (PyTorch's or ours) refers to threads that no longer exist
  in the child, and a parallel region there never ends (PyTorch's own operators hang the same
  way, which is why DataLoader workers set one thread). Whether the parent had a team cannot
  be asked, so a forked child always runs launches serially: slower, same bits, never a hang.

Availability: :func:`available` is False, with :func:`unavailable_reason` saying why, when
PyTorch is not installed, is not built with OpenMP, or its libgomp cannot be found or is not
loaded; callers then fall back to the Numba kernels.

Several Python threads may launch at once: each becomes the master of its own team (libgomp
keeps one pool per initial thread), and the launcher releases the GIL (``nogil=True``).

The real kernels here are :func:`elemt_channels_first` and :func:`reduce_channels_first`, the
two passes of the channels-first float32 training backward, on the work items of
``bngrad.kernels``' prange kernels (segments of runs; tiles of one channel).
"""

from __future__ import annotations

import ctypes
import glob
import os
import threading
from typing import Callable, Optional

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.extending import intrinsic

__all__ = ["Kernel", "address", "available", "elemt_channels_first", "kernel",
           "launch_in_numba", "reduce_channels_first", "team_size", "unavailable_reason",
           "voidptr"]

# Header slots (see module docstring).
_N_ITEMS, _THREAD_NUM, _NUM_THREADS, _ARGS, _N_ARGS = range(5)
_HEADER = 5


# --- finding PyTorch's OpenMP runtime ------------------------------------------------------------

class _Runtime:
    """The GNU OpenMP entry points of the library PyTorch loaded."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        # Addresses only: compiled code calls them (launch_in_numba, the outlined function).
        self.parallel = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
        self.thread_num = ctypes.cast(lib.omp_get_thread_num, ctypes.c_void_p).value
        self.num_threads = ctypes.cast(lib.omp_get_num_threads, ctypes.c_void_p).value


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


# --- forked children run serially (see module docstring) -----------------------------------------

_forked = False


def _after_fork_in_child() -> None:
    global _forked
    _forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


# --- compiling bodies into outlined functions ----------------------------------------------------

@intrinsic
def voidptr(typingctx, addr):
    """An int64 address as a ``void*`` (for ``numba.carray(voidptr(addr), shape, dtype)``)."""
    if not isinstance(addr, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(types.int64), codegen


@intrinsic
def _call_int_function(typingctx, addr):
    """Call the C function ``int f(void)`` at address ``addr``."""
    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        return builder.call(builder.inttoptr(args[0], fnty.as_pointer()), [])
    return types.int32(types.int64), codegen


@intrinsic
def _call_void_function(typingctx, fn, data):
    """Call the C function ``void fn(void *data)`` at address ``fn``."""
    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()),
                     [builder.inttoptr(args[1], i8p)])
        return context.get_dummy_value()
    return types.none(types.int64, types.int64), codegen


@intrinsic
def _call_gomp_parallel(typingctx, parallel, fn, data, num_threads):
    """``GOMP_parallel(fn, data, num_threads, 0)``, the entry point at address ``parallel``."""
    def codegen(context, builder, signature, args):
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i8p, i32, i32])
        builder.call(builder.inttoptr(args[0], fnty.as_pointer()),
                     [builder.inttoptr(args[1], i8p), builder.inttoptr(args[2], i8p),
                      builder.trunc(args[3], i32), ir.Constant(i32, 0)])
        return context.get_dummy_value()
    return types.none(types.int64, types.int64, types.int64, types.int64), codegen


# Slots of Kernel.functions().
_OUTLINED, _PARALLEL, _F_THREAD_NUM, _F_NUM_THREADS = range(4)


@njit(nogil=True)
def launch_in_numba(functions, args, n_items, num_threads):
    """:meth:`Kernel.launch` from Numba code (a whole launch in one dispatch from Python:
    measured 0.5 us on one thread, 2-3 us on a team of 2 kept warm; 10-15 us when the header
    was built in Python and GOMP_parallel called through ctypes).

    ``functions`` is :meth:`Kernel.functions`; ``num_threads`` is the team size (1: run on the
    calling thread; pass 1 in a forked child, see :func:`team_size`).
    """
    if n_items <= 0:
        return
    header = np.empty(_HEADER, np.int64)
    header[_N_ITEMS] = n_items
    header[_THREAD_NUM] = functions[_F_THREAD_NUM]
    header[_NUM_THREADS] = functions[_F_NUM_THREADS]
    header[_ARGS] = args.ctypes.data
    header[_N_ARGS] = args.size
    team = min(num_threads, n_items)
    if team <= 1:
        _call_void_function(functions[_OUTLINED], header.ctypes.data)
    else:
        _call_gomp_parallel(functions[_PARALLEL], functions[_OUTLINED], header.ctypes.data, team)
    # A use after the call: the header is not freed while the team reads it. (``args`` is
    # the caller's, alive until this returns.)
    header[0] = 0


def team_size(num_threads: Optional[int]) -> int:
    """The team size a launch gets: ``num_threads`` (default ``torch.get_num_threads()``),
    at least 1, and 1 in a forked child (see module docstring)."""
    if _forked:
        return 1
    if num_threads is None:
        import torch
        num_threads = torch.get_num_threads()
    return max(1, int(num_threads))


def address(array: np.ndarray) -> int:
    """The address of ``array``'s first element."""
    return array.__array_interface__["data"][0]


class Kernel:
    """A work-item body compiled as an OpenMP outlined function; see :func:`kernel`."""

    def __init__(self, body: Callable):
        self.body = body
        self._outlined = None
        self._functions: Optional[np.ndarray] = None
        self._compile_lock = threading.Lock()

    def _compiled(self):
        with self._compile_lock:
            if self._outlined is None:
                body = self.body

                # error_model="numpy": integer division by zero gives a value instead of
                # raising; an exception has nowhere to go on a team thread.
                @cfunc(types.void(types.voidptr), nopython=True, nogil=True,
                       error_model="numpy")
                def outlined(data):
                    header = carray(data, _HEADER, np.int64)
                    args = carray(voidptr(header[_ARGS]), header[_N_ARGS], np.int64)
                    n = header[_N_ITEMS]
                    t = np.int64(_call_int_function(header[_THREAD_NUM]))
                    k = np.int64(_call_int_function(header[_NUM_THREADS]))
                    # Contiguous shares: neighbouring items (usually neighbouring memory) stay
                    # on one thread. The split depends on the team size actually granted.
                    for item in range(n * t // k, n * (t + 1) // k):
                        body(item, args)

                self._outlined = outlined
            return self._outlined

    def functions(self) -> np.ndarray:
        """int64 addresses for :func:`launch_in_numba`: the outlined function, GOMP_parallel,
        omp_get_thread_num, omp_get_num_threads (compiles the body on first call).

        Raises
        ------
        RuntimeError
            If PyTorch's OpenMP runtime is not available (see :func:`unavailable_reason`).
        """
        if self._functions is None:
            runtime = _load()
            if runtime is None:
                raise RuntimeError(f"bngrad._gomp is unavailable: {_reason}")
            self._functions = np.array([self._compiled().address, runtime.parallel,
                                        runtime.thread_num,
                                        runtime.num_threads], dtype=np.int64)
        return self._functions

    def launch(self, args: np.ndarray, n_items: int, num_threads: Optional[int] = None) -> None:
        """Run items ``0..n_items-1`` of the body on PyTorch's OpenMP team.

        Parameters
        ----------
        args : ndarray of int64
            The body's argument block (sizes, :func:`address` of arrays). The arrays it points
            to must stay alive until this returns (it returns when every item is done).
        n_items : int
            Number of work items.
        num_threads : int, optional
            Team size; default ``torch.get_num_threads()``. Capped at ``n_items``.

        Raises
        ------
        RuntimeError
            If PyTorch's OpenMP runtime is not available (see :func:`unavailable_reason`).
        """
        functions = self.functions()
        if args.dtype != np.int64 or not args.flags.c_contiguous:
            args = np.ascontiguousarray(args, dtype=np.int64)
        launch_in_numba(functions, args, n_items, team_size(num_threads))


def kernel(body: Callable) -> Kernel:
    """Make ``body(item, args)`` a kernel that runs on PyTorch's team.

    ``body`` is a Numba ``njit`` function of an int64 item number and the int64 argument block
    given to :meth:`Kernel.launch`; it must write only outputs that belong to its item (the
    assignment of items to threads is contiguous and deterministic, but results must not
    depend on it), and must not raise (there is no Python on a team thread to receive the
    exception: compile it with ``error_model="numpy"`` and no bounds checks). Compiled on
    first launch.
    """
    return Kernel(body)


# --- real kernels --------------------------------------------------------------------------------
#
# Their per-item code is written here rather than taken from bngrad.kernels, which is being
# redesigned: these bodies only have to show that a real kernel runs right and fast on the
# team, and their arithmetic is spelled out so that NumPy can reproduce it bit for bit.

@njit(nogil=True, error_model="numpy")
def _elemt_run(xr, dr, outr, a, b, d, m):
    for i in range(outr.shape[0]):
        outr[i] = a * dr[i] - b * (xr[i] - m) - d


@njit(nogil=True, error_model="numpy")
def _elemt_body(item, args):
    A, C, B, seg = args[0], args[1], args[2], args[3]
    x = carray(voidptr(args[4]), (A, C, B), np.float32)
    dy = carray(voidptr(args[5]), (A, C, B), np.float32)
    out = carray(voidptr(args[6]), (A, C, B), np.float32)
    coef = carray(voidptr(args[7]), (4, C), np.float32)
    n_segs = (B + seg - 1) // seg
    run, s = item // n_segs, item % n_segs
    a, c = run // C, run % C
    b0, b1 = s * seg, min(B, s * seg + seg)
    # Slices start at index 0, which lets LLVM vectorise the loop.
    _elemt_run(x[a, c, b0:b1], dy[a, c, b0:b1], out[a, c, b0:b1], coef[0, c], coef[1, c],
               coef[2, c], coef[3, c])


@njit(nogil=True, error_model="numpy")
def _reduce_body(item, args):
    A, C, B, rows, seg = args[0], args[1], args[2], args[3], args[4]
    x = carray(voidptr(args[5]), (A, C, B), np.float32)
    dy = carray(voidptr(args[6]), (A, C, B), np.float32)
    mean = carray(voidptr(args[7]), C, np.float64)
    n_blocks, n_segs = (A + rows - 1) // rows, (B + seg - 1) // seg
    partial = carray(voidptr(args[8]), (n_blocks, n_segs, C, 2), np.float64)
    c = item % C
    s = (item // C) % n_segs
    j = item // C // n_segs
    m = mean[c]
    sum_dy = 0.0
    sum_dy_xmu = 0.0
    # Strictly sequential float64 sums (no fastmath): slower than the vectorised sums of
    # bngrad.kernels, but reproducible by NumPy's cumsum, which is what the tests check.
    for a in range(j * rows, min(A, j * rows + rows)):
        for b in range(s * seg, min(B, s * seg + seg)):
            d = np.float64(dy[a, c, b])
            sum_dy += d
            sum_dy_xmu += d * (np.float64(x[a, c, b]) - m)
    partial[j, s, c, 0] = sum_dy
    partial[j, s, c, 1] = sum_dy_xmu


_elemt = kernel(_elemt_body)
_reduce = kernel(_reduce_body)


@njit(nogil=True)
def _elemt_launch(x, dy, out, coef, seg, functions, num_threads):
    A, C, B = dy.shape
    args = np.empty(8, np.int64)
    args[0], args[1], args[2], args[3] = A, C, B, seg
    args[4], args[5], args[6], args[7] = x.ctypes.data, dy.ctypes.data, out.ctypes.data, \
        coef.ctypes.data
    launch_in_numba(functions, args, A * C * ((B + seg - 1) // seg), num_threads)


@njit(nogil=True)
def _reduce_launch(x, dy, mean, rows, seg, partial, functions, num_threads):
    A, C, B = x.shape
    args = np.empty(9, np.int64)
    args[0], args[1], args[2], args[3], args[4] = A, C, B, rows, seg
    args[5], args[6], args[7], args[8] = x.ctypes.data, dy.ctypes.data, mean.ctypes.data, \
        partial.ctypes.data
    launch_in_numba(functions, args, partial.shape[0] * partial.shape[1] * C, num_threads)


def _check_sizes(**sizes):
    for name, value in sizes.items():
        if int(value) < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _check(arrays, dtypes, shape):
    for a, dtype in zip(arrays, dtypes):
        if a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"expected C-contiguous {np.dtype(dtype)} arrays, got {a.dtype}")
    for a in arrays[:shape]:
        if a.shape != arrays[0].shape:
            raise ValueError(f"shapes differ: {arrays[0].shape} and {a.shape}")


def elemt_channels_first(x: np.ndarray, dy: np.ndarray, out: np.ndarray, coef: np.ndarray,
                         seg: int, num_threads: Optional[int] = None) -> None:
    """Training grad_input ``out = a*dy - b*(x - mean) - d`` of float32 ``(A, C, B)`` arrays.

    Parameters
    ----------
    x, dy, out : ndarray of float32, shape (A, C, B), C-contiguous
    coef : ndarray of float32, shape (4, C)
        Rows ``a``, ``b``, ``d``, ``mean`` per channel.
    seg : int
        Work item: a segment of at most ``seg`` elements of one run ``[a, c, :]``.
    num_threads : int, optional
        Team size (default ``torch.get_num_threads()``).
    """
    _check((x, dy, out, coef), (np.float32,) * 4, shape=3)
    _check_sizes(seg=seg)
    A, C, B = dy.shape
    if coef.shape != (4, C):
        raise ValueError(f"coef has shape {coef.shape}, expected {(4, C)}")
    _elemt_launch(x, dy, out, coef, seg, _elemt.functions(), team_size(num_threads))


def reduce_channels_first(x: np.ndarray, dy: np.ndarray, mean: np.ndarray, rows: int, seg: int,
                          partial: np.ndarray, num_threads: Optional[int] = None) -> None:
    """Per-tile ``(sum dy, sum dy*(x - mean))`` of float32 ``(A, C, B)`` arrays, in float64.

    Parameters
    ----------
    x, dy : ndarray of float32, shape (A, C, B), C-contiguous
    mean : ndarray of float64, shape (C,)
    rows, seg : int
        Work item: a tile of ``rows`` rows by ``seg`` elements of one channel.
    partial : ndarray of float64, shape (ceil(A/rows), ceil(B/seg), C, 2)
        Written: ``partial[j, s, c]`` holds tile (j, s, c)'s two sums, each added in element
        order (row by row).
    num_threads : int, optional
        Team size (default ``torch.get_num_threads()``).
    """
    _check((x, dy, mean, partial), (np.float32, np.float32, np.float64, np.float64), shape=2)
    _check_sizes(rows=rows, seg=seg)
    A, C, B = x.shape
    tiles = (-(-A // rows), -(-B // seg), C, 2)
    if partial.shape != tiles or mean.shape != (C,):
        raise ValueError(f"partial {partial.shape} and mean {mean.shape}: expected {tiles} "
                         f"and {(C,)}")
    _reduce_launch(x, dy, mean, rows, seg, partial, _reduce.functions(), team_size(num_threads))
