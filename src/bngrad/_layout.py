"""Any strides -> one of two canonical dense views, or one copy.

An array that is dense in *some* axis order is transposed (a view) into that memory order,
where it is C-contiguous. With the channel axis at position k of that order, the view reshapes
(still a view) to channels-first ``(A, C, B)`` — A the product of the axes before k, B of those
after — or, when B == 1, to channels-last ``(A, C)``. NCHW gives (N, C, H*W); NHWC strides give
(N*H*W, C); 2-D (N, C) gives (N, C); any other dense permutation works the same way.

grad_out is read in input's memory order; if it is not dense in that order it is copied once.
An input that is not dense in any order (sliced, padded, negative strides) is copied once into
C order. grad_input is allocated in the order that was used: input's own order whenever input
is dense, C order otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import kernels
from .kernels import as_kernel_array


def _memory_order(array: np.ndarray) -> Optional[tuple[int, ...]]:
    """Axis order in which ``array`` is C-contiguous, or None if there is none."""
    order = tuple(sorted(range(array.ndim), key=lambda axis: -array.strides[axis]))
    if array.transpose(order).flags.c_contiguous and min(array.strides, default=0) >= 0:
        return order
    return None


@dataclass(frozen=True)
class Plan:
    """Canonical kernel views of input (and grad_out) and how to make outputs like them."""

    x: np.ndarray                  # (A, C, B) or (M, C), kernel element type
    dy: Optional[np.ndarray]       # same shape as x, or None
    order: tuple[int, ...]         # memory order of the logical axes used for x, dy and outputs
    channel_axis: int
    copied: tuple[str, ...]        # arguments that had to be copied (for the curious)

    @property
    def channels_last(self) -> bool:
        return self.x.ndim == 2

    def empty_output(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """(kernel view, user array) of a new array shaped like input, in the plan's order."""
        memory = np.empty(tuple(shape[axis] for axis in self.order), dtype=dtype)
        user = memory.transpose(np.argsort(self.order))
        return as_kernel_array(memory).reshape(self.x.shape), user

    def output(self, shape: tuple[int, ...], dtype: np.dtype, out: Optional[np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray]:
        """(kernel view, array the kernel's result ends up in) for an optional ``out``.

        ``out`` is written directly when it is dense in the plan's order; otherwise the kernel
        writes a new array and ``finish_output`` copies it into ``out``.
        """
        if out is not None:
            memory = out.transpose(self.order)
            if memory.flags.c_contiguous:
                return as_kernel_array(memory).reshape(self.x.shape), out
        return self.empty_output(shape, dtype)


def finish_output(result: np.ndarray, out: Optional[np.ndarray]) -> np.ndarray:
    """``result`` itself, or ``out`` after copying ``result`` into it."""
    if out is None or result is out:
        return result
    np.copyto(out, result)
    return out


def _canonical(memory_ordered: np.ndarray, channel_position: int) -> np.ndarray:
    shape = memory_ordered.shape
    A = math.prod(shape[:channel_position])
    B = math.prod(shape[channel_position + 1:])
    C = shape[channel_position]
    canonical = (A, C) if B == 1 else (A, C, B)
    return as_kernel_array(memory_ordered).reshape(canonical)


def _merged(shape: tuple[int, ...], strides: tuple[int, ...]) -> Optional[tuple[int, int]]:
    """(size, stride) of the axes viewed as one, or None if their strides do not allow it."""
    axes = [(n, s) for n, s in zip(shape, strides) if n != 1]
    for (_, outer), (n, inner) in zip(axes, axes[1:]):
        if outer != inner * n:
            return None
    return math.prod(shape), (axes[-1][1] if axes else 0)


def _copied(memory_ordered: np.ndarray, channel_position: int) -> np.ndarray:
    """A C-contiguous canonical copy of a non-contiguous array.

    grad_out in channels-last order when input is channels-first (or the reverse) is a
    transposed (A, B, C) array: that copy runs as a parallel tiled transpose. Anything else
    (slices, odd strides) is copied by NumPy.
    """
    p = channel_position
    shape, strides = memory_ordered.shape, memory_ordered.strides
    before, after = _merged(shape[:p], strides[:p]), _merged(shape[p + 1:], strides[p + 1:])
    if before is not None and after is not None:
        A, C, B = before[0], shape[p], after[0]
        transposed = np.lib.stride_tricks.as_strided(
            memory_ordered, (A, B, C), (before[1], after[1], strides[p]), writeable=False)
        if transposed.flags.c_contiguous:
            copy = np.empty((A, C, B), dtype=memory_ordered.dtype)
            kernels.transpose_last_two(as_kernel_array(transposed), as_kernel_array(copy))
            return _canonical(copy, 1)
    return _canonical(np.ascontiguousarray(memory_ordered), p)


def plan(input: np.ndarray, grad_out: Optional[np.ndarray], channel_axis: int) -> Plan:
    copied = []
    order = _memory_order(input)
    if order is None:
        copied.append("input")
        order = tuple(range(input.ndim))
    position = order.index(channel_axis)
    x = input.transpose(order)
    x = _canonical(x, position) if x.flags.c_contiguous else _copied(x, position)
    dy = None
    if grad_out is not None:
        dy = grad_out.transpose(order)
        if dy.flags.c_contiguous:
            dy = _canonical(dy, position)
        else:
            copied.append("grad_out")
            dy = _copied(dy, position)
    return Plan(x=x, dy=dy, order=order, channel_axis=channel_axis, copied=tuple(copied))
