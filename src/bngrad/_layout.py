"""Any strides -> one of two canonical dense views, or one copy.

An array that is dense in *some* axis order is transposed (a view) into that memory order,
where it is C-contiguous. With the channel axis at position k of that order, the view reshapes
(still a view) to channels-first ``(A, C, B)`` — A the product of the axes before k, B of those
after — or, when B == 1, to channels-last ``(A, C)``. NCHW gives (N, C, H*W); NHWC strides give
(N*H*W, C); 2-D (N, C) gives (N, C); any other dense permutation works the same way.

grad_out is read in input's memory order; if it is not dense in that order it is copied once.
An input that is not dense in any order (sliced, padded, negative strides) is copied once into
C order, in parallel where it can be. grad_input is allocated in the order that was used:
input's own order whenever input is dense, C order otherwise.

All of this depends on the arrays only through their shape, strides and dtype (and the channel
axis): it is found once per such signature (``_Layout``, cached), and a repeated call only
makes the views (issue 12: the fixed cost of a call).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import numpy as np

from . import kernels
from .kernels import as_kernel_array


def _memory_order(array: np.ndarray) -> Optional[tuple[int, ...]]:
    """Axis order in which ``array`` is C-contiguous, or None if there is none."""
    order = tuple(sorted(range(array.ndim), key=lambda axis: -array.strides[axis]))
    if array.transpose(order).flags.c_contiguous and min(array.strides, default=0) >= 0:
        return order
    return None


class Plan:
    """Canonical kernel views of input (and grad_out) and how to make outputs like them.

    ``x``: (A, C, B) or (M, C), kernel element type, or a :class:`RowCopies` of that shape;
    ``dy``: the same, or None;
    ``order``: memory order of the logical axes used for x, dy and outputs; ``copied``: the
    arguments that had to be copied (shown by bngrad.explain); ``kernel``: the kernel path and
    tiles for x on the call's threads. (A plain class: one is made per call.)
    """

    __slots__ = ("_x", "dy", "kernel", "_layout", "_pending")

    def __init__(self, x: Optional[kernels.Operand], dy: Optional[kernels.Operand],
                 layout: _Layout, kernel: kernels.KernelPlan,
                 pending: Optional[tuple[str, np.ndarray]] = None) -> None:
        self._x, self.dy, self.kernel, self._layout = x, dy, kernel, layout
        # ("grad_out" or "input", the array): copied into grad_input's buffer by output()
        self._pending = pending

    @property
    def x(self) -> kernels.Operand:
        """input's canonical view (with ``grad_in_output``, where input is copied into
        grad_input's buffer: once :meth:`output` has made that buffer)."""
        if self._x is None:
            raise TypeError("input is copied into grad_input's buffer: call output first")
        return self._x

    @property
    def order(self) -> tuple[int, ...]:
        return self._layout.order

    @property
    def layout(self) -> _Layout:
        """What the plan depends on only through shapes, strides, dtype and channel axis."""
        return self._layout

    @property
    def copied(self) -> tuple[str, ...]:
        return self._layout.copied

    @property
    def grad(self) -> kernels.Operand:
        """``dy`` of a plan made with a grad_out (every backward's; with ``grad_in_output``,
        once :meth:`output` has made grad_input's buffer)."""
        if self.dy is None:
            raise TypeError("this plan was made without a grad_out" if self._pending is None
                            or self._pending[0] != "grad_out"
                            else "grad_out is copied into grad_input's buffer: call output first")
        return self.dy

    def empty_output(self, shape: tuple[int, ...], dtype: np.dtype
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(kernel view, user array) of a new array shaped like input, in the plan's order."""
        memory = np.empty(self._layout.memory_shape, dtype=dtype)
        user = memory.transpose(self._layout.inverse)
        return as_kernel_array(memory).reshape(self._layout.canonical), user

    def canonical(self, array: np.ndarray) -> np.ndarray:
        """The kernel view of ``array`` (input's shape, any layout; a bool array is seen as
        uint8) laid out like x: a view where it is dense in the plan's order, else one copy
        (as grad_out's)."""
        if array.dtype == np.bool_:
            array = array.view(np.uint8)
        memory = array.transpose(self.order)
        if not memory.flags.c_contiguous:
            memory = _in_order(array, self.order, self.kernel.threads)
        return as_kernel_array(memory).reshape(self._layout.canonical)

    def output(self, shape: tuple[int, ...], dtype: np.dtype, out: Optional[np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray]:
        """(kernel view, array the kernel's result ends up in) for an optional ``out``.

        ``out`` is written directly when it is dense in the plan's order; otherwise the kernel
        writes a new array and :meth:`finish_output` copies it into ``out``. The array the plan
        was to copy into grad_input's buffer (``plan(grad_in_output=True)``: grad_out, or input)
        is copied into this one and becomes ``dy`` (``x``): the kernels then compute in place,
        reading each element of dy and x before writing it. (Not where ``out`` is the other
        one: the copy then gets a buffer of its own.)
        """
        result = None
        if out is not None:
            memory = out.transpose(self.order)
            if memory.flags.c_contiguous:
                result = out
        if result is None:
            memory = np.empty(self._layout.memory_shape, dtype=dtype)
            result = memory.transpose(self._layout.inverse)
        kernel = as_kernel_array(memory).reshape(self._layout.canonical)
        if self._pending is not None:
            (name, array), self._pending = self._pending, None
            aliased = result is out and any(isinstance(a, np.ndarray) and np.may_share_memory(
                out, a) for a in (self._x, self.dy))
            copy = as_kernel_array(_in_order(array, self.order, self.kernel.threads,
                                             None if aliased else memory))
            copy = copy.reshape(self._layout.canonical)
            copy.flags.writeable = False
            if name == "input":
                self._x = copy
            else:
                self.dy = copy
        return kernel, result

    def finish_output(self, result: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
        """``result`` itself, or ``out`` after copying ``result`` into it: in parallel where
        ``out`` is dense in some order, a tiled transpose where that is the plan's with two
        blocks of axes swapped (out NCHW for an NHWC input: (32, 256, 56, 56) float32, NumPy's
        copy 70-80 ms, this 12-14 ms)."""
        if out is None or result is out:
            return result
        order = _memory_order(out)
        if order is None:
            np.copyto(out, result)
        else:
            _in_order(result, order, self.kernel.threads, out.transpose(order))
        return out


def _block_swap(perm: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """(i, j) if perm == (0..i-1, j..n-1, i..j-1): two adjacent blocks of axes swapped."""
    n = len(perm)
    for i in range(n):
        for j in range(i + 1, n):
            if perm == tuple(range(i)) + tuple(range(j, n)) + tuple(range(i, j)):
                return i, j
    return None


def _dense_copy(array: np.ndarray, threads: int, out: Optional[np.ndarray] = None
                ) -> np.ndarray:
    """A C-contiguous copy of ``array`` (in ``out``, C-contiguous, if given), its rows copied in
    parallel where all axes but the last merge into one (crops and strided slices of a dense
    array); NumPy's serial copy otherwise. ((32, 256, 56, 56) float32 cropped from width 64:
    15.3 -> 9.6 ms.)"""
    if out is None:
        out = np.empty(array.shape, array.dtype)
    try:
        rows = array.reshape(-1, array.shape[-1], copy=False)
    except ValueError:  # the axes do not merge (or the array is empty)
        np.copyto(out, array)
        return out
    kernels.copy_rows(as_kernel_array(rows), as_kernel_array(out).reshape(rows.shape), threads)
    return out


def _in_order(array: np.ndarray, order: tuple[int, ...], threads: int,
              out: Optional[np.ndarray] = None) -> np.ndarray:
    """A C-contiguous copy of ``array.transpose(order)`` (in ``out``, if given).

    When array is dense in an order that is ``order`` with two blocks of axes swapped (grad_out
    channels-last while input is channels-first, or the reverse), the copy is a parallel tiled
    transpose; anything else (slices, odd strides) is copied by NumPy.
    """
    own = _memory_order(array)
    swap = None if own is None else _block_swap(tuple(own.index(axis) for axis in order))
    if swap is None:
        return _dense_copy(array.transpose(order), threads, out)
    i, j = swap
    memory = array.transpose(own)
    source = memory.reshape(math.prod(memory.shape[:i]), math.prod(memory.shape[i:j]),
                            math.prod(memory.shape[j:]))
    copy = (np.empty(tuple(array.shape[axis] for axis in order), dtype=array.dtype)
            if out is None else out)
    kernels.transpose_last_two(as_kernel_array(source),
                               as_kernel_array(copy).reshape(source.shape[0], source.shape[2],
                                                             source.shape[1]),
                               threads)
    return copy


class _Layout(NamedTuple):
    """What a call's layout depends on only through (shape, strides, dtype, channel axis):
    found once per such signature (_layouts), so that a repeated call only makes the views."""

    order: tuple[int, ...]          # memory order of input's axes (C order if input is copied)
    inverse: tuple[int, ...]        # the order's inverse permutation (outputs' transpose)
    memory_shape: tuple[int, ...]   # input's shape in that order
    canonical: tuple[int, ...]      # the kernel view's shape, (A, C, B) or (M, C)
    copied: tuple[str, ...]         # "input": not dense in any order; "grad_out": not in order


def _find_layout(input: np.ndarray, grad_out: Optional[np.ndarray], channel_axis: int
                 ) -> _Layout:
    copied = []
    order = _memory_order(input)
    if order is None:
        copied.append("input")
        order = tuple(range(input.ndim))
    if grad_out is not None and not grad_out.transpose(order).flags.c_contiguous:
        copied.append("grad_out")
    memory_shape = tuple(input.shape[axis] for axis in order)
    position = order.index(channel_axis)
    A = math.prod(memory_shape[:position])
    B = math.prod(memory_shape[position + 1:])
    C = memory_shape[position]
    return _Layout(order, tuple(int(i) for i in np.argsort(order)), memory_shape,
                   (A, C) if B == 1 else (A, C, B), tuple(copied))


class RowCopies:
    """Canonical rows of an array that is not dense in the kernels' order, copied a chunk at a
    time (kernels.reduce and kernels.elementwise take one in place of the canonical array):
    extra memory of one chunk instead of a whole copy.

    ``rows(r0, r1)`` copies the indices of the first memory axis that hold canonical rows
    r0..r1-1 (``unit`` rows each) into a buffer reused from chunk to chunk, and returns those
    rows as a read-only C-contiguous array, the same values as the whole copy's rows.
    """

    def __init__(self, array: np.ndarray, order: tuple[int, ...], canonical: tuple[int, ...],
                 threads: int) -> None:
        self._array, self._order, self._threads = array, order, threads
        self.shape = canonical
        self.dtype = as_kernel_array(array[:0]).dtype
        self.unit = canonical[0] // array.shape[order[0]]  # canonical rows per first index
        self.row_bytes = array.itemsize * math.prod(canonical[1:])
        self._buffer: Optional[np.ndarray] = None

    def rows(self, r0: int, r1: int) -> np.ndarray:
        first, unit = self._order[0], self.unit
        s0, s1 = r0 // unit, -(-r1 // unit)
        index = (slice(None),) * first + (slice(s0, s1),)
        part = self._array[index]
        n = part.size
        if self._buffer is None or self._buffer.size < n:
            self._buffer = np.empty(n, self._array.dtype)
        memory_shape = tuple(part.shape[axis] for axis in self._order)
        copy = _in_order(part, self._order, self._threads,
                         self._buffer[:n].reshape(memory_shape))
        rows = as_kernel_array(copy).reshape((-1,) + self.shape[1:])[r0 - s0 * unit:r1 - s0 * unit]
        rows.flags.writeable = False
        return rows


# Layouts by (input's shape, strides and dtype, grad_out's strides, channel axis); bounded.
_layouts: dict[tuple, _Layout] = {}


def plan(input: np.ndarray, grad_out: Optional[np.ndarray], channel_axis: int, threads: int,
         chunked: bool = False, fusing: bool = False, layout: Optional[_Layout] = None,
         grad_in_output: bool = False) -> Plan:
    """The canonical views of input (and grad_out, input's shape and dtype) for a call on
    ``threads`` threads (resolved: bngrad._threads.resolve_num_threads), copying what must be
    copied (in parallel where that pays). With ``chunked``, where a copy would be larger than
    ``kernels.Config.copy_chunk_bytes`` the plan's x or dy is a :class:`RowCopies` instead,
    copied a chunk at a time by the kernels' passes (callers that take it: those without the
    fused operands; ``fusing``: the call would fuse on a ``fused`` plan, see _takes_chunks).
    With ``grad_in_output`` (a call that writes grad_input), the array that must be copied
    (grad_out, else input: a sliced one) is copied into grad_input's own buffer by
    :meth:`Plan.output` instead, and the kernels compute grad_input in place over it: no
    temporary the size of the array (both copied: input's is made as without). ``layout``:
    the plan's ``layout`` from an earlier call with the same shapes, strides, dtype and
    channel axis (bngrad._calls), which saves looking it up."""
    if layout is None:
        key = (input.shape, input.strides, input.dtype,
               None if grad_out is None else grad_out.strides, channel_axis)
        layout = _layouts.get(key)
        if layout is None:
            if len(_layouts) >= 256:
                _layouts.clear()
            layout = _layouts[key] = _find_layout(input, grad_out, channel_axis)
    copied = layout.copied
    pending: Optional[tuple[str, np.ndarray]] = None
    if grad_in_output and copied:  # grad_out where it is copied, else input
        pending = (("grad_out", grad_out) if grad_out is not None and "grad_out" in copied
                   else ("input", input))
    in_output = pending[0] if pending is not None else None  # copied by Plan.output
    copies = [name for name in copied if name != in_output]  # copied here
    kernel = kernels.plan(_Shape(layout.canonical), threads)
    if copies and chunked and _takes_chunks(input, layout, threads, channel_axis, fusing):
        return _chunked_plan(input, grad_out, layout, kernel, pending)
    x = None
    if in_output != "input":
        x = (kernel_input(_dense_copy(input.transpose(layout.order), threads), layout, False)
             if "input" in copied else kernel_input(input, layout))
    dy = None
    if grad_out is not None and in_output != "grad_out":
        dy = (kernel_input(_in_order(grad_out, layout.order, threads), layout, False)
              if "grad_out" in copied else kernel_input(grad_out, layout))
    return Plan(x, dy, layout, kernel, pending)


def kernel_input(array: np.ndarray, layout: _Layout, in_order: bool = True) -> np.ndarray:
    """The kernels' read-only view of ``array`` (input's shape, dense in ``layout``'s order;
    ``in_order`` False: already in that order, a copy): never the caller's array, so that
    writable and read-only callers share one compiled kernel (Numba compiles a kernel once more
    for each read-only operand)."""
    memory = array.transpose(layout.order) if in_order else array
    view = as_kernel_array(memory).reshape(layout.canonical)
    view.flags.writeable = False
    return view


def _takes_chunks(input: np.ndarray, layout: _Layout, threads: int, channel_axis: int,
                  fusing: bool) -> bool:
    """Whether a copy is made a chunk of rows at a time: where it is larger than the budget
    (Config.copy_chunk_bytes), the first memory axis, which chunks cut, is not the channel
    axis, and the call would not otherwise fuse (``fusing``: a training backward with
    grad_input, on a ``fused`` plan), which reads a whole copy once where chunks make it two
    passes, each copying again ((32, 256, 56, 56) float32 backward, x NCHW, dy NHWC: 47.8 ->
    81.3 ms; docs/internals.md)."""
    if input.nbytes <= kernels.config().copy_chunk_bytes or layout.order[0] == channel_axis:
        return False
    return not (fusing and kernels.plan(_Shape(layout.canonical), threads).path
                in ("fused", "fused_short"))


class _Shape(NamedTuple):
    shape: tuple[int, ...]


def _chunked_plan(input: np.ndarray, grad_out: Optional[np.ndarray], layout: _Layout,
                  kernel: kernels.KernelPlan, pending: Optional[tuple[str, np.ndarray]]) -> Plan:
    """plan()'s result where what must be copied is copied a chunk at a time (but the
    ``pending`` array, copied into grad_input's buffer: Plan.output)."""
    def operand(array: np.ndarray, name: str) -> Optional[kernels.Operand]:
        if pending is not None and pending[0] == name:
            return None
        if name in layout.copied:
            return RowCopies(array, layout.order, layout.canonical, kernel.threads)
        view = as_kernel_array(array.transpose(layout.order)).reshape(layout.canonical)
        view.flags.writeable = False
        return view

    x = operand(input, "input")
    dy = None if grad_out is None else operand(grad_out, "grad_out")
    return Plan(x, dy, layout, kernel, pending)
