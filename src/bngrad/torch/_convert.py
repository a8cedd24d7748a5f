"""Zero-copy conversion between CPU torch tensors and NumPy arrays.

bngrad's kernels work on NumPy arrays; the torch layer hands them *views* of the tensors'
memory, never copies, so a training step costs no extra full-size traffic. Strides are kept
as they are: a channels_last tensor becomes a NumPy array with the same (N, C, H, W) shape and
NHWC strides, and the core API returns grad_input in the input's axis order, which comes back
as a channels_last tensor again.

bfloat16 has no NumPy dtype of its own; ``ml_dtypes.bfloat16`` has the same bits, so we go
through an int16 view on both sides (``tensor.view(torch.int16)`` reinterprets, whatever the
strides, because the element size does not change).
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Optional

import numpy as np
import torch

from .. import _dtypes
from ..errors import ArgumentTypeError, ArgumentValueError

__all__ = [
    "SUPPORTED_DTYPES",
    "empty_like",
    "from_numpy",
    "is_supported_device",
    "output_like",
    "numpy_dtype",
    "to_numpy",
    "to_numpy_optional",
    "torch_dtype",
]

#: torch dtype -> NumPy dtype with the same bits, for every dtype bngrad computes in.
_TORCH_TO_NUMPY = {getattr(torch, s.torch_name): s.numpy for s in _dtypes.DTYPES}
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}

SUPPORTED_DTYPES = tuple(_TORCH_TO_NUMPY)
_BF16 = _dtypes.spec("bfloat16").numpy


def is_supported_device(tensor: torch.Tensor) -> bool:
    """True when bngrad can compute on ``tensor`` in place: a plain CPU (strided) tensor.

    Everything else (CUDA, MPS, meta, sparse, ...) is left to PyTorch by the callers. Kept as one
    small function so the fallback path can be tested on a CPU-only machine by patching it.
    """
    # (``is_cpu`` is a flag; ``device`` builds an object on every call, of every layer)
    return tensor.is_cpu and tensor.layout == torch.strided


def numpy_dtype(dtype: torch.dtype, name: str = "tensor") -> np.dtype:
    """The NumPy dtype with the same bits as torch ``dtype`` (bfloat16 -> ml_dtypes.bfloat16)."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise ArgumentTypeError(
            f"{name} must be {_dtypes.NAMES_TEXT}, got {dtype}; "
            "cast it with .to(torch.float32) first") from None


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype with the same bits as NumPy ``dtype`` (inverse of :func:`numpy_dtype`)."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise ArgumentTypeError(
            f"expected a {_dtypes.NAMES_TEXT} array, got {np.dtype(dtype)}") from None


