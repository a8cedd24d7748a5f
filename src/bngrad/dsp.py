"""The DSP math library's BatchNormGrad (seed 004) in Python, on top of bngrad's core API.

Four functions with the C library's calling convention — data buffers ``x, dy, dx``, the
``params`` array and a ``core_mask`` — meant as a golden model for engineers who port or verify
the operator::

    fp_batch_norm_grad_s(x, dy, dx, params, core_mask=0xFF)   # float32, shared storage, multi-core
    hp_batch_norm_grad_s(x, dy, dx, params, core_mask=0xFF)   # float16
    fp_batch_norm_grad_p(x, dy, dx, params)                   # float32, private storage, one core
    hp_batch_norm_grad_p(x, dy, dx, params)                   # float16

``params`` is the C code's ``long long params[12]``, arrays standing where C has pointers::

    [0] mean   [1] invar = 1/sqrt(var + eps)   [2] scale (gamma)
    [3] dbias (output)   [4] dscale (output)   [5] batch   [6] channel   [7] is_train
    [8..11] reserved, ignored

Data is row-major ``[batch][channel]``; per channel c, over the m = batch rows::

    dbias  = sum(dy)                       dscale = sum(dy * xhat),  xhat = (x - mean) * invar
    train: dx = scale * invar / m * (m * dy - sum(dy) - xhat * sum(dy * xhat))
    eval:  dx = dy * invar * scale         (mean, invar are the running statistics)

Where the C library would overflow a buffer or read garbage, these functions raise a
:class:`~bngrad.errors.ArgumentValueError` / :class:`~bngrad.errors.ArgumentTypeError` naming
the argument, before anything is written.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any, Sequence, Union

import numpy as np

from . import api
from ._validate import (FLOAT16, FLOAT32, describe, masked_message, output_overlapping_itself,
                        positive_int, same_view)
from .errors import ArgumentTypeError, ArgumentValueError

__all__ = [
    "CORE_MASK_MAX",
    "BatchNormGradParams",
    "fp_batch_norm_grad_p",
    "fp_batch_norm_grad_s",
    "hp_batch_norm_grad_p",
    "hp_batch_norm_grad_s",
    "threads_for_core_mask",
]

#: Names of params[0..7]; the C array has 12 entries, 8..11 are reserved.
PARAM_SLOTS = ("mean", "invar", "scale", "dbias", "dscale", "batch", "channel", "is_train")
PARAMS_LEN = 12


@dataclass
class BatchNormGradParams:
    """The ``params`` array with names instead of indices.

    >>> p = BatchNormGradParams(mean, invar, scale, dbias, dscale, batch=4, channel=64)
    >>> fp_batch_norm_grad_s(x, dy, dx, p.as_params(), core_mask=0xFF)

    Attributes
    ----------
    mean, invar, scale : ndarray (channel,)
        Forward mean, inverse standard deviation ``1/sqrt(var + eps)`` and gamma. In eval
        mode mean and invar are the running statistics.
    dbias, dscale : ndarray (channel,)
        Output buffers, written in place.
    batch, channel : int
    is_train : bool or int
        True/1 (train) or False/0 (eval); anything else, 0.5 or "no" included, raises an
        :class:`~bngrad.errors.ArgumentValueError` here and in :meth:`as_params`.
    """

    mean: np.ndarray
    invar: np.ndarray
    scale: np.ndarray
    dbias: np.ndarray
    dscale: np.ndarray
    batch: int
    channel: int
    is_train: bool = True

    def __post_init__(self) -> None:
        _is_train(self.is_train, "is_train")

    def as_params(self) -> list:
        """The C layout: a list of 12 entries, the reserved ones 0."""
        # Checked again: the field may have been set since, and int() would turn 0.5 into 0.
        return [self.mean, self.invar, self.scale, self.dbias, self.dscale,
                self.batch, self.channel, int(_is_train(self.is_train, "is_train")), 0, 0, 0, 0]


#: What ``params`` may be: a sequence in the C layout, a 1-D object array, or the dataclass.
Params = Union[Sequence[Any], np.ndarray, BatchNormGradParams]


# --------------------------------------------------------------------------- validation

def _is_train(value: Any, name: str = "params[7] (is_train)") -> bool:
    # Strict 0/1: a shifted params list would otherwise put `channel` here and pass silently,
    # and a float 0.5 would truncate to eval mode.
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise ArgumentValueError(f"{name}: expected 0, 1, True or False, got {describe(value)}")


#: The largest core mask: the C functions take ``int core_mask``.
CORE_MASK_MAX = 0x7FFFFFFF


def threads_for_core_mask(core_mask: Any) -> int:
    """Worker threads for a DSP core mask: its number of set bits, capped at the CPU count.

    Parameters
    ----------
    core_mask : int
        Bit mask of DSP cores, e.g. 0xFF for eight: 1 to 0x7FFFFFFF, the positive values of
        the C API's ``int core_mask`` (the C harness of ``bngrad dsp-kit`` takes the same).

    Returns
    -------
    int
        The number of set bits, at most ``os.cpu_count()``.

    Raises
    ------
    ArgumentTypeError
        ``core_mask`` is not an int (bool, float and str included).
    ArgumentValueError
        ``core_mask`` is 0, negative, or above 0x7FFFFFFF (it would not fit the C ``int``).
    """
    if isinstance(core_mask, (bool, np.bool_)) or not isinstance(core_mask, numbers.Integral):
        raise ArgumentTypeError(
            "core_mask: expected an int bit mask of cores such as 0xFF, got "
            f"{describe(core_mask)}")
    mask = int(core_mask)
    if mask <= 0:
        raise ArgumentValueError(
            f"core_mask: expected a positive bit mask with at least one core set (e.g. 0x1, "
            f"0xFF), got {mask}")
    if mask > CORE_MASK_MAX:
        raise ArgumentValueError(
            f"core_mask: expected a bit mask that fits the C API's int (at most "
            f"{CORE_MASK_MAX:#x}), got {mask:#x}")
    return min(bin(mask).count("1"), os.cpu_count() or 1)


def _buffer(name: str, value: Any, dtypes: tuple[np.dtype, ...], writable: bool) -> np.ndarray:
    """An ndarray of one of ``dtypes`` (writable if asked): what a C pointer argument stands for."""
    if isinstance(value, np.ma.MaskedArray):
        raise ArgumentTypeError(masked_message(name))
    if not isinstance(value, np.ndarray):
        hint = "; pass tensor.numpy()" if hasattr(value, "__torch_function__") else ""
        raise ArgumentTypeError(
            f"{name}: expected a NumPy array of {' or '.join(d.name for d in dtypes)} (the C "
            f"code's pointer), got {describe(value)}{hint}")
    if value.dtype not in dtypes:
        raise ArgumentTypeError(
            f"{name}: expected dtype {' or '.join(d.name for d in dtypes)}, got dtype "
            f"{value.dtype}; convert it with .astype(np.{dtypes[0].name})")
    if writable and not value.flags.writeable:
        raise ArgumentValueError(f"{name}: expected a writable array (an output), got a "
                                 "read-only array")
    return value


def _data_view(name: str, value: Any, batch: int, channel: int, dtype: np.dtype,
               writable: bool = False) -> np.ndarray:
    """The (batch, channel) view of a data buffer: a flat buffer's first batch*channel elements,
    or a (batch, channel) array."""
    array = _buffer(name, value, (dtype,), writable)
    n = batch * channel
    if array.ndim == 1:
        if array.size < n:
            raise ArgumentValueError(
                f"{name}: expected at least batch*channel = {batch}*{channel} = {n} elements, "
                f"got {array.size}; the C library would read or write past its end")
        return array[:n].reshape(batch, channel)  # a view: a 1-D array always splits in place
    if array.ndim == 2:
        if array.shape != (batch, channel):
            raise ArgumentValueError(
                f"{name}: expected shape (batch, channel) = ({batch}, {channel}) or a flat "
                f"buffer, got shape {array.shape}")
        return array
    raise ArgumentValueError(
        f"{name}: expected a flat buffer or a (batch, channel) array, got shape {array.shape}")


def _channel_view(name: str, value: Any, channel: int, dtypes: tuple[np.dtype, ...],
                  writable: bool = False) -> np.ndarray:
    """The first ``channel`` elements of a per-channel buffer."""
    array = _buffer(name, value, dtypes, writable)
    if array.ndim != 1:
        raise ArgumentValueError(
            f"{name}: expected a flat buffer of at least channel = {channel} elements, got "
            f"shape {array.shape}")
    if array.size < channel:
        raise ArgumentValueError(
            f"{name}: expected at least channel = {channel} elements, got {array.size}; the C "
            "library would read or write past its end")
    return array[:channel]


def _check_overlaps(data: dict[str, np.ndarray], channel: dict[str, np.ndarray]) -> None:
    """dx may be exactly x or dy (in place), never partly, nor overlap the statistics;
    dbias/dscale overlap nothing; no output's elements overlap each other."""
    dx = data["dx"]
    for label, output in (("dx", dx), ("params[3] (dbias)", channel["dbias"]),
                          ("params[4] (dscale)", channel["dscale"])):
        output_overlapping_itself(label, output)
    for name in ("x", "dy"):
        if np.shares_memory(dx, data[name]) and not same_view(dx, data[name]):
            raise ArgumentValueError(
                f"dx: overlaps {name} partially, so the C library would read {name} values it "
                f"has already overwritten; pass a separate buffer, or {name} itself for an "
                "in-place result")
    for name in ("mean", "invar", "scale"):
        if np.shares_memory(dx, channel[name]):
            raise ArgumentValueError(
                f"dx: shares memory with {name}, so the C library would read {name} values it "
                "has already overwritten; pass a separate buffer")
    buffers = {**data, **channel}
    for out in ("dbias", "dscale"):
        for name, other in buffers.items():
            if name != out and np.shares_memory(channel[out], other):
                raise ArgumentValueError(
                    f"{out}: shares memory with {name}, so the result would depend on the order "
                    f"in which the C library writes; pass a separate buffer")


