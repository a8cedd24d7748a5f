"""Every argument check of the public API, in one place.

Each check raises an ArgumentValueError / ArgumentTypeError that names the argument, what was
expected, what arrived and, where it helps, how to fix it. Validated values are returned in
a normalised form (arrays as np.ndarray, channel_axis non-negative, ...), so that nothing
downstream needs to check again.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np
import numpy.ma  # noqa: F401  (np.ma is imported lazily: not in a call a signal may interrupt)

from . import _dtypes
from ._dtypes import is_half
from ._threads import refuse_nested_call
from .errors import ArgumentTypeError, ArgumentValueError
from .kernels.batchnorm import first_negative

# The dtype facts live in bngrad._dtypes. These constants remain for the modules that import
# them from here (bngrad.dsp).
FLOAT64, FLOAT32, FLOAT16, BFLOAT16 = (_dtypes.spec(name).numpy for name in
                                       ("float64", "float32", "float16", "bfloat16"))
SUPPORTED_DTYPES = _dtypes.NUMPY_DTYPES
_DTYPE_NAMES = _dtypes.NAMES_TEXT

# The checks run on every call, so the common case (an ndarray of a supported dtype, a plain
# int, float or bool) is decided first by exact type and hashed lookups; anything else takes
# the general path, which gives the same answers and all the messages.
_SUPPORTED = frozenset(SUPPORTED_DTYPES)
_SCANNED = frozenset((FLOAT32, FLOAT64))  # running_var's scan is compiled for these
_PARAM_DTYPES = {s.numpy: frozenset(s.param_dtypes) for s in _dtypes.DTYPES}


def _supported(dtype: np.dtype) -> bool:
    return dtype in _SUPPORTED or dtype in SUPPORTED_DTYPES


def describe(value: Any) -> str:
    """A short description of a value for error messages."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def masked_message(name: str) -> str:
    """Why a masked array is refused: its mask would be dropped, not honoured."""
    return (f"{name}: expected a NumPy array, got a masked array, whose mask batch norm would "
            "ignore; pass its .filled(value) or .data to say what the masked elements are")


def data_array(name: str, value: Any) -> np.ndarray:
    """A data array (input, grad_out): any array-like of a supported floating dtype, ndim >= 2."""
    if type(value) is np.ndarray:
        array = value
    else:
        if value is None:
            raise ArgumentTypeError(f"{name}: expected an array, got None")
        if hasattr(value, "__torch_function__"):
            raise ArgumentTypeError(
                f"{name}: expected a NumPy array, got a torch.Tensor; use bngrad.torch for "
                "tensors or pass tensor.numpy()")
        if isinstance(value, np.ma.MaskedArray):
            raise ArgumentTypeError(masked_message(name))
        try:
            array = np.asarray(value)
        except ValueError as exc:  # e.g. ragged nested lists
            raise ArgumentValueError(f"{name}: expected an array, got {describe(value)}, of "
                                     f"which NumPy cannot make one ({exc})") from None
    if not _supported(array.dtype):
        advice = ("; convert it with .astype(np.float32)" if array.dtype.kind in "iub" else
                  _byte_order_advice(array.dtype))
        raise ArgumentTypeError(
            f"{name}: expected a floating array of dtype {_DTYPE_NAMES}, got dtype {array.dtype}"
            + advice)
    if array.ndim < 2:
        raise ArgumentValueError(
            f"{name}: expected at least 2 dimensions (N, C, ...), got shape {array.shape}; "
            "for a single sample add a batch axis with x[None]")
    return array


def data_pair(grad_out: Any, input: Any) -> tuple[np.ndarray, np.ndarray]:
    """(grad_out, input) as data arrays (:func:`data_array`) of one shape and dtype."""
    input_array = data_array("input", input)
    grad_out_array = data_array("grad_out", grad_out)
    same_shape_and_dtype(grad_out_array, input_array, given=(grad_out, input))
    return grad_out_array, input_array


def _byte_order_advice(dtype: np.dtype) -> str:
    """How to convert a byte-swapped floating dtype we support natively; else ""."""
    if dtype.isnative or dtype.kind != "f":
        return ""
    native = dtype.newbyteorder("=")
    return (f"; it is byte-swapped: convert it with .astype({native.name!r})"
            if _supported(native) else "")


