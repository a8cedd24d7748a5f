"""Shared cases of the bngrad test suite: dtypes, memory layouts, shapes, modes, and the PyTorch
bridge.

Test modules import these helpers directly (``from conftest import ...``; tests/ is on
sys.path) and build their parametrised matrices from them, so that every test file speaks
of the same layouts and dtypes under the same readable ids.

Vocabulary (used in test ids):

- dtype variants: ``float64``, ``float32``, ``float16``, ``bfloat16`` (parameters and stats in
  the input's dtype) and ``float16-p32``, ``bfloat16-p32`` (half data, float32 parameters and
  statistics: PyTorch's mixed precision);
- layouts (memory layout of one array, same logical values): ``contig`` (C order), ``chlast``
  (channel axis innermost in memory: NHWC strides on an NCHW shape), ``fortran`` (all axes
  reversed), ``chfirst`` (channel axis outermost, the rest reversed), ``sliced`` (a strided,
  offset view into a bigger buffer), ``flipped`` (negative strides);
- layout pairs ``<input>`` or ``<input>/<grad_out>`` when the two differ;
- modes: ``train`` (save_mean/save_invstd given), ``train-nostats`` (both None: computed from
  input), ``eval`` (running stats).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import pytest

from bngrad import _dtypes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

F64, F32, F16, BF16 = (_dtypes.spec(name).numpy
                      for name in ("float64", "float32", "float16", "bfloat16"))
HALF = _dtypes.HALF_DTYPES


# --------------------------------------------------------------------------- dtypes

@dataclass(frozen=True)
class DtypeVariant:
    id: str
    data: np.dtype      # input / grad_out
    param: np.dtype     # weight, bias, running and saved statistics


# Every registered dtype with parameters of its own dtype, and each half format also with
# parameters in its statistics dtype (float32: PyTorch's mixed precision) as "<name>-p32".
DTYPE_VARIANTS = [
    variant
    for spec in _dtypes.DTYPES
    for variant in ([DtypeVariant(spec.name, spec.numpy, spec.numpy)]
                    + ([DtypeVariant(f"{spec.name}-p{8 * spec.stat.itemsize}", spec.numpy,
                                     spec.stat)] if spec.is_half else []))
]
DTYPE_VARIANT = {v.id: v for v in DTYPE_VARIANTS}
DATA_DTYPES = list(_dtypes.NUMPY_DTYPES)


# --------------------------------------------------------------------------- bits

def bits_of(a: np.ndarray) -> np.ndarray:
    """``a``'s elements as unsigned integers of their width, in C order: equal arrays of these
    are bitwise-equal results (NaN payloads and signed zeros included)."""
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(f"u{a.itemsize}")


def results_bits(results) -> list:
    """Results (arrays or None) as values that compare equal only where the results are
    bitwise equal: dtype, shape and bytes of each."""
    return [None if r is None else (r.dtype.str, r.shape, r.tobytes()) for r in results]


# --------------------------------------------------------------------------- layouts

def dense_in_order(a: np.ndarray, order) -> np.ndarray:
    """Same values as ``a``, dense in memory with axes ``order`` from outermost to innermost."""
    order = list(order)
    buf = np.ascontiguousarray(np.transpose(a, order))
    return np.transpose(buf, np.argsort(order))


def _contig(a, ax):
    return np.ascontiguousarray(a).copy()


def _chlast(a, ax):
    return dense_in_order(a, [i for i in range(a.ndim) if i != ax] + [ax])


def _fortran(a, ax):
    return dense_in_order(a, list(range(a.ndim))[::-1])


def _chfirst(a, ax):
    return dense_in_order(a, [ax] + [i for i in range(a.ndim) if i != ax][::-1])


def _sliced(a, ax):
    """Every other element of a bigger buffer along axis 0 and the last axis, offset by one."""
    big = list(a.shape)
    big[0] = 2 * big[0] + 1
    big[-1] = 2 * big[-1] + 1
    buf = np.full(big, np.nan, dtype=np.float64).astype(a.dtype)  # NaN padding shows over-reads
    index = [slice(None)] * a.ndim
    index[0] = slice(1, None, 2)
    index[-1] = slice(1, None, 2)
    view = buf[tuple(index)]
    view[...] = a
    assert not view.flags.c_contiguous or a.size <= 1
    return view


def _flipped(a, ax):
    """Negative strides on axis 0 and the channel axis."""
    index = [slice(None)] * a.ndim
    index[0] = slice(None, None, -1)
    index[ax] = slice(None, None, -1)
    index = tuple(index)
    return np.ascontiguousarray(a[index])[index]


LAYOUTS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "contig": _contig,
    "chlast": _chlast,
    "fortran": _fortran,
    "chfirst": _chfirst,
    "sliced": _sliced,
    "flipped": _flipped,
}
DENSE_LAYOUTS = ("contig", "chlast", "fortran", "chfirst")

# (id, input layout, grad_out layout)
LAYOUT_PAIRS = [
    ("contig", "contig", "contig"),
    ("chlast", "chlast", "chlast"),
    ("fortran", "fortran", "fortran"),
    ("chfirst", "chfirst", "chfirst"),
    ("sliced", "sliced", "sliced"),
    ("chlast/contig", "chlast", "contig"),
    ("contig/chlast", "contig", "chlast"),
    ("flipped/sliced", "flipped", "sliced"),
    ("sliced/chlast", "sliced", "chlast"),
]


def to_layout(a: np.ndarray, layout: str, channel_axis: int) -> np.ndarray:
    """``a`` (any layout) re-laid out as ``layout``; values and shape unchanged."""
    out = LAYOUTS[layout](np.asarray(a), channel_axis % max(np.ndim(a), 1))
    assert out.shape == np.shape(a)
    return out


def memory_order(a: np.ndarray) -> tuple[int, ...]:
    """Axes of extent > 1, from largest to smallest |stride|."""
    axes = [i for i in range(a.ndim) if a.shape[i] > 1]
    return tuple(sorted(axes, key=lambda i: -abs(a.strides[i])))


def is_dense(a: np.ndarray) -> bool:
    """True when ``a`` fills its memory without gaps, with positive strides, in some axis order."""
    if a.size <= 1:
        return True
    expected = a.itemsize
    for i in reversed(memory_order(a)):
        if a.strides[i] != expected:
            return False
        expected *= a.shape[i]
    return True


def assert_output_layout(grad_input: np.ndarray, input: np.ndarray, what="grad_input") -> None:
    """grad_input keeps input's axis order when input is dense in some order, C order otherwise."""
    assert isinstance(grad_input, np.ndarray), f"{what}: got {type(grad_input)}"
    if input.size == 0:
        return  # strides of empty arrays carry no order
    assert is_dense(grad_input), f"{what}: not dense (strides {grad_input.strides})"
    if is_dense(input):
        assert memory_order(grad_input) == memory_order(input), (
            f"{what}: axis order {memory_order(grad_input)} (strides {grad_input.strides}); input "
            f"is dense in order {memory_order(input)} (strides {input.strides}) and should keep it")
    else:
        assert grad_input.flags.c_contiguous, (
            f"{what}: input is not dense (strides {input.strides}), so grad_input should be C "
            f"order, got strides {grad_input.strides}")


