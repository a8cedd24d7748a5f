"""THE tolerance table of the bngrad test suite, and the helpers that apply it.

Every numerical comparison in the tests goes through :func:`assert_close`. Low-precision
results are judged by their error against the float64 reference (``bngrad.reference``,
computed from the *same* low-precision inputs, so input quantisation is not counted):

    |actual - expected| <= atol * scale + rtol * |expected|        (elementwise)

``rtol`` covers rounding of the result to its dtype (a few units in the last place; the value
nearest the reference in that dtype always passes, as in the subnormal range, where a unit in
the last place is more than ``rtol`` of the result);
``atol * scale`` covers rounding of the intermediate terms. ``scale`` is the magnitude of the
terms that were combined — for a sum, the sum of the absolute values of its terms; for
grad_input, the size of ``dy * invstd * weight`` — because a result that cancels (a sum of
random signs, grad_input of a channel with one or two elements) can be far smaller than the
terms it came from, and no floating-point method gets *its* relative error small. When no
scale is given, ``max |expected|`` over the whole array is used (norm-wise comparison).

The numbers are per dtype of the result being judged: float64 results are judged at float64
accuracy, float32 results (including float32 grad_weight / grad_bias of half inputs, and the
float32 save_mean / save_invstd of half inputs) at float32 accuracy, half results at half
accuracy; sums over half inputs at most at float32 accuracy, as they are accumulated in float32
blocks, even where their dtype is float64 (conftest.sum_dtype). ``factor`` widens the bound
when two approximate results are compared with each other (bngrad vs PyTorch: each may be off
by one tolerance, so ``factor=2``).

NaN must be NaN in the same places, and infinities must match exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bngrad import _dtypes

#: tolerance class (``bngrad._dtypes.DTypeSpec.tolerance_class``) of the result ->
#: (atol relative to the term scale, rtol relative to the result).
#: Unit roundoff u: double (float64) 1.1e-16, single (float32) 6.0e-8, half (float16) 4.9e-4,
#: bfloat16 3.9e-3.
TOL_BY_CLASS: dict[str, tuple[float, float]] = {
    "double": (1e-12, 1e-12),
    "single": (1e-5, 1e-5),
    "half": (2e-3, 2e-3),           # ~4 u
    "bfloat16": (1.6e-2, 1.6e-2),   # ~4 u
}

#: dtype of the result -> (atol, rtol), for every dtype bngrad supports.
TOL: dict[np.dtype, tuple[float, float]] = {
    spec.numpy: TOL_BY_CLASS[spec.tolerance_class] for spec in _dtypes.DTYPES}


def dtype_name(dtype: Any) -> str:
    """Readable name for test ids: float64, float32, float16, bfloat16."""
    return np.dtype(dtype).name


def tolerance(dtype: Any) -> tuple[float, float]:
    """(atol, rtol) for results of ``dtype``."""
    try:
        return TOL[np.dtype(dtype)]
    except KeyError:
        raise KeyError(f"no tolerance for dtype {dtype!r}; give it a tolerance_class in "
                       "bngrad/_dtypes.py (and a row here if the class is new)") from None


def to_f64(a: Any) -> np.ndarray:
    """float64 copy of an array of any supported dtype (bfloat16 included)."""
    return np.asarray(a).astype(np.float64)


def assert_close(actual: Any, expected: Any, dtype: Any = None, what: str = "result", *,
                 scale: Any = None, factor: float = 1.0) -> None:
    """Assert ``actual`` matches the float64 ``expected`` within the tolerance of ``dtype``.

    Parameters
    ----------
    actual : array-like
        The result under test (any supported dtype).
    expected : array-like
        The float64 reference for it.
    dtype : dtype, optional
        Whose tolerance applies; defaults to ``actual``'s dtype.
    what : str
        Name of the quantity, used in the failure message.
    scale : float or array, optional
        Magnitude of the terms ``expected`` was combined from (broadcast against it);
        default ``max |expected|``.
    factor : float
        Multiplies both tolerances (2 when comparing two approximate results).
    """
    assert actual is not None, f"{what}: got None, expected an array"
    act_arr = np.asarray(actual)
    if dtype is None:
        dtype = act_arr.dtype
    atol, rtol = tolerance(dtype)
    atol, rtol = atol * factor, rtol * factor
    act = to_f64(act_arr)
    exp = to_f64(expected)
    assert act.shape == exp.shape, f"{what}: shape {act.shape}, expected {exp.shape}"
    if exp.size == 0:
        return
    nan_a, nan_e = np.isnan(act), np.isnan(exp)
    assert np.array_equal(nan_a, nan_e), (
        f"{what}: NaN at {np.argwhere(nan_a != nan_e)[:5].tolist()} differs from the reference "
        f"({int(nan_a.sum())} NaN in actual, {int(nan_e.sum())} in expected)")
    # A finite reference beyond the dtype's range correctly rounds to +-inf in that dtype.
    with np.errstate(over="ignore"):
        exp_rounded = exp.astype(act_arr.dtype).astype(np.float64)
    overflow = np.isfinite(exp) & np.isinf(exp_rounded) & (act == exp_rounded)
    inf_e = np.isinf(exp)
    inf_a = np.isinf(act) & ~overflow
    assert np.array_equal(act[inf_e | inf_a], exp[inf_e | inf_a]), (
        f"{what}: infinities differ from the reference")
    finite = np.isfinite(exp) & ~overflow
    if scale is None:
        scale = np.max(np.abs(exp[finite])) if finite.any() else 0.0
    scale = np.broadcast_to(np.abs(to_f64(scale)), exp.shape)
    err = np.abs(act - exp)
    # The value nearest the reference in the result's dtype always passes: where that dtype's
    # spacing exceeds rtol * |expected| (subnormal half results) no result can be closer.
    with np.errstate(invalid="ignore"):  # (inf - inf where the reference is infinite)
        bound = np.maximum(atol * scale + rtol * np.abs(exp), np.abs(exp_rounded - exp))
    bad = finite & ~(err <= bound)
    if bad.any():
        idx = np.unravel_index(np.argmax(np.where(finite, err - bound, -np.inf)), exp.shape)
        raise AssertionError(
            f"{what} ({np.dtype(dtype).name} tolerance atol={atol:g}*scale, rtol={rtol:g}): "
            f"{int(bad.sum())} of {exp.size} elements out of tolerance; "
            f"worst at {tuple(int(i) for i in idx)}: "
            f"got {act[idx]:.9g}, expected {exp[idx]:.9g}, error {err[idx]:.3g} > bound "
            f"{bound[idx]:.3g} (scale {scale[idx]:.3g})")


def max_error(actual: Any, expected: Any, scale: Any = None) -> float:
    """Largest ``|actual - expected| / scale`` over finite elements (for accuracy reports).

    ``scale`` defaults to ``max |expected|`` (norm-wise relative error).
    """
    act, exp = to_f64(actual), to_f64(expected)
    finite = np.isfinite(exp)
    if not finite.any():
        return 0.0
    if scale is None:
        scale = np.max(np.abs(exp[finite])) or 1.0
    scale = np.broadcast_to(np.abs(to_f64(scale)), exp.shape)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(act - exp)[finite] / scale[finite]
    return float(np.max(np.where(np.isfinite(rel), rel, 0.0))) if rel.size else 0.0


def assert_dtype(actual: Any, dtype: Any, what: str = "result") -> None:
    """Assert ``actual`` is an array of exactly ``dtype``."""
    assert isinstance(actual, np.ndarray), f"{what}: expected a numpy array, got {type(actual)}"
    assert actual.dtype == np.dtype(dtype), (
        f"{what}: dtype {actual.dtype}, expected {np.dtype(dtype)}")


def assert_bitwise_equal(a: Any, b: Any, what: str = "result") -> None:
    """Assert two results are identical bit for bit (NaNs included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
    ua = np.ascontiguousarray(a).reshape(-1).view(f"u{a.itemsize}")
    ub = np.ascontiguousarray(b).reshape(-1).view(f"u{b.itemsize}")
    diff = np.flatnonzero(ua != ub)
    if diff.size:
        raise AssertionError(f"{what}: not bitwise identical; {diff.size} of {ua.size} elements "
                             f"differ, first at flat indices {diff[:5].tolist()}")


# Scales of the terms behind each backward output (float64, see the module docstring).

def backward_scales(grad_out: Any, input: Any, weight: Any, mean: Any, invstd: Any,
                    channel_axis: int = 1) -> dict[str, np.ndarray]:
    """Term scales for grad_input, grad_weight, grad_bias, sum_dy, sum_dy_xmu (float64).

    ``mean`` / ``invstd`` are the statistics used (save or running); ``weight`` may be None.
    """
    dy = np.moveaxis(to_f64(grad_out), channel_axis, -1)
    x = np.moveaxis(to_f64(input), channel_axis, -1)
    mean, invstd = to_f64(mean), to_f64(invstd)
    w = np.ones(x.shape[-1]) if weight is None else to_f64(weight)
    axes = tuple(range(x.ndim - 1))
    with np.errstate(invalid="ignore", over="ignore"):
        xmu = x - mean
        abs_dy = np.abs(dy)
        sum_abs_dy = abs_dy.sum(axis=axes)
        sum_abs_dy_xmu = (abs_dy * np.abs(xmu)).sum(axis=axes)
        finite = lambda a: a[np.isfinite(a)]  # noqa: E731
        xhat = finite(np.abs(xmu * invstd))
        dyiw = finite(abs_dy * np.abs(invstd * w))
        gi = (dyiw.max() if dyiw.size else 0.0) * (1.0 + (xhat.max() if xhat.size else 0.0))
    return {
        "grad_input": np.asarray(gi),
        # a sum of no terms has scale 0, whatever the (then undefined, NaN) statistics
        "grad_weight": np.where(sum_abs_dy_xmu == 0, 0.0, sum_abs_dy_xmu * np.abs(invstd)),
        "grad_bias": sum_abs_dy,
        "sum_dy": sum_abs_dy,
        "sum_dy_xmu": sum_abs_dy_xmu,
    }