def same_shape_and_dtype(grad_out: np.ndarray, input: np.ndarray, name: str = "grad_out",
                         given: Any = (None, None)) -> None:
    """``grad_out`` (or the array called ``name``) has input's shape and dtype. ``given``:
    what the caller passed as each, where known: a list's dtype is NumPy's reading of it,
    which the message then says."""
    if grad_out.shape != input.shape:
        raise ArgumentValueError(
            f"{name}: expected the shape of input {input.shape}, got shape {grad_out.shape}")
    if grad_out.dtype != input.dtype:
        read = [f"NumPy made {input.dtype if who == 'input' else grad_out.dtype} of the "
                f"{type(value).__name__} given as {who}"
                for who, value in zip((name, "input"), given)
                if value is not None and not isinstance(value, np.ndarray)]
        raise ArgumentTypeError(
            f"{name}: expected the dtype of input ({input.dtype}), got dtype {grad_out.dtype}"
            + (f" ({'; '.join(read)}: pass arrays of the dtype you mean)" if read else ""))


def channel_axis(value: Any, ndim: int) -> int:
    if type(value) is int and -ndim <= value < ndim:
        return value % ndim
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"channel_axis: expected an int, got {describe(value)}")
    axis = int(value)
    if not -ndim <= axis < ndim:
        raise ArgumentValueError(
            f"channel_axis: expected an axis in [{-ndim}, {ndim - 1}] for a {ndim}-D input, "
            f"got {axis}")
    return axis % ndim


def param_vector(name: str, value: Any, input: np.ndarray, axis: int) -> Optional[np.ndarray]:
    """A per-channel parameter: None, or a 1-D array of length C = ``input.shape[axis]``.

    Its dtype must be the input's, or float32 (or float64) for a float16/bfloat16 input
    (mixed precision, as in PyTorch).
    """
    if value is None:
        return None
    return _param_array(name, value, input, axis)


def _param_array(name: str, value: Any, input: np.ndarray, axis: int) -> np.ndarray:
    if (type(value) is np.ndarray and value.shape == (input.shape[axis],)
            and value.dtype in _PARAM_DTYPES.get(input.dtype, ())):
        return value  # the allowed dtypes are supported ones: nothing below could refuse it
    if hasattr(value, "__torch_function__"):
        raise ArgumentTypeError(f"{name}: expected a NumPy array, got a torch.Tensor")
    if isinstance(value, np.ma.MaskedArray):
        raise ArgumentTypeError(masked_message(name))
    array = np.asarray(value)
    # what arrived: an array's dtype, or what NumPy made of a list or a number
    got = (f"dtype {array.dtype}" if isinstance(value, np.ndarray) else
           f"a {type(value).__name__} (read as dtype {array.dtype})")
    if not _supported(array.dtype):
        raise ArgumentTypeError(
            f"{name}: expected a floating array of dtype {_DTYPE_NAMES}, got {got}")
    n_channels = input.shape[axis]
    if array.shape != (n_channels,):
        raise ArgumentValueError(
            f"{name}: expected shape ({n_channels},) (one value per channel), got shape "
            f"{array.shape}" + _channel_axis_hint(array.shape, input.shape, axis))
    allowed = _dtypes.spec(input.dtype).param_dtypes
    if array.dtype not in allowed:
        raise ArgumentTypeError(
            f"{name}: expected dtype {' or '.join(str(d) for d in allowed)} for a "
            f"{input.dtype} input, got {got}; convert it with "
            f"np.asarray({name}, np.{'float32' if np.float32 in allowed else 'float64'})")
    return array