# --------------------------------------------------------------------------- shapes and axes

# Small shapes with distinct extents, so that any mix-up of axes changes the result.
SHAPES = {
    2: (7, 3),
    3: (3, 4, 5),
    4: (2, 3, 4, 5),
    5: (2, 3, 4, 1, 5),
}


def channel_axes(ndim: int) -> list[tuple[str, int]]:
    """(id, axis): PyTorch's 1, NHWC-style -1, and one other axis."""
    other = 0 if ndim <= 3 else 2
    return [("ax1", 1), ("ax-1", -1), (f"ax{other}", other)]


MODES = ("train", "train-nostats", "eval")
MASKS = list(itertools.product((True, False), repeat=3))


def mask_id(mask) -> str:
    return "mask" + "".join("1" if m else "0" for m in mask)


# --------------------------------------------------------------------------- cases

def quantize(a: Any, dtype) -> np.ndarray:
    return np.asarray(a, dtype=np.float64).astype(dtype)


@dataclass
class Case:
    """All arguments of one batch_norm_backward call, plus what the result must look like."""
    grad_out: np.ndarray
    input: np.ndarray
    weight: Optional[np.ndarray]
    running_mean: Optional[np.ndarray]
    running_var: Optional[np.ndarray]
    save_mean: Optional[np.ndarray]
    save_invstd: Optional[np.ndarray]
    train: bool
    eps: float = 1e-5
    output_mask: tuple = (True, True, True)
    channel_axis: int = 1
    extra: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return (self.grad_out, self.input, self.weight, self.running_mean, self.running_var,
                self.save_mean, self.save_invstd, self.train, self.eps, self.output_mask)

    def kwargs(self) -> dict:
        return {"channel_axis": self.channel_axis}

    @property
    def param_grad_dtype(self) -> np.dtype:
        """dtype grad_weight / grad_bias must have (PyTorch's rule)."""
        if self.weight is not None:
            return self.weight.dtype
        stats = [self.save_mean, self.save_invstd] if self.train else []
        stats += [self.running_mean, self.running_var]
        for s in stats:
            if s is not None and s.dtype not in HALF and self.input.dtype in HALF:
                return F32
        return self.input.dtype

    def stats_f64(self) -> tuple[np.ndarray, np.ndarray]:
        """The mean / invstd the backward uses, in float64 (from the reference's rule)."""
        from bngrad import reference
        if self.train and self.save_mean is not None and self.save_invstd is not None:
            return self.save_mean.astype(np.float64), self.save_invstd.astype(np.float64)
        if self.train:
            mean, var = reference.batch_norm_moments(self.input, channel_axis=self.channel_axis)
            return mean, 1.0 / np.sqrt(var + self.eps)
        return (self.running_mean.astype(np.float64),
                1.0 / np.sqrt(self.running_var.astype(np.float64) + self.eps))

    def scales(self) -> dict:
        """Term scales of each backward output (see tolerances.py)."""
        from tolerances import backward_scales
        mean, invstd = self.stats_f64()
        return backward_scales(self.grad_out, self.input, self.weight, mean, invstd,
                               self.channel_axis)