# --------------------------------------------------------------------------- computation

def _batch_norm_grad(x: Any, dy: Any, dx: Any, params: Any, half: bool,
                     num_threads: int) -> None:
    """Validate everything, then compute: dx in place, dbias and dscale last."""
    if isinstance(params, BatchNormGradParams):
        params = params.as_params()
    if isinstance(params, np.ndarray) and params.ndim == 1:
        params = list(params)  # e.g. an object array holding the buffers
    if isinstance(params, (str, bytes)) or not isinstance(params, Sequence):
        raise ArgumentTypeError(
            f"params: expected a sequence like the C code's long long params[12] (or "
            f"BatchNormGradParams), got {describe(params)}")
    if len(params) < len(PARAM_SLOTS):
        raise ArgumentValueError(
            f"params: expected at least {len(PARAM_SLOTS)} entries ({', '.join(PARAM_SLOTS)}), "
            f"got {len(params)}")
    batch = positive_int("params[5] (batch)", params[5])
    channel = positive_int("params[6] (channel)", params[6])
    train = _is_train(params[7])

    data_dtype = FLOAT16 if half else FLOAT32
    param_dtypes = (FLOAT16, FLOAT32) if half else (FLOAT32,)
    data = {"x": _data_view("x", x, batch, channel, data_dtype),
            "dy": _data_view("dy", dy, batch, channel, data_dtype),
            "dx": _data_view("dx", dx, batch, channel, data_dtype, writable=True)}
    per_channel = {name: _channel_view(f"params[{i}] ({name})", params[i], channel,
                                       param_dtypes, writable=i in (3, 4))
                   for i, name in enumerate(PARAM_SLOTS[:5])}
    _check_overlaps(data, per_channel)

    # Widening is exact, so the core sees the caller's values. With float16 data the core takes
    # float64 parameters and returns float64 sums, which are then rounded once into each output
    # buffer's own dtype (float32 sums would be rounded twice into a float16 buffer).
    wide = np.float64 if half else FLOAT32
    mean, invar, scale = (per_channel[n].astype(wide) for n in ("mean", "invar", "scale"))
    # results beyond a float16 buffer's range are inf there, and 0 x inf NaN, as the C
    # version's arithmetic gives them, without NumPy's warnings (raised under -W error)
    with np.errstate(over="ignore", invalid="ignore"):
        dscale, dbias = _compute(data["x"], data["dy"], data["dx"], mean, invar, scale, train,
                                 num_threads)
        np.copyto(per_channel["dbias"], dbias, casting="same_kind")
        np.copyto(per_channel["dscale"], dscale, casting="same_kind")


