"""Repeat calls: what bngrad.api's checks and layout concluded for a call signature, remembered.

Most of a small call's time is Python: checking every argument and planning the layout (issue
12, the fixed cost of a call). What those checks conclude depends on the arrays only through
their types, shapes, strides and dtypes, and on the flags (train, output_mask, channel_axis):
the call's *signature*. A training loop repeats a handful of signatures. So bngrad.api looks
the signature up first and, where an earlier call of that signature passed every check, takes
what that call concluded (:class:`Known`); only the checks of *values* run again on every
call: eps, momentum, num_threads, running_var's sign, writable running statistics, ``out``
(any array) and the saved statistics' pairing.

Only plain calls have a signature: every array an ``np.ndarray`` (not a subclass, not a list),
train a bool, channel_axis an int, output_mask a tuple of three bools (the exact types, so that
``True`` and ``1``, equal as keys, never stand for each other). Anything else returns None and
takes every check, with all the messages.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np

from ._dtypes import DTypeSpec
from ._layout import _Layout

__all__ = ["Known", "backward_signature", "find", "forward_signature", "remember"]


class Known(NamedTuple):
    """What the checks and the layout concluded for a signature (bngrad.api)."""

    axis: int                      # the channel axis, non-negative
    elements: int                  # elements per channel
    spec: DTypeSpec                # input's dtype facts
    param_dtype: Optional[np.dtype]  # the backward's grad_weight / grad_bias dtype
    layout: _Layout                # bngrad._layout's plan.layout


_known: dict[tuple, Known] = {}


def find(signature: Optional[tuple]) -> Optional[Known]:
    """What an earlier call of ``signature`` (None: no signature) concluded, if remembered."""
    return None if signature is None else _known.get(signature)


def remember(signature: Optional[tuple], known: Known) -> None:
    """Remember what a call of ``signature`` concluded, once it passed every check."""
    if signature is None:
        return
    if len(_known) >= 256:  # bounded: a program that keeps changing shapes starts over
        _known.clear()
    _known[signature] = known


def _vectors(*values: Any) -> Optional[tuple]:
    """The per-channel arrays' part of a signature: None or (shape, dtype) each, or None where
    one is neither None nor an ndarray."""
    part: list[Optional[tuple]] = []
    for value in values:
        if value is None:
            part.append(None)
        elif type(value) is np.ndarray:
            part.append((value.shape, value.dtype))
        else:
            return None
    return tuple(part)


def forward_signature(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any,
                      train: Any, channel_axis: Any) -> Optional[tuple]:
    """batch_norm_forward's signature, or None for a call that is not plain."""
    if (type(input) is not np.ndarray or type(channel_axis) is not int
            or (train is not True and train is not False)):
        return None
    vectors = _vectors(weight, bias, running_mean, running_var)
    if vectors is None:
        return None
    return ("forward", input.shape, input.strides, input.dtype, channel_axis, train, vectors)


def backward_signature(grad_out: Any, input: Any, weight: Any, running_mean: Any,
                       running_var: Any, save_mean: Any, save_invstd: Any, train: Any,
                       output_mask: Any, channel_axis: Any) -> Optional[tuple]:
    """batch_norm_backward's signature, or None for a call that is not plain."""
    if (type(input) is not np.ndarray or type(grad_out) is not np.ndarray
            or type(channel_axis) is not int or (train is not True and train is not False)
            or type(output_mask) is not tuple or len(output_mask) != 3
            or not all(m is True or m is False for m in output_mask)):
        return None
    vectors = _vectors(weight, running_mean, running_var, save_mean, save_invstd)
    if vectors is None:
        return None
    return ("backward", grad_out.shape, grad_out.strides, grad_out.dtype, input.shape,
            input.strides, input.dtype, channel_axis, train, output_mask, vectors)
