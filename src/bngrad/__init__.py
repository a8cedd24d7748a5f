"""bngrad: batch-norm gradients (dx, dweight, dbias) on NumPy arrays, at the memory-bandwidth limit.

PyTorch's semantics (``native_batch_norm_backward`` / ``native_batch_norm``) for every dtype
(float64, float32, float16, bfloat16) and memory layout, computed by parallel Numba kernels
that give bitwise-identical results for any thread count. ``bngrad.reference`` is the float64
NumPy oracle everything is tested against.
"""

from . import _threads  # noqa: F401  (selects a thread- and fork-safe Numba layer first)
from . import errors, reference
from .api import (
    batch_norm_backward,
    batch_norm_backward_elemt,
    batch_norm_backward_reduce,
    batch_norm_forward,
    batch_norm_moments,
    explain,
)
from .errors import ArgumentTypeError, ArgumentValueError, BngradError, NestedCallError
from .fused import batch_norm_relu_backward, batch_norm_relu_forward

# The only place the version is written: pyproject.toml reads it (dynamic = ["version"]).
__version__ = "0.1.0"

__all__ = [
    "ArgumentTypeError",
    "ArgumentValueError",
    "BngradError",
    "NestedCallError",
    "batch_norm_backward",
    "batch_norm_backward_elemt",
    "batch_norm_backward_reduce",
    "batch_norm_forward",
    "batch_norm_moments",
    "batch_norm_relu_backward",
    "batch_norm_relu_forward",
    "errors",
    "explain",
    "reference",
    "__version__",
]
