"""bngrad._dtypes, the one table of dtype facts: complete, consistent with the kernels and the
torch layer, and importable below every other layer."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import bngrad
from bngrad import _dtypes, kernels
from bngrad._validate import data_array
from bngrad.errors import ArgumentTypeError


def test_table_lists_the_four_dtypes_widest_first():
    assert _dtypes.NAMES == ("float64", "float32", "float16", "bfloat16")
    assert _dtypes.NAMES_TEXT == "float64, float32, float16 or bfloat16"
    for spec in _dtypes.DTYPES:
        assert spec.name == spec.numpy.name
        assert _dtypes.spec(spec.numpy) is spec is _dtypes.find(spec.name)
        assert spec.accumulation == np.float64
        assert spec.is_half == (spec.numpy.itemsize == 2)
        assert spec.param_dtypes[0] == spec.numpy


def test_unsupported_dtypes_are_not_found():
    for dtype in (np.int16, np.complex64, "int8"):
        assert _dtypes.find(dtype) is None
        assert not _dtypes.is_half(dtype)
        with pytest.raises(KeyError, match="float64, float32, float16 or bfloat16"):
            _dtypes.spec(dtype)
    assert _dtypes.find("not a dtype") is None


def test_aliases_name_one_dtype_each():
    keys = [k for s in _dtypes.DTYPES for k in (s.name,) + s.aliases]
    assert len(keys) == len(set(keys))
    assert _dtypes.by_alias(" BF16 ").name == "bfloat16"
    assert _dtypes.by_alias("float").name == "float32"  # np.dtype("float") is float64
    assert _dtypes.by_alias("half").name == "float16"
    assert _dtypes.by_alias("int8") is None


@pytest.mark.parametrize("spec", _dtypes.DTYPES, ids=lambda s: s.name)
def test_kernels_see_the_registered_view_and_compute_dtype(spec):
    array = np.zeros((2, 3), spec.numpy)
    view = kernels.as_kernel_array(array)
    assert view.dtype == spec.kernel_view and view.itemsize == spec.numpy.itemsize
    assert np.shares_memory(view, array)
    assert kernels.compute_dtype(spec.numpy) == spec.compute


@pytest.mark.parametrize("spec", _dtypes.DTYPES, ids=lambda s: s.name)
def test_forward_returns_statistics_of_the_registered_dtype(spec):
    x = np.arange(12, dtype=np.float64).reshape(4, 3).astype(spec.numpy)
    _, mean, invstd = bngrad.batch_norm_forward(x)
    assert mean.dtype == invstd.dtype == spec.stat


def test_validation_names_the_registered_dtypes():
    with pytest.raises(ArgumentTypeError, match="dtype float64, float32, float16 or bfloat16"):
        data_array("input", np.zeros((2, 2), np.int32))


@pytest.mark.parametrize("spec", _dtypes.DTYPES, ids=lambda s: s.name)
def test_torch_names_and_casts(spec):
    torch = pytest.importorskip("torch")
    from bngrad.torch import _convert

    dtype = getattr(torch, spec.torch_name)
    assert _convert.numpy_dtype(dtype) == spec.numpy and _convert.torch_dtype(spec.numpy) is dtype
    assert getattr(torch.nn.Linear(1, 1), spec.torch_cast)().weight.dtype is dtype
    assert _convert.stat_dtype(dtype) is getattr(torch, spec.stat.name)
    assert _convert.allowed_param_dtypes(dtype) == tuple(
        _convert.torch_dtype(d) for d in spec.param_dtypes)


def test_registry_imports_nothing_of_bngrad():
    """The kernels read it, so it must sit below the validation layer (and everything else)."""
    source = pathlib.Path(_dtypes.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import in bngrad._dtypes"
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "dataclasses", "typing", "numpy", "ml_dtypes"}


def _codec_kernels():
    from numba import njit

    from bngrad.kernels._elements import from_float, to_float

    @njit
    def encode(values, out):
        for i in range(values.shape[0]):
            out[i] = from_float(values[i], out)

    @njit
    def decode(bits, out):
        for i in range(bits.shape[0]):
            out[i] = to_float(bits[i])
    return encode, decode


def test_the_kernels_bfloat16_codec_matches_ml_dtypes():
    """Every 16-bit pattern decodes as ml_dtypes does; float32 patterns (a stride through all
    2**32, every rounding tie and its neighbours, infinities, the largest finite values)
    encode as ml_dtypes rounds them; a NaN stays NaN, quiet, with its sign and top bits."""
    import ml_dtypes

    encode, decode = _codec_kernels()
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    widened = np.empty(every.size, np.float32)
    decode(every, widened)
    np.testing.assert_array_equal(widened.view(np.uint32),
                                  every.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32))

    ties = (np.arange(1 << 16, dtype=np.uint32) << 16) | 0x8000
    special = np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0,
                        0x80000000, 1, 0x80000001], np.uint32)
    patterns = np.concatenate([np.arange(0, 1 << 32, 9973, dtype=np.uint64).astype(np.uint32),
                               ties, ties - 1, ties + 1, special])
    values = patterns.view(np.float32)
    bits = np.empty(values.size, np.uint16)
    encode(values, bits)
    finite_or_inf = ~np.isnan(values)
    with np.errstate(over="ignore"):
        expected = values[finite_or_inf].astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(bits[finite_or_inf], expected)
    nan_in = patterns[~finite_or_inf]
    assert nan_in.size > 1000
    np.testing.assert_array_equal(bits[~finite_or_inf], (nan_in >> 16) | 0x40)