def _compute(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, mean: np.ndarray,
             invar: np.ndarray, scale: np.ndarray, train: bool, num_threads: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Write dx; return (dscale, dbias). Validated (batch, channel) data; per-channel arrays
    float32 (fp_) or float64 (hp_).

    dx may be x or dy itself: both paths take the sums before they write dx.
    """
    if train:
        # Train mode is PyTorch's backward with the forward's saved statistics, run in float64
        # (widening is exact) so that dx, like dbias and dscale, is a float64 result rounded
        # once into its buffer: a golden model should land on the correctly rounded value. The
        # fast float32 arithmetic was 1 ULP or more off on 42% of float32 elements (up to
        # thousands of ULP where dx nearly cancels); this costs two float64 copies of the data.
        wide = {name: a.astype(np.float64) for name, a in
                (("x", x), ("dy", dy), ("mean", mean), ("invar", invar), ("scale", scale))}
        grad_input, dscale, dbias = api.batch_norm_backward(
            wide["dy"], wide["x"], weight=wide["scale"], save_mean=wide["mean"],
            save_invstd=wide["invar"], train=True, num_threads=num_threads, out=wide["dy"])
        # the default output_mask asks for all three
        assert grad_input is not None and dscale is not None and dbias is not None
        np.copyto(dx, grad_input, casting="same_kind")
        return dscale, dbias
    # Eval: the core's eval mode takes running_var and derives invstd = 1/sqrt(var + eps); the
    # DSP passes invar itself, which no running_var reproduces exactly. So the sums come from
    # the core's reduce step, and dx = dy * invar * scale is one float64 product (exact for the
    # per-channel factor) rounded once into dx. The core sums float16 data's terms in float32
    # blocks (its accuracy policy), so float16 data is widened for the sums, as in train mode.
    sx, sdy = (x, dy) if x.dtype != np.float16 else (x.astype(np.float64), dy.astype(np.float64))
    _, _, dscale, dbias = api.batch_norm_backward_reduce(
        sdy, sx, mean, invar, weight=scale, input_g=False, weight_g=True, bias_g=True,
        num_threads=num_threads)
    assert dscale is not None and dbias is not None  # weight_g and bias_g
    factor = invar.astype(np.float64) * scale.astype(np.float64)
    np.multiply(dy, factor, out=dx, dtype=np.float64, casting="same_kind")
    return dscale, dbias


# --------------------------------------------------------------------------- public API

def fp_batch_norm_grad_s(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, params: Params,
                         core_mask: int = 0xFF) -> None:
    """BatchNormGrad, float32, shared storage: on one thread per core set in ``core_mask``.

    Parameters
    ----------
    x, dy : ndarray, float32
        Forward input and upstream gradient, row-major [batch][channel]: flat buffers of at
        least batch*channel elements (only those are used) or (batch, channel) arrays.
    dx : ndarray, float32, writable
        Output, same form as x. May be ``dy`` (or ``x``) itself; may not overlap them partly.
    params : sequence, 1-D object array or BatchNormGradParams
        ``[mean, invar, scale, dbias, dscale, batch, channel, is_train, ...]``: float32
        buffers of at least ``channel`` elements (dbias and dscale writable, and written),
        two ints > 0 and 0/1. Entries 8..11 are ignored.
    core_mask : int
        Bit mask of cores (0xFF = 8), 1 to ``CORE_MASK_MAX`` (0x7FFFFFFF, the C ``int``'s
        positive range); its set bits, capped at the CPU count, are the thread count. Results
        are bitwise identical for every mask.

    Returns
    -------
    None
        Results are written into dx, dbias and dscale, as in C.
    """
    _batch_norm_grad(x, dy, dx, params, half=False, num_threads=threads_for_core_mask(core_mask))


def hp_batch_norm_grad_s(x: np.ndarray, dy: np.ndarray, dx: np.ndarray, params: Params,
                         core_mask: int = 0xFF) -> None:
    """BatchNormGrad, float16, shared storage (multi-core).

    As :func:`fp_batch_norm_grad_s`, with float16 x, dy, dx; mean, invar, scale, dbias and
    dscale may each be float16 or float32, and outputs are written in their buffer's dtype.
    Every output is computed in float64 and rounded once into its buffer.
    """
    _batch_norm_grad(x, dy, dx, params, half=True, num_threads=threads_for_core_mask(core_mask))


def fp_batch_norm_grad_p(x: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                         params: Params) -> None:
    """BatchNormGrad, float32, private storage: one core.

    Arguments as :func:`fp_batch_norm_grad_s`, without ``core_mask``.
    """
    _batch_norm_grad(x, dy, dx, params, half=False, num_threads=1)


def hp_batch_norm_grad_p(x: np.ndarray, dy: np.ndarray, dx: np.ndarray,
                         params: Params) -> None:
    """BatchNormGrad, float16, private storage: one core.

    Arguments as :func:`hp_batch_norm_grad_s`, without ``core_mask``.
    """
    _batch_norm_grad(x, dy, dx, params, half=True, num_threads=1)
