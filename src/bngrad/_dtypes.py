"""The dtypes bngrad computes in, and every fact about them, in one table.

Each supported dtype is one :class:`DTypeSpec` in :data:`DTYPES`; validation, the kernels, the
torch layer, SyncBatchNorm, the benchmark, ``bngrad precompile`` and the tests all read it
instead of keeping their own lists. Adding a dtype starts here.

This module imports nothing from bngrad (only NumPy and ml_dtypes), so the kernels can read it
without importing the validation layer above them.

Precisions, per dtype (PyTorch's CPU rules; compare ``torch._prims_common``'s
``get_computation_dtype`` and ``get_acc_type``):

============  ============  =========  ============  ============  ========================
dtype         kernel view   compute    accumulation  statistics    per-channel parameters
============  ============  =========  ============  ============  ========================
float64       float64       float64    float64       float64       float64
float32       float32       float32    float64       float32       float32
float16       int16 bits    float32    float64       float32       float16, float32, float64
bfloat16      uint16 bits   float32    float64       float32       bfloat16, float32, float64
============  ============  =========  ============  ============  ========================

The kernel view and its limit. Numba has no 16-bit float type on the CPU, so the kernels see
float16 data as its int16 bits and bfloat16 data as its uint16 bits, and the element type
selects the conversion at compile time (``bngrad.kernels._elements``). Both 16-bit integer
types are now taken: a third 16-bit format (or an 8-bit one beside int8/uint8) cannot be told
apart by its view type. The way out is to pass the codec as a compile-time tag argument
(e.g. a ``Literal`` string or a small typed marker) instead of reading it off the view type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import ml_dtypes
import numpy as np

__all__ = [
    "DTYPES", "DTypeSpec", "HALF_DTYPES", "NAMES", "NAMES_TEXT", "NUMPY_DTYPES",
    "by_alias", "compute_dtype", "find", "is_half", "kernel_view", "spec", "stat_dtype",
]

_F64, _F32 = np.dtype(np.float64), np.dtype(np.float32)


@dataclass(frozen=True)
class DTypeSpec:
    """Everything bngrad needs to know about one supported dtype.

    Attributes
    ----------
    name : str
        The canonical name, NumPy's (``np.dtype(...).name``): "float64", ..., "bfloat16".
    numpy : numpy.dtype
        The array dtype users pass (``ml_dtypes.bfloat16`` for bfloat16).
    kernel_view : numpy.dtype
        How the kernels see the bits: the dtype itself, or a 16-bit integer view for the
        half formats (see the module docstring for the limit this sets).
    compute : numpy.dtype
        Precision of elementwise arithmetic (normalise, grad_input): float64 for float64
        data, float32 otherwise.
    accumulation : numpy.dtype
        Precision of per-channel sums: float64 for every dtype.
    stat : numpy.dtype
        dtype of the forward's ``save_mean`` / ``save_invstd`` (PyTorch's): float32 for the
        half formats, else the dtype itself. Also grad_weight / grad_bias's dtype for half data
        with float32 statistics and no weight.
    param_dtypes : tuple of numpy.dtype
        dtypes a per-channel vector (weight, bias, running and saved statistics) may have for
        data of this dtype: its own, and float32 or float64 for the half formats (mixed
        precision, as in PyTorch).
    torch_name : str
        The ``torch`` attribute of the same dtype (``getattr(torch, torch_name)``).
    torch_cast : str
        The ``nn.Module`` / ``Tensor`` method converting to it (``model.half()``).
    aliases : tuple of str
        Other names accepted where users type a dtype (``bngrad bench --dtype bf16``),
        lower case.
    is_half : bool
        A 16-bit format: computed in float32, with float32 statistics.
    tolerance_class : str
        Which row of the test suite's tolerance table (``tests/tolerances.py``) judges results
        of this dtype: named by precision, so a new dtype of an existing precision can share one.
    """

    name: str
    numpy: np.dtype
    kernel_view: np.dtype
    compute: np.dtype
    accumulation: np.dtype
    stat: np.dtype
    param_dtypes: Tuple[np.dtype, ...]
    torch_name: str
    torch_cast: str
    aliases: Tuple[str, ...]
    is_half: bool
    tolerance_class: str


def _full(dtype: np.dtype, torch_cast: str, aliases: Tuple[str, ...], tolerance_class: str
          ) -> DTypeSpec:
    """A format the kernels read directly and compute in (float64, float32)."""
    return DTypeSpec(name=dtype.name, numpy=dtype, kernel_view=dtype, compute=dtype,
                     accumulation=_F64, stat=dtype, param_dtypes=(dtype,),
                     torch_name=dtype.name, torch_cast=torch_cast, aliases=aliases,
                     is_half=False, tolerance_class=tolerance_class)


def _half(dtype: np.dtype, kernel_view: Any, torch_cast: str, aliases: Tuple[str, ...],
          tolerance_class: str) -> DTypeSpec:
    """A 16-bit format: seen as integer bits by the kernels, computed in float32."""
    return DTypeSpec(name=dtype.name, numpy=dtype, kernel_view=np.dtype(kernel_view),
                     compute=_F32, accumulation=_F64, stat=_F32,
                     param_dtypes=(dtype, _F32, _F64), torch_name=dtype.name,
                     torch_cast=torch_cast, aliases=aliases, is_half=True,
                     tolerance_class=tolerance_class)


#: Every supported dtype, widest first (the order of error messages and of ``bngrad bench``).
DTYPES: Tuple[DTypeSpec, ...] = (
    _full(_F64, "double", ("fp64", "f64", "double"), "double"),
    _full(_F32, "float", ("fp32", "f32", "float"), "single"),
    _half(np.dtype(np.float16), np.int16, "half", ("fp16", "f16", "half"), "half"),
    _half(np.dtype(ml_dtypes.bfloat16), np.uint16, "bfloat16", ("bf16",), "bfloat16"),
)

NAMES: Tuple[str, ...] = tuple(s.name for s in DTYPES)
NUMPY_DTYPES: Tuple[np.dtype, ...] = tuple(s.numpy for s in DTYPES)
HALF_DTYPES: Tuple[np.dtype, ...] = tuple(s.numpy for s in DTYPES if s.is_half)
#: "float64, float32, float16 or bfloat16", for messages.
NAMES_TEXT = ", ".join(NAMES[:-1]) + " or " + NAMES[-1]

_BY_DTYPE: Dict[np.dtype, DTypeSpec] = {s.numpy: s for s in DTYPES}
_BY_ALIAS: Dict[str, DTypeSpec] = {key: s for s in DTYPES for key in (s.name,) + s.aliases}


def find(dtype: Any) -> DTypeSpec | None:
    """The spec of ``dtype`` (anything ``np.dtype`` accepts), or None if it is unsupported."""
    try:
        return _BY_DTYPE.get(np.dtype(dtype))
    except TypeError:
        return None


def spec(dtype: Any) -> DTypeSpec:
    """The spec of a supported ``dtype``; KeyError for any other (callers validate first)."""
    found = find(dtype)
    if found is None:
        raise KeyError(f"unsupported dtype {dtype!r}; expected {NAMES_TEXT}")
    return found


def by_alias(name: str) -> DTypeSpec | None:
    """The spec named ``name`` or one of its aliases (any case, spaces trimmed); else None."""
    return _BY_ALIAS.get(name.strip().lower())


def is_half(dtype: Any) -> bool:
    """Whether ``dtype`` is one of the 16-bit formats (float16, bfloat16)."""
    found = find(dtype)
    return found is not None and found.is_half


def kernel_view(dtype: Any) -> np.dtype:
    """The dtype the kernels see ``dtype``'s bits as."""
    return spec(dtype).kernel_view


def compute_dtype(dtype: Any) -> np.dtype:
    """Precision of elementwise arithmetic: float64 for float64 data, float32 otherwise."""
    return spec(dtype).compute


def stat_dtype(dtype: Any) -> np.dtype:
    """dtype of the forward's saved statistics: float32 for half data, else the data's."""
    return spec(dtype).stat
