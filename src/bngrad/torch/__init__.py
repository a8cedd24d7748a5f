"""bngrad for PyTorch: batch norm whose forward and backward run on bngrad's kernels.

Requires the optional dependency: ``pip install bngrad[torch]``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "bngrad.torch needs PyTorch, which is not installed. "
        "Install it with: pip install bngrad[torch]") from exc

from . import _convert  # noqa: E402,F401

__all__: list[str] = []