def to_numpy(tensor: torch.Tensor, name: str = "tensor") -> np.ndarray:
    """A NumPy view of a CPU tensor's memory: same shape, same strides, no copy.

    The tensor is detached first (autograd is the caller's business). bfloat16 tensors become
    ``ml_dtypes.bfloat16`` arrays. Writing into the result writes into the tensor.

    Parameters
    ----------
    tensor : torch.Tensor
        A CPU, strided tensor of float64, float32, float16 or bfloat16, any strides.
    name : str
        Argument name used in error messages.

    Raises
    ------
    ArgumentTypeError
        ``tensor`` is not a tensor or has an unsupported dtype.
    ArgumentValueError
        ``tensor`` is not a CPU strided tensor.
    """
    # Fast path (this runs ~10 times per layer and step): plain CPU tensors of our dtypes.
    # Anything unusual makes .numpy() raise, and the checks below explain what is wrong.
    # (``is_cpu`` is a plain flag; ``device.type`` would build a device object every call.)
    # (``detach`` makes a new tensor object: only where autograd would refuse ``numpy``.)
    if isinstance(tensor, torch.Tensor) and tensor.is_cpu and tensor.dtype in _TORCH_TO_NUMPY:
        try:
            plain = tensor.detach() if tensor.requires_grad else tensor
            if plain.dtype is torch.bfloat16:
                return plain.view(torch.int16).numpy().view(_BF16)
            return plain.numpy()
        except (RuntimeError, TypeError):
            pass
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if not is_supported_device(tensor):
        raise ArgumentValueError(
            f"{name} must be a CPU tensor with strided layout to be viewed as a NumPy array; got "
            f"device={tensor.device}, layout={tensor.layout}; use .cpu() (and .to_dense()) first")
    numpy_dtype(tensor.dtype, name)  # raises on unsupported dtypes
    t = tensor.detach()
    if t.is_neg():  # a lazily negated view cannot be shared with NumPy; this rare case copies
        t = t.resolve_neg()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16)
    return t.numpy()


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def output_like(input: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor for batch norm's forward output, in the memory format
    PyTorch's batch norm gives it (its input's suggested format: channels_last stays
    channels_last, any other permuted layout becomes contiguous; the NumPy API writes across
    layouts), in memory from :func:`empty_like`. (Its grad_input keeps the input's layout,
    as ``torch.empty_like`` does.)"""
    out = empty_like(input)  # (a dense input's strides, else the suggested format)
    last = _CHANNELS_LAST.get(input.dim())
    if out.is_contiguous() or (last is not None and out.is_contiguous(memory_format=last)):
        return out
    return empty_like(input, memory_format=torch.contiguous_format)


def empty_like(input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``torch.empty_like(input, **kwargs)`` for a result bngrad writes, its memory advised to
    be backed by huge pages where it is large.

    An allocation above glibc's largest mmap threshold (32 MiB) gets fresh pages from the
    operating system every time, and faulting in 4 KiB pages one by one cost as much as the
    batch norm itself ((32, 256, 56, 56) float32 on 2 cores: forward 30.4 -> 13.9 ms,
    backward 33.6 -> 17.2 ms with the advice; benchmarks/results/2026-12-04-session30.txt).
    NumPy gives every array of 4 MiB or more the same advice (``madvise(MADV_HUGEPAGE)``, which
    the kernel honours where transparent huge pages are ``madvise`` or ``always``); PyTorch's
    allocator does not, unless ``THP_MEM_ALLOC_ENABLE=1`` is set before it starts."""
    out = torch.empty_like(input, **kwargs)
    if out.numel() * out.element_size() >= _HUGE_PAGES_FROM and type(out) is torch.Tensor:
        _advise_huge_pages(out.data_ptr(), out.untyped_storage().nbytes())
    return out


_HUGE_PAGES_FROM = 1 << 22  # bytes (NumPy's threshold)
_MADV_HUGEPAGE = 14  # Linux's value (asm-generic/mman-common.h)


def _libc_madvise() -> Any:
    """libc's madvise, or None where there is none to call (not Linux, no libc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _libc_madvise()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _advise_huge_pages(address: int, nbytes: int) -> None:
    """Advise the whole pages inside [address, address + nbytes) to be huge pages (before they
    are touched, so that their first touch faults in 2 MiB at a time). Advice only: a kernel
    without transparent huge pages refuses it, and nothing changes."""
    if _madvise is None:
        return
    start = -(-address // _PAGE) * _PAGE
    length = (address + nbytes - start) // _PAGE * _PAGE
    if length > 0:
        _madvise(start, length, _MADV_HUGEPAGE)


def to_numpy_optional(tensor: Optional[torch.Tensor], name: str = "tensor") -> Optional[np.ndarray]:
    """:func:`to_numpy`, passing ``None`` through (for optional weight, bias, running stats)."""
    return None if tensor is None else to_numpy(tensor, name)


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing ``array``'s memory: same shape, same strides, no copy.

    ``ml_dtypes.bfloat16`` arrays become ``torch.bfloat16`` tensors. Arrays with negative
    strides (which torch cannot represent) are copied once into C order; bngrad's own outputs
    never have them.
    """
    array = np.asarray(array)
    dtype = torch_dtype(array.dtype)
    if min(array.strides, default=0) < 0:
        array = np.ascontiguousarray(array)
    if not array.flags.writeable:
        # torch.from_numpy warns on read-only arrays; a read-only view is only handed to us
        # for inputs we never write, but tensors must be writable, so copy this rare case.
        array = array.copy()
    if dtype == torch.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