def make_data(shape, channel_axis: int, rng: np.random.Generator, dtype, *,
              offset: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """(grad_out, input) in C order, quantized to ``dtype``; channels have different scales."""
    ndim = len(shape)
    ax = channel_axis % ndim
    n_channels = shape[ax]
    bshape = [1] * ndim
    bshape[ax] = n_channels
    scale = rng.uniform(0.5, 2.0, n_channels).reshape(bshape)
    shift = rng.uniform(-1.0, 1.0, n_channels).reshape(bshape) * offset
    x = rng.standard_normal(shape) * scale + shift
    dy = rng.standard_normal(shape)
    return quantize(dy, dtype), quantize(x, dtype)


def make_case(shape, channel_axis: int = 1, variant: str | DtypeVariant = "float32",
              mode: str = "train", with_weight: bool = True, output_mask=(True, True, True),
              layouts: tuple[str, str] = ("contig", "contig"), seed: int = 0,
              eps: float = 1e-5) -> Case:
    """A backward case: data in the given layouts, parameters and statistics per ``mode``."""
    v = DTYPE_VARIANT[variant] if isinstance(variant, str) else variant
    rng = np.random.default_rng(seed)
    ax = channel_axis % len(shape)
    n_channels = shape[ax]
    dy, x = make_data(shape, channel_axis, rng, v.data)
    weight = quantize(rng.uniform(-1.5, 1.5, n_channels), v.param) if with_weight else None
    running_mean = running_var = save_mean = save_invstd = None
    if mode in ("train", "eval"):
        running_mean = quantize(rng.normal(0.0, 0.3, n_channels), v.param)
        running_var = quantize(rng.uniform(0.5, 2.0, n_channels), v.param)
    if mode == "train":
        from bngrad import reference
        mean, var = reference.batch_norm_moments(x, channel_axis=channel_axis)
        save_mean = quantize(mean, v.param)
        save_invstd = quantize(1.0 / np.sqrt(var + eps), v.param)
    in_layout, go_layout = layouts
    return Case(grad_out=to_layout(dy, go_layout, ax), input=to_layout(x, in_layout, ax),
                weight=weight, running_mean=running_mean, running_var=running_var,
                save_mean=save_mean, save_invstd=save_invstd, train=(mode != "eval"), eps=eps,
                output_mask=tuple(output_mask), channel_axis=channel_axis)


# --------------------------------------------------------------------------- PyTorch bridge

def to_torch(a: Optional[np.ndarray]):
    """A torch tensor with the same values, shape and strides (bfloat16 included); None stays."""
    import torch
    if a is None:
        return None
    a = np.asarray(a)
    if any(s < 0 for s in a.strides):
        a = np.ascontiguousarray(a)
    if a.dtype != BF16:
        return torch.from_numpy(a)
    # torch cannot import ml_dtypes arrays: go through int16 bits, keeping a dense axis order.
    order = list(memory_order(a)) + [i for i in range(a.ndim) if a.shape[i] <= 1]
    if not is_dense(a):
        order = list(range(a.ndim))
    bits = np.ascontiguousarray(np.transpose(a, order)).view(np.int16)
    return torch.from_numpy(bits).view(torch.bfloat16).permute(*np.argsort(order).tolist())


def from_torch(t) -> Optional[np.ndarray]:
    """NumPy array with the tensor's values (bfloat16 via ml_dtypes); None stays None."""
    import torch
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(BF16).copy()
    return t.contiguous().numpy().copy()


def torch_backward(case: Case):
    """torch.ops.aten.native_batch_norm_backward on the same arguments, channels moved to axis 1."""
    import torch
    ax = case.channel_axis % case.input.ndim
    mv = lambda a: np.moveaxis(a, ax, 1)  # noqa: E731
    outs = torch.ops.aten.native_batch_norm_backward(
        to_torch(mv(case.grad_out)), to_torch(mv(case.input)), to_torch(case.weight),
        to_torch(case.running_mean), to_torch(case.running_var), to_torch(case.save_mean),
        to_torch(case.save_invstd), case.train, case.eps, list(case.output_mask))
    gi, gw, gb = (from_torch(o) if m else None for o, m in zip(outs, case.output_mask))
    if gi is not None:
        gi = np.moveaxis(gi, 1, ax)
    return gi, gw, gb


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


@pytest.fixture
def native_convolutions():
    """PyTorch's own convolutions instead of oneDNN's, for tests whose models (the oracle as
    much as bngrad's) hold a 1x1 stride-2 convolution: with torch 2.13 on a CPU without
    AVX-512, oneDNN's backward of one on channels_last data returns weight gradients off by
    O(10) on 2 threads and corrupts the heap on 1 (measured on an AVX2 AMD EPYC; either
    memory format of the incoming gradient)."""
    import torch

    before = torch.backends.mkldnn.enabled  # (not mkldnn.flags(): it warns about TF32)
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = before


# --------------------------------------------------------------------------- shared checks

def check_backward(case: Case, result=None, *, num_threads=None) -> tuple:
    """Run bngrad.batch_norm_backward on ``case`` (unless ``result`` is given) and hold it to
    bngrad.reference: None where masked off, dtypes, shapes, grad_input's layout, values within
    the tolerance table, and inputs left untouched. Returns the result."""
    import bngrad
    from bngrad import reference
    from tolerances import assert_close, assert_dtype

    arrays = [a for a in case.args() if isinstance(a, np.ndarray)]
    before = [a.copy() for a in arrays]
    if result is None:
        result = bngrad.batch_norm_backward(*case.args(), **case.kwargs(),
                                            num_threads=num_threads)
    assert isinstance(result, tuple) and len(result) == 3, f"expected a 3-tuple, got {result!r}"
    for a, b in zip(arrays, before):
        assert np.array_equal(a, b,
                              equal_nan=True), "an argument was modified"
    expected = reference.batch_norm_backward(*case.args(), **case.kwargs())
    scales = case.scales()
    names = ("grad_input", "grad_weight", "grad_bias")
    for name, got, ref, on in zip(names, result, expected, case.output_mask):
        if not on:
            assert got is None, f"{name}: masked off by output_mask, expected None, got {type(got)}"
            continue
        if name == "grad_input":
            assert_dtype(got, case.input.dtype, name)
            assert got.shape == case.input.shape, f"{name}: shape {got.shape}"
            assert_output_layout(got, case.input)
            scale = scales[name] if case.train else None
        else:
            assert_dtype(got, case.param_grad_dtype, name)
            assert got.shape == (case.input.shape[case.channel_axis],), f"{name}: shape {got.shape}"
            scale = scales[name]
        assert_close(got, ref, sum_dtype(got.dtype, case.input.dtype), name, scale=scale)
    return result


def sum_dtype(result_dtype: Any, input_dtype: Any) -> np.dtype:
    """Whose tolerance a per-channel sum's result meets: its own dtype's, but at most float32's
    for half inputs, whose terms are summed in float32 blocks (DESIGN.md's numerics policy;
    kernels._ops.block_terms) even where the result is float64 (float64 parameters)."""
    if np.dtype(input_dtype).itemsize == 2 and np.dtype(result_dtype) == np.float64:
        return np.dtype(np.float32)
    return np.dtype(result_dtype)


# --------------------------------------------------------------------------- child processes

#: The dtype variants of the child processes' matrices, in two halves run side by side: most of
#: a child's time is Numba compiling each variant's kernels (single-threaded), so two children
#: on different dtypes take about half the time of one on a cold cache, with the same cases.
CHILD_PARTS = (("float32", "float16"), ("bfloat16-p32", "float64"))


def run_child(module: str, out_dir, env: dict, timeout: float) -> dict:
    """Run ``<module>.child_main(out, variants)`` (a test module in tests/) in fresh Pythons with
    ``env`` (e.g. a larger NUMBA_NUM_THREADS than this process's pool), one per part of
    CHILD_PARTS at the same time, and return their JSON reports merged: the ``cases`` of all,
    the ``launched`` counts added, and every other item, which each part reports the same."""
    here = os.path.dirname(os.path.abspath(__file__))
    procs = []
    for k, variants in enumerate(CHILD_PARTS):
        out = os.path.join(str(out_dir), f"report-{k}.json")
        code = (f"import sys; sys.path.insert(0, {here!r}); "
                f"import {module}; {module}.child_main({out!r}, {variants!r})")
        procs.append((out, subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    merged: dict = {}
    for out, proc in procs:
        try:
            _, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for _, p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"child failed:\n{stderr[-4000:]}"
        with open(out) as f:
            report = json.load(f)
        for key, value in report.items():
            if key == "cases":
                merged.setdefault(key, {}).update(value)
            elif key == "launched":
                counts = merged.setdefault(key, dict.fromkeys(value, 0))
                for name, n in value.items():
                    counts[name] += n
            else:
                assert merged.setdefault(key, value) == value, (key, merged[key], value)
    return merged
