"""The arrays of a benchmark case: random data in the case's memory layout, parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from .. import _dtypes
from .cases import Case
from .floor import dense_order


@dataclass
class CaseData:
    """The arrays of one case; ``floor_dy``/``floor_x`` are dense, in the input's memory order."""

    grad_out: np.ndarray
    input: np.ndarray
    weight: np.ndarray
    save_mean: np.ndarray
    save_invstd: np.ndarray
    floor_dy: np.ndarray
    floor_x: np.ndarray
    side_input: Optional[np.ndarray] = None  # add-relu cases: laid out as input


def _random(rng: np.random.Generator, shape: Tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Standard-normal values drawn in the compute dtype, then rounded to ``dtype``."""
    return rng.standard_normal(shape, dtype=_dtypes.compute_dtype(dtype)).astype(dtype, copy=False)


def _channels_last(rng, shape, dtype) -> np.ndarray:
    """Channels-last memory for the logical (N, C, ...) ``shape`` (plain C order when 2-D)."""
    if len(shape) <= 2:
        return _random(rng, shape, dtype)
    memory = (shape[0],) + tuple(shape[2:]) + (shape[1],)
    return np.moveaxis(_random(rng, memory, dtype), -1, 1)


def _sliced(rng, shape, dtype) -> np.ndarray:
    """A view of ``shape`` cropped out of a C-contiguous array 8 wider on the last axis."""
    pad = 8
    wide = _random(rng, tuple(shape[:-1]) + (shape[-1] + pad,), dtype)
    return wide[..., pad // 2: pad // 2 + shape[-1]]


def _dense_like(array: np.ndarray, template: np.ndarray) -> np.ndarray:
    """``array``'s values in ``template``'s memory order (``array`` itself when it already is)."""
    if array.strides == template.strides:
        return array
    out = np.empty_like(template)  # order 'K': keeps a dense template's strides
    np.copyto(out, array)
    return out


def make_arrays(case: Case, seed: int = 0) -> CaseData:
    """Random arrays for ``case``: standard-normal data, parameters of the usual magnitudes.

    Parameters are float32 for half dtypes (mixed precision, as in autocast training), the
    data's dtype otherwise.
    """
    rng = np.random.default_rng(seed)
    dtype = _dtypes.spec(case.dtype).numpy
    cf = lambda: _random(rng, case.shape, dtype)  # noqa: E731
    cl = lambda: _channels_last(rng, case.shape, dtype)  # noqa: E731
    make_dy, make_x = {
        "contiguous": (cf, cf),
        "channels_last": (cl, cl),
        "mixed": (cl, cf),
        "mixed_r": (cf, cl),
        "sliced": (cf, lambda: _sliced(rng, case.shape, dtype)),
    }[case.layout]
    grad_out, input = make_dy(), make_x()
    C = case.shape[1]
    param_dtype = _dtypes.compute_dtype(dtype)
    weight = rng.uniform(0.5, 1.5, C).astype(param_dtype)
    save_mean = rng.normal(0.0, 0.1, C).astype(param_dtype)
    save_invstd = rng.uniform(0.8, 1.2, C).astype(param_dtype)
    # drawn last, so that the other arrays of a case do not depend on its op
    side_input = (_dense_like(_random(rng, case.shape, dtype), input)
                  if case.op == "add-relu" else None)
    floor_x = input if dense_order(input) is not None else np.ascontiguousarray(input)
    floor_dy = _dense_like(grad_out, floor_x)
    return CaseData(grad_out, input, weight, save_mean, save_invstd, floor_dy, floor_x,
                    side_input)