# --- the NumPy API's complaints, said in PyTorch's terms ----------------------------------------

#: The half formats (float16, bfloat16) as torch dtypes.
HALF = tuple(_NUMPY_TO_TORCH[d] for d in _dtypes.HALF_DTYPES)


def allowed_param_dtypes(input_dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """dtypes a per-channel tensor may have for an input of ``input_dtype`` (the core's rule:
    the input's own, or float32/float64 for float16/bfloat16 data)."""
    spec = _dtypes.spec(_TORCH_TO_NUMPY[input_dtype])
    return tuple(_NUMPY_TO_TORCH[d] for d in spec.param_dtypes)


def stat_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of save_mean / save_invstd for an input of ``input_dtype``: float32 for the half
    formats, else the input's (an unsupported dtype's own too: the call itself refuses it)."""
    numpy = _TORCH_TO_NUMPY.get(input_dtype)
    return input_dtype if numpy is None else _NUMPY_TO_TORCH[_dtypes.stat_dtype(numpy)]


def cast_method(dtype: torch.dtype) -> str:
    """The ``nn.Module`` method converting a model to ``dtype`` ("half" for float16, ...)."""
    return _dtypes.spec(_TORCH_TO_NUMPY[dtype]).torch_cast


def torch_terms(exc: Exception, input: torch.Tensor,
                per_channel: dict[str, Optional[torch.Tensor]]) -> Exception:
    """The error to raise for ``exc``, raised by the NumPy API on views of these tensors.

    A per-channel tensor of the wrong length or dtype is described in tensor terms (channels
    are dimension 1; dtypes change with ``.to(...)``); anything else keeps the original error.
    Called only once the core has refused its arguments, so a correct call pays nothing.
    """
    if input.dtype not in _TORCH_TO_NUMPY:  # the input itself is refused: nothing to add
        return exc
    if isinstance(exc, ArgumentValueError) and input.dim() >= 2:
        n_channels = input.shape[1]
        for name, tensor in per_channel.items():
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != (n_channels,):
                return ArgumentValueError(
                    f"input has {n_channels} channels (dimension 1 of shape "
                    f"{tuple(input.shape)}), but {name} has shape {tuple(tensor.shape)}; "
                    "weight, bias, running_mean and running_var need one value per channel")
    if isinstance(exc, ArgumentTypeError):
        return param_dtype_error(input, per_channel) or exc
    return exc


def param_dtype_error(input: torch.Tensor, per_channel: dict[str, Optional[torch.Tensor]]
                      ) -> Optional[ArgumentTypeError]:
    """The error for the first per-channel tensor whose dtype ``input`` cannot have beside it,
    in tensor terms; None where all can, or where input's own dtype is one bngrad refuses
    (whose error is input's)."""
    if input.dtype not in _TORCH_TO_NUMPY:
        return None
    allowed = allowed_param_dtypes(input.dtype)
    for name, tensor in per_channel.items():
        if isinstance(tensor, torch.Tensor) and tensor.dtype not in allowed:
            also = (f" (a {input.dtype} input may also have float32 or float64 {name})"
                    if input.dtype in HALF else "")
            fix = (f"convert one of them: {name}.to({input.dtype}) or "
                   f"input.to({tensor.dtype})" if tensor.dtype in _TORCH_TO_NUMPY
                   else f"convert it: {name}.to({input.dtype})")  # (no such input)
            return ArgumentTypeError(f"{name} has dtype {tensor.dtype} but input has dtype "
                                     f"{input.dtype}; {fix}{also}")
    return None
