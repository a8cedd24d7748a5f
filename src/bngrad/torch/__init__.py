"""bngrad for PyTorch: batch norm whose forward and backward run on bngrad's kernels.

- :func:`batch_norm`: :func:`torch.nn.functional.batch_norm`, differentiable to any order;
- :class:`BatchNorm1d`, :class:`BatchNorm2d`, :class:`BatchNorm3d`: drop-in modules;
- :func:`batch_norm_relu`, :func:`batch_norm_add_relu`, :class:`BatchNormReLU2d`,
  :class:`BatchNormAddReLU2d` (and 1d/3d): batch norm fused with ReLU / residual add + ReLU
  (:mod:`bngrad.torch.fused`);
- :func:`convert` / :func:`revert`: swap the batch norms of a model either way;
  ``convert(model, fuse=True)`` also fuses BN→ReLU and BN→add→ReLU (torch.fx), reporting
  what it did in ``model.bngrad_fusion_report`` (:class:`FusionReport`) and, where a pattern
  was refused or a forward could not be traced, a :class:`FusionWarning`; an ``nn.Sequential``
  with adjacent [BatchNorm, ReLU] children becomes a :class:`FusedSequential`;
- :class:`SyncBatchNorm`: batch norm synchronized across processes (torch.distributed);
- ``torch.ops.bngrad.*``: the custom operators (:mod:`bngrad.torch.ops`), traceable by
  ``torch.compile`` and ``torch.export``.

CPU tensors only; tensors on other devices are handed to PyTorch's own batch norm with a
one-time warning (SyncBatchNorm across several ranks raises instead: it is the CPU's
counterpart of torch.nn.SyncBatchNorm, which serves GPUs). The kernels follow
``torch.get_num_threads()``. Requires PyTorch: ``pip install '.[torch]'`` in bngrad's clone.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:
    raise ImportError(
        "bngrad.torch needs PyTorch, which is not installed. Install it from bngrad's clone "
        "with: pip install '.[torch]'") from exc

from . import ops  # noqa: E402  (registers torch.ops.bngrad.*)
from .functional import batch_norm  # noqa: E402
from .fused import (BatchNormAddReLU1d, BatchNormAddReLU2d, BatchNormAddReLU3d,  # noqa: E402
                    BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d, batch_norm_add_relu,
                    batch_norm_relu)
from .modules import BatchNorm1d, BatchNorm2d, BatchNorm3d, convert, revert  # noqa: E402
from .sync import CollectiveError, SyncBatchNorm  # noqa: E402
from ._fuse import FusionReport, FusionWarning  # noqa: E402
from ._fuse import _FusedSequential as FusedSequential  # noqa: E402  (its repr's name)

__all__ = ["BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "BatchNormAddReLU1d", "BatchNormAddReLU2d",
           "BatchNormAddReLU3d", "BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d",
           "CollectiveError", "FusedSequential", "FusionReport", "FusionWarning",
           "SyncBatchNorm", "batch_norm",
           "batch_norm_add_relu", "batch_norm_relu", "convert", "ops", "revert"]

# Which pool runs the kernels of bngrad.torch's calls: PyTorch's own OpenMP team by default,
# Numba's with set_kernel_pool("numba") (bngrad._gomp; docs/torch.md, "Threads").
from .._gomp import kernel_pool, set_kernel_pool  # noqa: E402

__all__ += ["kernel_pool", "set_kernel_pool"]
