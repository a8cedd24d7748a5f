"""Batch norm fused with a residual add and a ReLU: the NumPy API.

Per channel, as :func:`bngrad.batch_norm_forward` / :func:`bngrad.batch_norm_backward`::

    forward:   y = act(weight * (x - mean) * invstd + bias + side_input),  act = ReLU or none
    backward:  g = 0 where y <= 0 (ReLU), else grad_out    (PyTorch's threshold_backward)
               grad_input, grad_weight, grad_bias = batch norm's backward of g
               grad_side_input = g

This is cuDNN's ``BN_ADD_ACTIVATION``, TF's ``FusedBatchNormEx`` (``side_input``,
``activation_mode="Relu"``) and oneDNN's ``fuse_norm_add_relu``. The add rounds as PyTorch's
separate ops do: batch norm's value is rounded to the data type, then ``side_input`` added and
the sum rounded (for float16/bfloat16 two roundings, as ``bn(x) + z`` in PyTorch; float32 and
float64 round once either way), so the fused output and ReLU equal PyTorch's unfused sequence
wherever its batch norm gives the same value. The backward needs either the forward's output
``y`` or its ReLU mask, which the forward returns in one of two formats, both in **input's
memory order** (:func:`mask_order`: the axes by decreasing stride where input is dense in some
axis order, as NCHW, channels-last or any permutation, else C order):

- ``"bits"``: one bit per element, as oneDNN's workspace: a 1-D uint8 array of
  ``ceil(input.size / 8)`` bytes, ``np.packbits(passes.transpose(order), axis=None,
  bitorder="little")`` with ``order = mask_order(input)``: element ``i`` of input's memory
  order is bit ``i % 8`` (least significant first) of byte ``i // 8``, so the bits are packed
  along the innermost dimension in memory (channels for NHWC, W for NCHW); the padding bits of
  the last byte are 0. The backward decodes it in the memory order of *its* input: give it
  input laid out as the forward's (the same array, as autograd keeps it);
  :func:`unpack_mask` decodes it;
- ``"bytes"``: ``passes`` itself, a bool array of input's shape laid out in input's memory
  order (as the output).

``passes`` is ``not (y <= 0)``: True where y is positive or NaN (ReLU passes NaN on, and
threshold_backward lets the gradient through where y is NaN), False where y <= 0, exact ties
at 0 included.

**Fused in the kernels** (kernels._ops, docs/internals.md): the forward writes y and the mask
(bytes, or bits packed there) in batch norm's normalize pass, adding the side input on the
way; the backward's passes (reduction and grad_input, or the one fused pass) read ``g`` from
grad_out and the ReLU's record (y, the mask bytes, or the mask bits, each item unpacking the
bits of the range it reads into a small scratch buffer), and the grad_input pass also writes
grad_side_input. Not in the kernels: grad_side_input without grad_input takes a pass of its
own.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from . import _validate as check
from ._layout import _memory_order
from .api import _backward, _forward
from .errors import ArgumentTypeError, ArgumentValueError

__all__ = ["ACTIVATIONS", "MASK_FORMATS", "batch_norm_relu_backward", "batch_norm_relu_forward",
           "mask_bytes", "mask_order", "unpack_mask"]

Array = np.ndarray

#: Values of ``activation``.
ACTIVATIONS = ("relu", "none")
#: Values of ``mask_format`` (None: no mask, the backward is then given the output).
MASK_FORMATS = ("bits", "bytes", None)


def mask_bytes(n_elements: int, mask_format: Optional[str] = "bits") -> int:
    """Bytes of the ReLU mask for ``n_elements`` elements: ``ceil(n / 8)`` as bits, ``n`` as
    bytes, 0 without a mask (``mask_format`` None)."""
    if isinstance(n_elements, (bool, np.bool_)) or not isinstance(n_elements, numbers.Integral):
        raise ArgumentTypeError(
            f"n_elements: expected an int >= 0, got {check.describe(n_elements)}")
    if n_elements < 0:
        raise ArgumentValueError(f"n_elements: expected an int >= 0, got {int(n_elements)}")
    n = int(n_elements)
    mask_format = _mask_format(mask_format)
    if mask_format == "bits":
        return (n + 7) // 8
    return n if mask_format == "bytes" else 0


# --- argument checks of the fused functions (the rest is checked by the batch-norm API) ------

def _activation(value: Any) -> str:
    if not isinstance(value, str) or value not in ACTIVATIONS:
        raise ArgumentValueError(
            f"activation: expected 'relu' or 'none', got {check.describe(value)}")
    return value


def _mask_format(value: Any) -> Optional[str]:
    if value is not None and (not isinstance(value, str) or value not in MASK_FORMATS):
        raise ArgumentValueError(
            f"mask_format: expected 'bits', 'bytes' or None, got {check.describe(value)}")
    return value


def _like_input(name: str, value: Any, input: Array, given_input: Any) -> Array:
    """side_input or output: an array of input's shape and dtype, any layout (``given_input``:
    what the caller passed as input, for the dtype message)."""
    array = check.data_array(name, value)
    check.same_shape_and_dtype(array, input, name, given=(value, given_input))
    return array


def _output_mask(value: Any) -> Tuple[bool, bool, bool, bool]:
    try:
        items = tuple(value)
    except TypeError:
        items = None
    if items is None or len(items) != 4 or not all(isinstance(v, (bool, np.bool_))
                                                   for v in items):
        raise ArgumentValueError(
            "output_mask: expected four booleans (grad_input, grad_weight, grad_bias, "
            f"grad_side_input), got {check.describe(value)}")
    return tuple(bool(v) for v in items)  # type: ignore[return-value]


def _relu_mask(value: Any, input: Array) -> Array:
    """A ReLU mask in either format; returned as given, but a strided "bits" mask, which the
    kernels read as one flat buffer, as a contiguous copy (a 32nd of float32 input's bytes)."""
    if isinstance(value, np.ma.MaskedArray):
        raise ArgumentTypeError(check.masked_message("relu_mask"))
    if not isinstance(value, np.ndarray):
        raise ArgumentTypeError(
            f"relu_mask: expected a NumPy array (the forward's relu_mask), got "
            f"{check.describe(value)}")
    n_bytes = mask_bytes(input.size, "bits")
    if value.dtype == np.bool_:
        if value.shape != input.shape:
            raise ArgumentValueError(
                f"relu_mask: a bool mask ('bytes' format) must have input's shape "
                f"{input.shape}, got shape {value.shape}")
    elif value.dtype == np.uint8:
        if value.shape != (n_bytes,):
            raise ArgumentValueError(
                f"relu_mask: a uint8 mask ('bits' format) must have shape ({n_bytes},) "
                f"(one bit per element of input's {input.size}, rounded up to bytes), got "
                f"shape {value.shape}")
        return np.ascontiguousarray(value)
    else:
        raise ArgumentTypeError(
            f"relu_mask: expected uint8 ('bits' format) or bool ('bytes' format), got dtype "
            f"{value.dtype}")
    return value


def mask_order(input: Any) -> Tuple[int, ...]:
    """The axis order in which a ReLU mask of ``input`` lists its elements.

    Parameters
    ----------
    input : ndarray
        The batch-norm input (any layout).

    Returns
    -------
    tuple of int
        Input's memory order (the axes by decreasing stride) where input is dense in some axis
        order, else C order ``(0, 1, ..., ndim - 1)``. Element ``i`` of
        ``passes.transpose(order).ravel()`` is bit ``i % 8`` of byte ``i // 8`` of a "bits"
        mask.
    """
    input = check.data_array("input", input)
    return _mask_order(input)


def unpack_mask(relu_mask: Any, input: Any) -> Array:
    """The bool array a ReLU mask of ``input`` encodes (True: the gradient passes).

    Parameters
    ----------
    relu_mask : ndarray
        A mask from :func:`batch_norm_relu_forward`, "bits" (uint8) or "bytes" (bool) format.
    input : ndarray
        The forward's input, or an array of its shape laid out as it (the mask is read in its
        memory order).

    Returns
    -------
    ndarray of bool, input's shape
        For "bits", a view of the unpacked bits laid out in input's memory order (no
        transpose); a "bytes" mask itself.
    """
    input = check.data_array("input", input)
    return _unpack(_relu_mask(relu_mask, input), input)


def _mask_order(input: Array) -> Tuple[int, ...]:
    return _memory_order(input) or tuple(range(input.ndim))


def _unpack(relu_mask: Array, input: Array) -> Array:
    if relu_mask.dtype == np.bool_:
        return relu_mask
    order = _mask_order(input)
    flat = np.unpackbits(relu_mask, count=input.size, bitorder="little").view(np.bool_)
    return flat.reshape([input.shape[axis] for axis in order]).transpose(np.argsort(order))


# --- the public functions ---------------------------------------------------------------------

def batch_norm_relu_forward(input: Any, weight: Any = None, bias: Any = None,
                            running_mean: Any = None, running_var: Any = None,
                            train: bool = True, momentum: float = 0.1, eps: float = 1e-5, *,
                            side_input: Any = None, activation: str = "relu",
                            mask_format: Optional[str] = "bits", channel_axis: int = 1,
                            num_threads: Optional[int] = None, out: Optional[Array] = None
                            ) -> Tuple[Array, Array, Array, Optional[Array]]:
    """Batch norm, plus an optional side input, then a ReLU: ``y = act(bn(x) + side_input)``.

    Arguments, statistics and running-statistics updates are those of
    :func:`bngrad.batch_norm_forward` (``native_batch_norm``'s order: weight and bias before
    the running statistics). The add, the ReLU and the mask are made in batch norm's
    normalize pass; see :mod:`bngrad.fused` for the rounding of the add and the mask formats.

    Parameters
    ----------
    input, weight, bias, running_mean, running_var, train, momentum, eps
        As :func:`bngrad.batch_norm_forward`.
    side_input : ndarray, optional
        Added before the activation (the residual branch): input's shape and dtype, any
        layout. None: no add.
    activation : {"relu", "none"}
    mask_format : {"bits", "bytes", None}
        Format of the returned ReLU mask (see :mod:`bngrad.fused`): one bit or one byte per
        element, in input's memory order; None returns no mask (the backward then needs the
        output).
    channel_axis, num_threads
        As :func:`bngrad.batch_norm_forward`.
    out : ndarray, optional
        Buffer for the output (input's shape and dtype); it may be input itself, but must not
        overlap side_input.

    Returns
    -------
    output : ndarray
        ``out`` if given; else input's shape and dtype, in input's axis order when input is
        dense in some order.
    save_mean, save_invstd : ndarray (C,)
        As :func:`bngrad.batch_norm_forward` (empty in eval mode).
    relu_mask : ndarray or None
        uint8 ``(ceil(input.size / 8),)`` for "bits", bool of input's shape for "bytes" (laid
        out as input), both in input's memory order; None for ``mask_format=None`` or
        ``activation="none"``.
    """
    given_input, input = input, check.data_array("input", input)
    activation = _activation(activation)
    mask_format = _mask_format(mask_format)
    if side_input is not None:
        side_input = _like_input("side_input", side_input, input, given_input)
        if out is not None and isinstance(out, np.ndarray) and np.shares_memory(out, side_input):
            # (input itself is the other in-place choice, unless side_input shares it too)
            alternative = ("" if np.shares_memory(input, side_input)
                           else " (or input itself)")
            raise ArgumentValueError(
                f"out: overlaps side_input; pass a separate buffer{alternative}")
    return _fused_forward_impl(input, weight, bias, running_mean, running_var, train, momentum,
                               eps, side_input, activation, mask_format, channel_axis,
                               num_threads, out)


def batch_norm_relu_backward(grad_out: Any, input: Any, weight: Any = None,
                             running_mean: Any = None, running_var: Any = None,
                             save_mean: Any = None, save_invstd: Any = None, train: bool = True,
                             eps: float = 1e-5,
                             output_mask: Sequence[bool] = (True, True, True, True), *,
                             output: Any = None, relu_mask: Any = None,
                             activation: str = "relu", channel_axis: int = 1,
                             num_threads: Optional[int] = None, out: Optional[Array] = None
                             ) -> Tuple[Optional[Array], Optional[Array], Optional[Array],
                                        Optional[Array]]:
    """Gradients of :func:`batch_norm_relu_forward`: batch norm's backward of the masked
    gradient, and the side input's gradient.

    Arguments are those of :func:`bngrad.batch_norm_backward` (``native_batch_norm_backward``'s
    order), with a fourth output in ``output_mask`` and the ReLU given by ``output`` or
    ``relu_mask``. The mask is applied, and grad_side_input written, inside batch norm's
    backward passes (a "bits" mask is read there too, see :mod:`bngrad.fused`).

    Parameters
    ----------
    grad_out, input, weight, running_mean, running_var, save_mean, save_invstd, train, eps
        As :func:`bngrad.batch_norm_backward`; ``grad_out`` is the gradient of the fused
        output y.
    output_mask : four bools
        Which of (grad_input, grad_weight, grad_bias, grad_side_input) to compute.
    output : ndarray, optional
        The forward's output y (input's shape and dtype, any layout): the gradient passes
        where ``not y <= 0``.
    relu_mask : ndarray, optional
        The forward's mask, "bits" (uint8) or "bytes" (bool) format. With
        ``activation="relu"`` give exactly one of output and relu_mask; with "none", neither.
        A "bits" mask is read in this input's memory order: pass input laid out as the
        forward's.
    activation : {"relu", "none"}
    channel_axis, num_threads
        As :func:`bngrad.batch_norm_backward`.
    out : ndarray, optional
        Buffer for grad_input, as in :func:`bngrad.batch_norm_backward` (it may be grad_out).

    Returns
    -------
    grad_input, grad_weight, grad_bias : ndarray or None
        As :func:`bngrad.batch_norm_backward`, of the masked gradient g.
    grad_side_input : ndarray or None
        g: input's shape and dtype, in input's axis order when input is dense in some order.
    """
    given_input = input
    grad_out, input = check.data_pair(grad_out, input)
    mask = _output_mask(output_mask)
    activation = _activation(activation)
    if activation == "none":
        if output is not None or relu_mask is not None:
            raise ArgumentValueError(
                "output, relu_mask: expected neither with activation='none' (there is no ReLU "
                "to undo), got " + ("output" if output is not None else "relu_mask"))
    elif (output is None) == (relu_mask is None):
        raise ArgumentValueError(
            "output, relu_mask: expected exactly one of them with activation='relu' (the "
            "forward's output y, or its relu_mask), got "
            + ("both" if output is not None else "neither"))
    elif output is not None:
        output = _like_input("output", output, input, given_input)
    else:
        relu_mask = _relu_mask(relu_mask, input)
    check.out_array(out, input, grad_out, output=output, relu_mask=relu_mask)
    return _fused_backward_impl(grad_out, input, weight, running_mean, running_var, save_mean,
                                save_invstd, train, eps, mask, output, relu_mask, channel_axis,
                                num_threads, out)


# --- the seam: the fused kernel variants (bngrad.api._forward / _backward) ---------------------

def _fused_forward_impl(input: Array, weight: Any, bias: Any, running_mean: Any,
                        running_var: Any, train: Any, momentum: Any, eps: Any,
                        side_input: Optional[Array], activation: str,
                        mask_format: Optional[str], channel_axis: Any, num_threads: Any,
                        out: Optional[Array]) -> Tuple[Array, Array, Array, Optional[Array]]:
    """The fused forward, on arguments checked above (the batch-norm ones are checked by
    bngrad.api): the kernels add side_input, apply the ReLU and write the mask (bytes, or
    bits packed there) in batch norm's normalize pass. Without a mask the ReLU still takes one
    (as bits, the cheapest), which is dropped."""
    relu = None if activation == "none" else (mask_format or "bits")
    output, save_mean, save_invstd, mask = _forward(
        input, weight, bias, running_mean, running_var, train, momentum, eps, channel_axis,
        num_threads, out, side_input=side_input, relu=relu)
    if mask_format is None or mask is None:
        return output, save_mean, save_invstd, None
    return output, save_mean, save_invstd, mask if mask_format == "bits" else mask.view(np.bool_)


def _fused_backward_impl(grad_out: Array, input: Array, weight: Any, running_mean: Any,
                         running_var: Any, save_mean: Any, save_invstd: Any, train: Any,
                         eps: Any, output_mask: Tuple[bool, bool, bool, bool],
                         output: Optional[Array], relu_mask: Optional[Array], channel_axis: Any,
                         num_threads: Any, out: Optional[Array]
                         ) -> Tuple[Optional[Array], Optional[Array], Optional[Array],
                                    Optional[Array]]:
    """The fused backward, on arguments checked above (the batch-norm ones are checked by
    bngrad.api): the kernels mask grad_out by y, the mask bytes or the mask bits (in input's
    memory order, which is the kernels' canonical order) and write grad_side_input beside
    grad_input."""
    bits = relu_mask if relu_mask is not None and relu_mask.dtype == np.uint8 else None
    relu = output if relu_mask is None else None if bits is not None else relu_mask
    return _backward(grad_out, input, weight, running_mean, running_var, save_mean,
                     save_invstd, train, eps, output_mask[:3], channel_axis, num_threads, out,
                     relu=relu, relu_bits=bits, grad_side=output_mask[3])