def _channel_axis_hint(shape: tuple, input_shape: tuple, axis: int) -> str:
    """Advice when a parameter's length is that of another axis of input: most likely the
    channels are there (e.g. an NHWC array without channel_axis=-1)."""
    if len(shape) != 1:
        return ""
    axes = [i for i, n in enumerate(input_shape) if n == shape[0] and i != axis]
    if not axes:
        return ""
    where = (f"input has {input_shape[axis]} channels on axis {axis} (channel_axis={axis}); "
             f"{shape[0]} is the length of ")
    if len(axes) > 1:
        listed = ", ".join(map(str, axes[:-1])) + f" and {axes[-1]}"
        return f"; {where}axes {listed}: pass the one holding the channels as channel_axis"
    last = " (or -1)" if axes[0] == len(input_shape) - 1 else ""
    return f"; {where}axis {axes[0]}: pass channel_axis={axes[0]}{last}"


def required_param_vector(name: str, value: Any, input: np.ndarray, axis: int) -> np.ndarray:
    """As param_vector, but None is an error."""
    if value is None:
        raise ArgumentValueError(
            f"{name}: expected an array of shape ({input.shape[axis]},), got None")
    return _param_array(name, value, input, axis)


def running_stats_writable(running_mean: Optional[np.ndarray],
                           running_var: Optional[np.ndarray]) -> None:
    """ArgumentValueError unless the running statistics (updated in place in training) can
    each take their channels' values: writable, their elements distinct, not each other's."""
    for name, value in (("running_mean", running_mean), ("running_var", running_var)):
        if value is None:
            continue
        if not value.flags.writeable:
            raise ArgumentValueError(f"{name}: expected a writable array (it is updated in place "
                                     "in train mode), got a read-only array")
        output_overlapping_itself(name, value)
    if (running_mean is not None and running_var is not None
            and np.may_share_memory(running_mean, running_var)
            and np.shares_memory(running_mean, running_var)):
        raise ArgumentValueError(
            "running_mean, running_var: they share memory, so each update (in place, in train "
            "mode) would overwrite the other's; pass two separate arrays")


def running_var(value: Optional[np.ndarray]) -> None:
    """A variance is never negative; a negative entry is the trace of a swapped argument order
    (F.batch_norm's running_var slot holds bngrad's bias), which shapes and dtypes cannot show.

    NaN passes: PyTorch's running_var becomes NaN after a batch of one element per channel.
    """
    if value is None:
        return
    if value.dtype in _SCANNED:
        refuse_nested_call()  # (before the first compiled function a call runs)
        c = first_negative(value)
        if c < 0:
            return
    else:
        with np.errstate(invalid="ignore"):  # NaN in bfloat16 warns when compared
            negative = np.flatnonzero(value < 0)
        if not negative.size:
            return
        c = negative[0]
    raise negative_variance(float(value[c]), int(c))


def negative_variance(value: float, channel: int) -> ArgumentValueError:
    """The error for a running_var whose entry ``channel`` is ``value`` < 0."""
    return ArgumentValueError(
        f"running_var: expected variances >= 0, got {value:g} at channel {channel}. A "
        "variance cannot be negative; the usual cause is a bias in its place: bngrad's NumPy "
        "functions take weight (and bias) before running_mean and running_var, as PyTorch's "
        "native_batch_norm, where torch.nn.functional.batch_norm and bngrad.torch.batch_norm "
        "take them after; check the argument order, or pass them by keyword")


def save_stats(save_mean: Any, save_invstd: Any) -> tuple[Any, Any]:
    """The backward's saved statistics: both or neither.

    Empty (0,) arrays, as an eval-mode forward returns them (here and in PyTorch), mean
    "none". One without the other is a mistake, not a request to recompute both.
    """
    if isinstance(save_mean, np.ndarray) and save_mean.shape == (0,):
        save_mean = None
    if isinstance(save_invstd, np.ndarray) and save_invstd.shape == (0,):
        save_invstd = None
    if (save_mean is None) != (save_invstd is None):
        given, missing = (("save_mean", "save_invstd") if save_invstd is None
                          else ("save_invstd", "save_mean"))
        raise ArgumentValueError(
            f"save_mean, save_invstd: expected both (the forward's batch statistics) or "
            f"neither (computed from input), got {given} without {missing}")
    return save_mean, save_invstd


def running_stats_for_eval(train: bool, running_mean: Optional[np.ndarray],
                           running_var: Optional[np.ndarray]
                           ) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Eval mode normalises with the running statistics: both must be given. Returns them in
    eval mode, None in train mode."""
    if train:
        return None
    if running_mean is None or running_var is None:
        raise ArgumentValueError(
            "running_mean, running_var: expected both in eval mode (train=False), got "
            f"running_mean={'None' if running_mean is None else 'an array'}, "
            f"running_var={'None' if running_var is None else 'an array'}; "
            "pass the running statistics or use train=True")
    return running_mean, running_var


def param_dtype(input_dtype: np.dtype, weight: Optional[np.ndarray],
                stats: Sequence[Optional[np.ndarray]]) -> np.dtype:
    """dtype of grad_weight / grad_bias.

    The weight's dtype when a weight is given; otherwise float32 for a float16/bfloat16 input
    whose statistics are float32 (PyTorch's mixed precision), else the input's dtype.
    """
    if weight is not None:
        return weight.dtype
    spec = _dtypes.spec(input_dtype)
    if spec.is_half:
        for s in stats:
            if s is not None and not is_half(s.dtype):
                return spec.stat
    return input_dtype


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}: expected an int > 0, got {describe(value)}")
    if value <= 0:
        raise ArgumentValueError(f"{name}: expected an int > 0, got {int(value)}")
    return int(value)


def boolean(name: str, value: Any) -> bool:
    if value is True or value is False:
        return value
    if not isinstance(value, (bool, np.bool_)):
        raise ArgumentTypeError(f"{name}: expected True or False, got {describe(value)}")
    return bool(value)


def eps(value: Any) -> float:
    if type(value) is float and 0.0 <= value < math.inf:  # (NaN fails the comparison)
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"eps: expected a float >= 0, got {describe(value)}")
    value = _as_float("eps", "a finite float >= 0", value)
    if math.isnan(value) or value < 0 or math.isinf(value):
        raise ArgumentValueError(f"eps: expected a finite float >= 0, got {value}")
    return value


def _as_float(name: str, expected: str, value: numbers.Real) -> float:
    """float(value), or ArgumentValueError for an int beyond float64 (float() would raise
    OverflowError)."""
    try:
        return float(value)
    except OverflowError:
        raise ArgumentValueError(f"{name}: expected {expected}, got {describe(value)}, too "
                                 "large for a float64") from None


def momentum(value: Any) -> float:
    # (comparisons, not math.isfinite: under torch.compile(dynamic=True) a module's momentum
    # is a symbolic float, which comparisons guard on and math.isfinite breaks the graph for)
    if type(value) is float and -math.inf < value < math.inf:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"momentum: expected a float, got {describe(value)}")
    value = _as_float("momentum", "a finite float", value)
    if not math.isfinite(value):
        raise ArgumentValueError(f"momentum: expected a finite float, got {value}")
    return value


def output_mask(value: Any) -> tuple[bool, bool, bool]:
    if (type(value) is tuple and len(value) == 3 and type(value[0]) is bool
            and type(value[1]) is bool and type(value[2]) is bool):
        return value
    try:
        items = tuple(value)
    except TypeError:
        items = None
    if items is None or len(items) != 3 or not all(isinstance(v, (bool, np.bool_)) for v in items):
        raise ArgumentValueError(
            "output_mask: expected three booleans (grad_input, grad_weight, grad_bias), "
            f"got {describe(value)}")
    return tuple(bool(v) for v in items)  # type: ignore[return-value]


def num_threads(value: Any) -> Optional[int]:
    if value is None:
        return None
    if type(value) is int and value >= 1:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"num_threads: expected None or an int >= 1, got {describe(value)}")
    if value < 1:
        raise ArgumentValueError(f"num_threads: expected None or an int >= 1, got {int(value)}")
    return int(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def count(value: Any) -> float:
    """Elements per channel over all participants, summed.

    A number > 0, or per-rank counts (PyTorch's ``batch_norm_backward_elemt`` takes a tensor
    of them): each >= 0, as an empty rank contributes 0, with a positive total.
    """
    expected = "expected a number > 0 or an array of per-rank counts >= 0 with a positive total"
    try:
        if isinstance(value, (list, tuple)):
            # NumPy would read [19, True] as [19, 1] and ["4"] as [4.0]: look at each item.
            items = np.asarray(value, dtype=object).ravel()
            if not all(_is_number(v) for v in items):
                raise TypeError
            counts = items.astype(np.float64)
        elif _is_number(value) and isinstance(value, numbers.Integral):
            counts = np.asarray(float(value))  # (OverflowError beyond float64)
        else:
            counts = np.asarray(value)
            if counts.dtype.kind not in "iuf":  # bool, str, object, complex: not a count
                raise TypeError
            counts = counts.astype(np.float64)
    except OverflowError:  # an int beyond float64 (a scalar one arrives as an object array)
        raise ArgumentValueError(f"count: {expected}, got {describe(value)}, too large for a "
                                 "float64") from None
    except (TypeError, ValueError):
        raise ArgumentTypeError(f"count: {expected}, got {describe(value)}") from None
    if counts.ndim and (counts < 0).any():
        raise ArgumentValueError(
            f"count: expected per-rank counts >= 0 (0 for an empty rank), got "
            f"{counts[counts < 0][0]:g} in {describe(value)}")
    total = float(np.sum(counts))
    if not total > 0 or math.isinf(total):
        got = describe(value) if type(value) in (int, float) else f"{total:g}"
        raise ArgumentValueError(f"count: expected a positive finite total, got {got}")
    return total


def same_view(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a and b are the very same view of the same memory: the same elements in the same
    order (the stride of an axis of length 1 is never used)."""
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape and a.dtype == b.dtype
            and all(m == n for m, n, size in zip(a.strides, b.strides, a.shape) if size > 1))


def overlaps_itself(a: np.ndarray) -> bool:
    """Whether elements of ``a`` may share memory (a stride of 0, rows that overlap): True
    unless, axes taken by increasing stride, each stride clears all the elements before it.
    Exotic interleaved strides that never collide may be called overlapping too."""
    if a.flags.c_contiguous or a.flags.f_contiguous:  # (the common case, cheaply)
        return False
    extent = a.itemsize
    for stride, size in sorted((abs(s), n) for s, n in zip(a.strides, a.shape) if n > 1):
        if stride < extent:
            return True
        extent += stride * (size - 1)
    return False


def output_overlapping_itself(name: str, value: np.ndarray) -> None:
    """ArgumentValueError for an output whose elements may share memory (overlaps_itself):
    each of them would be left with whichever value was written last."""
    if value.size and overlaps_itself(value):
        raise ArgumentValueError(
            f"{name}: its elements overlap in memory (strides {value.strides} for shape "
            f"{value.shape}), so each would keep whichever value was written last; pass an "
            "array whose elements are distinct, e.g. a fresh one")


def out_array(value: Any, input: np.ndarray, grad_out: Optional[np.ndarray],
              **others: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """The optional ``out`` buffer for grad_input/output: input's shape and dtype, writable.

    It may be the very same array as input or grad_out (the result is computed element by
    element after the reductions, so in-place is safe), or as another operand read element by
    element (``others``, by name: the fused backward's output y and relu_mask), but must not
    partially overlap any of them.
    """
    if value is None:
        return None
    if not isinstance(value, np.ndarray):
        raise ArgumentTypeError(f"out: expected a NumPy array or None, got {describe(value)}")
    if value.shape != input.shape:
        raise ArgumentValueError(
            f"out: expected the shape of input {input.shape}, got shape {value.shape}")
    if value.dtype != input.dtype:
        raise ArgumentTypeError(
            f"out: expected the dtype of input ({input.dtype}), got dtype {value.dtype}")
    if not value.flags.writeable:
        raise ArgumentValueError("out: expected a writable array, got a read-only one")
    output_overlapping_itself("out", value)
    for name, other in (("input", input), ("grad_out", grad_out), *others.items()):
        if other is not None and np.shares_memory(value, other) and not same_view(value, other):
            in_place = (f"pass {name} itself for an in-place result, or "
                        if other.dtype == value.dtype else "pass ")
            raise ArgumentValueError(f"out: overlaps {name} without being the same array; "
                                     f"{in_place}a separate buffer")
    return value
