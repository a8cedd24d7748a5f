"""Golden test vectors for the DSP BatchNormGrad, and comparison of a device's outputs with them.

:func:`write_vectors` draws inputs (x, dy, mean, invar, scale), computes the expected outputs
(dx, dbias, dscale) with the float64 reference, rounds them once to the output dtype, and
writes everything as raw little-endian ``.bin`` files (or one ``.npz``) plus ``manifest.json``.
:func:`compare` judges a device's outputs against them. The ``bngrad vectors`` and
``bngrad compare`` commands are thin wrappers over these functions.

Data layout: row-major ``[batch][channel]`` (channel fastest), as the DSP library reads it.

Distributions
-------------
``normal`` / ``uniform``
    Random data, per-channel offsets and spreads; in train mode mean and invar are the batch
    statistics of the stored x (``invar = 1/sqrt(var + 1e-5)``), rounded to their dtype; in
    eval mode they are nearby "running" statistics.
``exact``
    benchdnn's trick: values chosen so that nothing needs rounding. Per channel,
    ``x = mu + a*z`` with ``a`` a power of two and ``z`` = +1 for half the rows, -1 for the
    other half, so the batch mean is exactly ``mu``, the variance exactly ``a**2`` and
    ``invar = 1/a`` exactly (eps = 0). ``dy`` is a small integer times a power of two, built
    so that sum(dy) and sum(dy*xhat) are multiples of the batch: every product and every
    partial sum, in any order, is exact in float32, and the expected dx, dbias, dscale are
    exactly representable in the output dtype — the files carry no rounding error, so whatever
    error a device shows is its own. Needs an even batch (with an odd one no choice of
    values makes 1/sqrt(var) a power of two for every channel); sizes where exactness cannot
    be kept are refused with an explanation.
``offset`` / ``huge`` / ``subnormal`` / ``zerovar``
    Value regimes that break naive kernels (|mean| >> std, values near the dtype's maximum,
    subnormal dy, zero-variance channels; see :mod:`bngrad._dsp_regimes`); mean, invar and
    the default tolerances as for ``normal``.

Default tolerances (stored in the manifest, per output)
-------------------------------------------------------
An element passes when it equals the expected value (NaN for NaN, the same infinity; +0 and
-0 are equal), or, both being finite, when ``|device - expected| <= atol + rtol * |expected|``
(or, with ``ulp=U``, when they are at most U representable values apart: see
:func:`ulp_distance`). A NaN or infinity where a finite value is expected always fails.

``exact`` vectors default to exact equality (``atol = rtol = 0``): every expected value is
exactly representable and a device that accumulates in float32 lands exactly on it (with a
batch that is not a power of two, one that multiplies by a rounded ``1/m`` may land one ULP
off: judge those with ``ulp=1``). ``normal`` / ``uniform`` vectors default to
``rtol = 4 * eps`` and, per channel, ``atol_c = 4 * eps * scale_c``, where ``eps`` is the
machine epsilon of the output's dtype (float32 1.19e-7, float16 9.77e-4) and ``scale_c`` the
largest magnitude of the terms behind that output in channel c (dx: ``|invar*scale| * (|dy| +
|sum dy|/m + |xhat * sum dy*xhat|/m)``; dbias: ``sum |dy|``; dscale: ``sum |dy*xhat|``): a
result that cancels can be far smaller than the terms it came from, and no floating-point
method gets its relative error small; and one channel's large terms must not widen another's
bound. The manifest stores the largest channel's ``atol`` and ``scale``; :func:`compare`
derives each channel's from the inputs. dx's channels must also not be shifted as a whole:
the mean of a channel's errors must be within ``atol_c / 2`` (a missing term shifts every
element of a channel alike, by less than ``atol_c`` when the batch is large; not on
``exact`` vectors, where any error fails). Given ``atol``/``rtol`` or ``ulp`` apply to every
element as they are, without the mean test.
Tolerances must be finite and >= 0, whether given as arguments or read from a manifest.

Files and limits
----------------
:func:`save_vectors` refuses to replace golden vectors already in the directory unless
``overwrite=True`` (``--force``), writes every file to a temporary name in the directory and
renames it into place (an existing symlink is replaced, its target never written), and with
``overwrite=True`` removes the other format's files bngrad wrote before (only those names).
:func:`load_vectors` reads only plain file names inside the directory (no separators, no
``..``, no link leading outside it) and checks every size, dtype and shape before reading data.
Vectors hold at most :data:`MAX_ELEMENTS` (2**26) elements per (batch, channel) array; larger
sizes are refused before anything is allocated.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import numbers
import os
import secrets
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Optional, Union

import numpy as np

from . import _dsp_regimes, reference
from ._validate import boolean, positive_int
from .errors import ArgumentTypeError, ArgumentValueError

__all__ = [
    "ComparisonReport",
    "GoldenVectors",
    "OutputComparison",
    "UnusableInputError",
    "compare",
    "compare_output",
    "default_tolerances",
    "expected_outputs",
    "ElementError",
    "ExistingVectorsError",
    "MAX_ELEMENTS",
    "generate",
    "load_vectors",
    "read_output",
    "save_vectors",
    "ulp_distance",
    "write_vectors",
]

DTYPES: dict[str, np.dtype] = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}
DISTRIBUTIONS = ("normal", "uniform", "exact") + tuple(_dsp_regimes.REGIMES)
FORMATS = ("bin", "npz")
INPUTS = ("x", "dy", "mean", "invar", "scale")
OUTPUTS = ("dx", "dbias", "dscale")
EPS = 1e-5                      # turns the variance into invar for normal/uniform data
TOLERANCE_FACTOR = 4.0          # atol = 4*eps*scale, rtol = 4*eps
MANIFEST = "manifest.json"
NPZ_FILE = "vectors.npz"
FORMAT_ID = "bngrad-golden-vectors/1"
LAYOUT = "row-major [batch][channel] (channel fastest), little-endian IEEE 754, no header"
MAX_ELEMENTS = 2 ** 26          # per (batch, channel) array: 256 MiB of float32, ~5 GiB to build
MAX_MANIFEST_BYTES = 1 << 20    # a real manifest is ~4 KiB
SHOW = 10                       # failing elements listed by default
# every file name bngrad writes into a vectors directory, per format
FILES = {"bin": tuple(f"{name}.bin" for name in INPUTS + OUTPUTS), "npz": (NPZ_FILE,)}

PathLike = Union[str, Path]


class UnusableInputError(ArgumentValueError):
    """Vectors or device outputs that cannot be compared at all (missing, wrong size, corrupt)."""


class ExistingVectorsError(ArgumentValueError):
    """The output directory already holds golden vectors and ``overwrite`` was not given."""

    def __init__(self, message: str, directory: Path, present: list[str]) -> None:
        super().__init__(message)
        self.directory = directory
        self.present = present


@dataclass
class GoldenVectors:
    """One set of golden vectors: inputs and expected outputs in their storage dtypes.

    ``arrays`` maps x, dy, dx to (batch, channel) arrays and mean, invar, scale, dbias,
    dscale to (channel,) arrays; ``tolerances`` maps each output to its default
    ``{"atol", "rtol", "scale"}``.
    """

    batch: int
    channel: int
    dtype: str
    param_dtype: str
    is_train: bool
    seed: int
    distribution: str
    eps: float
    arrays: dict[str, np.ndarray]
    tolerances: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        return {name: self.arrays[name] for name in INPUTS}

    @property
    def expected(self) -> dict[str, np.ndarray]:
        return {name: self.arrays[name] for name in OUTPUTS}

    def output_dtype(self, name: str) -> np.dtype:
        return self.arrays[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return (self.batch, self.channel) if name in ("x", "dy", "dx") else (self.channel,)


# --------------------------------------------------------------------------- generation

def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ArgumentValueError(f"{name}: expected one of {', '.join(allowed)}, got {value!r}")
    return value


def expected_outputs(x: Any, dy: Any, mean: Any, invar: Any, scale: Any, train: bool
                     ) -> dict[str, np.ndarray]:
    """dx, dbias, dscale in float64 from :mod:`bngrad.reference`, for (batch, channel) data.

    Train mode is PyTorch's backward with ``save_mean=mean, save_invstd=invar``; eval mode is
    ``dx = dy * invar * scale`` with the sums of the same reduce step.

    Parameters
    ----------
    x, dy : array_like (batch, channel)
    mean, invar, scale : array_like (channel,)
    train : bool
        is_train: ``mean``/``invar`` are the batch's statistics (True) or running ones (False).

    Returns
    -------
    dict
        ``{"dx": (batch, channel), "dbias": (channel,), "dscale": (channel,)}``, float64.
    """
    if train:
        dx, dscale, dbias = reference.batch_norm_backward(
            dy, x, scale, None, None, mean, invar, True)
    else:
        _, _, dscale, dbias = reference.batch_norm_backward_reduce(
            dy, x, mean, invar, scale, False, True, True)
        f64 = lambda a: np.asarray(a).astype(np.float64)  # noqa: E731
        dx = f64(dy) * f64(invar) * f64(scale)
    return {"dx": dx, "dbias": dbias, "dscale": dscale}


def _channel_term_scales(arrays: Mapping[str, np.ndarray], train: bool
                         ) -> dict[str, np.ndarray]:
    """Per channel, the largest magnitude of the terms behind each output, float64 (channel,)
    (see the module docstring; terms that are not finite are left out)."""
    x, dy, mean, invar, scale = (np.asarray(arrays[n]).astype(np.float64) for n in INPUTS)
    m = x.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        xhat = (x - mean) * invar
        dy_xhat = np.abs(dy * xhat)
        dx_terms = np.abs(dy)
        if train:
            dx_terms = dx_terms + np.abs(dy.sum(0)) / m + np.abs(xhat * (dy * xhat).sum(0)) / m
        dx_terms = dx_terms * np.abs(invar * scale)

    def finite(a: np.ndarray) -> np.ndarray:
        return np.where(np.isfinite(a), a, 0.0)

    return {"dx": finite(dx_terms).max(axis=0, initial=0.0), "dbias": finite(np.abs(dy).sum(0)),
            "dscale": finite(dy_xhat.sum(0))}


def _term_scales(arrays: Mapping[str, np.ndarray], train: bool) -> dict[str, float]:
    """Largest magnitude of the terms behind each output over all channels (the manifest's
    ``scale``)."""
    return {name: float(scales.max(initial=0.0))
            for name, scales in _channel_term_scales(arrays, train).items()}


def default_tolerances(arrays: Mapping[str, np.ndarray], train: bool, *, exact: bool = False
                       ) -> dict[str, dict[str, float]]:
    """Per output: ``{"atol", "rtol", "scale"}`` (see the module docstring).

    ``atol = 4*eps*scale`` and ``rtol = 4*eps`` with ``eps`` the machine epsilon of the output's
    dtype; ``atol = rtol = 0`` (exact equality) when ``exact`` (the ``exact`` distribution).
    """
    scales = _term_scales(arrays, train)
    tolerances = {}
    for name in OUTPUTS:
        eps = 0.0 if exact else float(np.finfo(arrays[name].dtype).eps)
        tolerances[name] = {"atol": TOLERANCE_FACTOR * eps * scales[name],
                            "rtol": TOLERANCE_FACTOR * eps, "scale": scales[name]}
    return tolerances


def _draw_random(rng: np.random.Generator, batch: int, channel: int, dist: str
                 ) -> tuple[dict[str, np.ndarray], float]:
    """x, dy, scale in float64 and how to derive mean/invar (normal/uniform data)."""
    mu = rng.uniform(-1.0, 1.0, channel)
    sigma = rng.uniform(0.5, 2.0, channel)
    if dist == "normal":
        x = mu + sigma * rng.standard_normal((batch, channel))
        dy = rng.standard_normal((batch, channel))
    else:
        x = mu + sigma * rng.uniform(-1.0, 1.0, (batch, channel))
        dy = rng.uniform(-1.0, 1.0, (batch, channel))
    scale = rng.uniform(0.5, 1.5, channel) * rng.choice([-1.0, 1.0], channel)
    return {"x": x, "dy": dy, "scale": scale}, EPS


def _statistics(rng: np.random.Generator, x: np.ndarray, train: bool, eps: float
                ) -> tuple[np.ndarray, np.ndarray]:
    """Batch statistics of the stored x (train) or nearby running statistics (eval)."""
    mean, var = reference.batch_norm_moments(x)
    if not train:
        mean = mean + 0.1 * np.sqrt(var) * rng.standard_normal(mean.shape)
        var = var * rng.uniform(0.8, 1.25, var.shape)
    return mean, 1.0 / np.sqrt(var + eps)


def _signed_pairs(rng: np.random.Generator, n: int, channel: int) -> np.ndarray:
    """(n, channel) small integers in [-3, 3] summing to 0 down each column, rows shuffled."""
    t = rng.integers(-3, 4, (n // 2, channel))
    cols = [t, -t] + ([np.zeros((1, channel), dtype=t.dtype)] if n % 2 else [])
    return rng.permuted(np.concatenate(cols, axis=0), axis=0)


def _draw_exact(rng: np.random.Generator, batch: int, channel: int, train: bool
                ) -> dict[str, np.ndarray]:
    """All five inputs in float64, exactly representable in float16 (see the module docstring)."""
    if batch % 2:
        raise ArgumentValueError(
            f"batch: --dist exact needs an even batch (half the rows at mean + a, half at "
            f"mean - a, so that mean, variance and invar are exact), got {batch}; use an even "
            "batch or --dist normal")
    half = batch // 2
    a = 2.0 ** rng.integers(-2, 2, channel)                    # spread: 1/4 .. 2
    mu = rng.integers(-8, 9, channel) / 4.0                    # mean: -2 .. 2 in steps of 1/4
    z = rng.permuted(np.repeat([[1.0], [-1.0]], half, axis=0) * np.ones(channel), axis=0)
    x = mu + a * z
    # dy = q*(u + r) where z = +1 and q*(v + s) where z = -1, r and s summing to zero: then
    # sum(dy) = q*half*(u + v) and sum(dy*z) = q*half*(u - v), multiples of the batch for u, v
    # of the same parity, so sum/m is exact too.
    q = 2.0 ** rng.integers(-3, 1, channel)
    u = rng.integers(-3, 4, channel)
    v = u + 2 * rng.integers(-1, 2, channel)                   # same parity as u
    noise_pos, noise_neg = _signed_pairs(rng, half, channel), _signed_pairs(rng, half, channel)
    dy = np.empty((batch, channel))
    # per column: the z = +1 rows in order get noise_pos, the z = -1 rows noise_neg
    rows = np.argsort(z < 0, axis=0, kind="stable")
    np.put_along_axis(dy, rows[:half], q * (u + noise_pos), axis=0)
    np.put_along_axis(dy, rows[half:], q * (v + noise_neg), axis=0)
    scale = rng.integers(2, 8, channel) / 4.0 * rng.choice([-1.0, 1.0], channel)  # 0.5 .. 1.75
    if train:
        mean, invar = mu, 1.0 / a
    else:  # running statistics: near, but not equal to, the batch's; still exact
        mean = mu + a * rng.integers(-2, 3, channel) / 8.0
        invar = 2.0 ** rng.integers(-1, 2, channel) / a
    return {"x": x, "dy": dy, "mean": mean, "invar": invar, "scale": scale}


def _lowest_bit(values: np.ndarray) -> np.ndarray:
    """Per column of float64 ``values``: the largest power of two dividing every nonzero value
    (1.0 for a column of zeros)."""
    mantissa, exponent = np.frexp(values)
    ints = np.abs(mantissa * 2.0 ** 53).astype(np.int64)
    trailing = np.log2(np.maximum(ints & -ints, 1).astype(np.float64)).astype(np.int64)
    lowest = np.where(values != 0, exponent - 53 + trailing, np.iinfo(np.int64).max)
    lowest = lowest.min(axis=0)
    return np.ldexp(1.0, np.where(lowest == np.iinfo(np.int64).max, 0, lowest))


def _check_exact(inputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray],
                 dtypes: Mapping[str, np.dtype], train: bool, batch: int) -> None:
    """Prove the exact distribution's promise for these sizes, or refuse plainly."""
    x, dy, mean, invar = (inputs[n] for n in ("x", "dy", "mean", "invar"))
    if train:
        true_mean, true_var = reference.batch_norm_moments(x)
        assert np.array_equal(true_mean, mean) and np.array_equal(invar * invar * true_var,
                                                                  np.ones_like(invar))
    # Every term of the two sums is a multiple of a unit g and exact in float32, and the sum of
    # their magnitudes stays below 2**24 g: then every partial sum, in any order, is exact.
    for what, terms in (("sum(dy)", dy), ("sum(dy*xhat)", dy * (x - mean) * invar)):
        if (not np.array_equal(terms.astype(np.float32).astype(np.float64), terms)
                or (np.abs(terms).sum(axis=0) > 2.0 ** 24 * _lowest_bit(terms)).any()):
            raise ArgumentValueError(
                f"batch: --dist exact cannot keep {what} exact in float32 for batch={batch}; "
                "use a smaller batch or --dist normal")
    for name in OUTPUTS:
        with np.errstate(over="ignore"):  # an overflow to inf is reported below
            rounded = expected[name].astype(dtypes[name]).astype(np.float64)
        if not np.array_equal(rounded, expected[name]):
            raise ArgumentValueError(
                f"batch: --dist exact cannot make {name} exactly representable in "
                f"{dtypes[name].name} for batch={batch} (the sums grow with the batch); use a "
                "smaller batch, --param-dtype fp32, or --dist normal")


def _check_size(batch: int, channel: int) -> None:
    if batch * channel > MAX_ELEMENTS:
        raise ArgumentValueError(
            f"batch, channel: batch*channel = {batch}*{channel} = {batch * channel} elements, "
            f"more than golden vectors hold (at most 2**26 = {MAX_ELEMENTS} per array)")


def generate(batch: int, channel: int, dtype: str = "fp32", *, train: bool = True,
             seed: int = 0, dist: str = "normal", param_dtype: Optional[str] = None
             ) -> GoldenVectors:
    """Draw inputs and compute expected outputs (no files written).

    Parameters
    ----------
    batch, channel : int > 0
    dtype : "fp32" or "fp16"
        x, dy, dx (fp32 for ``fp_batch_norm_grad_*``, fp16 for ``hp_batch_norm_grad_*``).
    train : bool
        is_train: batch statistics (True) or running statistics (False).
    seed : int
        Seed of NumPy's default generator; the same arguments give the same bytes.
    dist : "normal", "uniform" or "exact"
        See the module docstring.
    param_dtype : "fp32" or "fp16", optional
        mean, invar, scale, dbias, dscale; default ``dtype``. fp16 data may use fp32 here.

    Returns
    -------
    GoldenVectors

    Raises
    ------
    ArgumentValueError, ArgumentTypeError
        A bad argument, ``batch*channel`` above :data:`MAX_ELEMENTS`, or ``dist="exact"`` for
        sizes it cannot keep exact (an odd batch, or sums too large for the dtype); the
        message says which and what to do.
    """
    batch = positive_int("batch", batch)
    channel = positive_int("channel", channel)
    _check_size(batch, channel)
    dtype = _choice("dtype", dtype, tuple(DTYPES))
    param_dtype = _choice("param_dtype", dtype if param_dtype is None else param_dtype,
                          tuple(DTYPES))
    if dtype == "fp32" and param_dtype != "fp32":
        raise ArgumentValueError("param_dtype: fp32 data (fp_batch_norm_grad) takes fp32 "
                                 f"per-channel buffers only, got {param_dtype!r}")
    dist = _choice("dist", dist, DISTRIBUTIONS)
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise ArgumentValueError(f"seed: expected an int >= 0, got {seed!r}")
    train = bool(train)
    data_t, param_t = DTYPES[dtype], DTYPES[param_dtype]
    dtypes = {"x": data_t, "dy": data_t, "dx": data_t, "mean": param_t, "invar": param_t,
              "scale": param_t, "dbias": param_t, "dscale": param_t}

    rng = np.random.default_rng(int(seed))
    if dist == "exact":
        eps = 0.0
        drawn = _draw_exact(rng, batch, channel, train)
        stored = {n: drawn[n].astype(dtypes[n]) for n in INPUTS}
        assert all(np.array_equal(stored[n], drawn[n]) for n in INPUTS)  # exact by construction
    else:
        if dist in _dsp_regimes.REGIMES:   # value regimes that break naive kernels
            drawn, eps = _dsp_regimes.draw(rng, batch, channel, dist, data_t), EPS
        else:
            drawn, eps = _draw_random(rng, batch, channel, dist)
        stored = {n: drawn[n].astype(dtypes[n]) for n in ("x", "dy", "scale")}
        mean, invar = _statistics(rng, stored["x"].astype(np.float64), train, eps)
        stored["mean"], stored["invar"] = mean.astype(param_t), invar.astype(param_t)

    # Expected outputs from the values actually stored, rounded once to their dtype.
    inputs64 = {n: stored[n].astype(np.float64) for n in INPUTS}
    expected = expected_outputs(inputs64["x"], inputs64["dy"], inputs64["mean"],
                                inputs64["invar"], inputs64["scale"], train)
    if dist == "exact":
        _check_exact(inputs64, expected, dtypes, train, batch)
    with np.errstate(over="ignore"):
        arrays = {**stored, **{n: expected[n].astype(dtypes[n]) for n in OUTPUTS}}
    return GoldenVectors(batch=batch, channel=channel, dtype=dtype, param_dtype=param_dtype,
                         is_train=train, seed=int(seed), distribution=dist, eps=eps,
                         arrays=arrays,
                         tolerances=default_tolerances(arrays, train, exact=dist == "exact"))


# --------------------------------------------------------------------------- files

def _little_endian(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manifest(v: GoldenVectors, file_format: str) -> dict[str, Any]:
    from . import __version__
    prefix = "fp" if v.dtype == "fp32" else "hp"
    arrays = {}
    for name in INPUTS + OUTPUTS:
        a = v.arrays[name]
        entry = {"role": "input" if name in INPUTS else "expected",
                 "file": f"{name}.bin" if file_format == "bin" else NPZ_FILE,
                 "dtype": a.dtype.name, "shape": list(a.shape),
                 "sha256": _sha256(_little_endian(a).tobytes())}
        if file_format == "npz":
            entry["key"] = name
        arrays[name] = entry
    if v.distribution == "exact":
        defaults = "exact data: atol = rtol = 0 (exact equality)"
    else:
        defaults = (f"rtol = {TOLERANCE_FACTOR:g}*eps, atol = {TOLERANCE_FACTOR:g}*eps*scale, eps "
                    "the machine epsilon of the output dtype, scale the largest magnitude of "
                    "the terms behind the output in each channel (the largest channel's here; "
                    "dx also fails where a channel's mean error exceeds half its atol)")
    return {
        "format": FORMAT_ID,
        "operator": "BatchNormGrad",
        "functions": [f"{prefix}_batch_norm_grad_s", f"{prefix}_batch_norm_grad_p"],
        "bngrad_version": __version__,
        "batch": v.batch, "channel": v.channel, "is_train": int(v.is_train),
        "dtype": v.dtype, "param_dtype": v.param_dtype,
        "seed": v.seed, "distribution": v.distribution, "eps": v.eps,
        "layout": LAYOUT, "file_format": file_format,
        "arrays": arrays,
        "tolerances": v.tolerances,
        "tolerance_rule": ("an element passes when it equals the expected value or, both "
                           "finite, when |device - expected| <= atol + rtol*|expected|; "
                           + defaults),
    }


def _existing_vectors(out: Path, overwrite: bool) -> None:
    """Refuse a directory that already holds bngrad's files unless ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ArgumentValueError(f"out_dir: {out} exists and is not a directory")
    present = [n for n in (MANIFEST,) + FILES["bin"] + FILES["npz"] if os.path.lexists(out / n)]
    for name in present:   # os.replace cannot put a file where a directory is
        if (out / name).is_dir() and not (out / name).is_symlink():
            raise ArgumentValueError(f"out_dir: {out / name} is a directory; bngrad writes a "
                                     "file by that name")
    if present and not overwrite:
        raise ExistingVectorsError(
            f"out_dir: {out} already holds golden vectors ({', '.join(present)}); pass "
            "overwrite=True to replace them", out, present)


def _write_atomic(out: Path, name: str, write: Callable[[BinaryIO], object]) -> None:
    """Write a new file under a temporary name in ``out``, then rename it to ``name``.

    The rename replaces whatever ``out/name`` was (a symlink included) and never writes through
    it; O_EXCL | O_NOFOLLOW make sure the temporary file is a new one.
    """
    tmp = out / f".{name}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) \
        | getattr(os, "O_BINARY", 0)
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, out / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save_vectors(vectors: GoldenVectors, out_dir: PathLike, file_format: str = "bin", *,
                 overwrite: bool = False) -> dict[str, Any]:
    """Write ``vectors`` under ``out_dir`` (created if needed); returns the manifest.

    Parameters
    ----------
    vectors : GoldenVectors
    out_dir : str or Path
    file_format : "bin" or "npz"
        Raw little-endian ``.bin`` files, one per array, or one ``vectors.npz``.
    overwrite : bool
        Replace golden vectors already in ``out_dir`` (``manifest.json``, the ``.bin`` files,
        ``vectors.npz``: the names bngrad writes, nothing else), and remove the other
        format's files so that none is left beside a manifest that does not describe it.

    Every file is written under a temporary name in ``out_dir`` and renamed into place, so an
    existing symlink is replaced by the file and its target is never written.

    Raises
    ------
    ExistingVectorsError
        ``out_dir`` holds any of those files and ``overwrite`` is False (nothing is written).
    ArgumentValueError
        ``out_dir`` is not a directory, or one of the names is a directory.
    OSError
        The file system refused.
    """
    file_format = _choice("format", file_format, FORMATS)
    if not isinstance(vectors, GoldenVectors):
        raise ArgumentTypeError(f"vectors: expected GoldenVectors, got {type(vectors).__name__}")
    overwrite = boolean("overwrite", overwrite)
    if isinstance(out_dir, (str, bytes)) and not out_dir:  # (Path("") is the current folder)
        raise ArgumentValueError("out_dir: expected a folder, got an empty path")
    out = Path(out_dir)
    _existing_vectors(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(vectors, file_format)
    arrays: dict[str, Any] = {name: _little_endian(vectors.arrays[name])
                              for name in INPUTS + OUTPUTS}
    if file_format == "bin":
        for name, a in arrays.items():
            _write_atomic(out, f"{name}.bin", a.tofile)
    else:
        _write_atomic(out, NPZ_FILE, lambda f: np.savez(f, **arrays))
        manifest["archive_sha256"] = _file_sha256(out / NPZ_FILE)
    for name in FILES["npz" if file_format == "bin" else "bin"]:   # stale: the other format's
        stale = out / name
        if stale.is_symlink() or stale.is_file():
            stale.unlink()
    _write_atomic(out, MANIFEST, lambda f: f.write((json.dumps(manifest, indent=2) + "\n")
                                                   .encode()))
    return manifest


def write_vectors(out_dir: PathLike, batch: int, channel: int, dtype: str = "fp32", *,
                  train: bool = True, seed: int = 0, dist: str = "normal",
                  param_dtype: Optional[str] = None, file_format: str = "bin",
                  overwrite: bool = False) -> dict[str, Any]:
    """:func:`generate` then :func:`save_vectors` (what ``bngrad vectors`` does); the manifest.

    ``overwrite`` as in :func:`save_vectors` (``--force``); a directory that already holds
    vectors is refused before anything is drawn.
    """
    _choice("format", file_format, FORMATS)
    _existing_vectors(Path(out_dir), boolean("overwrite", overwrite))
    vectors = generate(batch, channel, dtype, train=train, seed=seed, dist=dist,
                       param_dtype=param_dtype)
    return save_vectors(vectors, out_dir, file_format, overwrite=overwrite)


def _inside(root: Path, name: Any, what: str) -> Path:
    """``root/name`` (resolved) for a plain file name that stays inside ``root``; else refuse."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name
            or "\0" in name or os.path.isabs(name)):
        raise UnusableInputError(
            f"{what}: file name {_short(name)} in {MANIFEST} is not a plain file name; only "
            f"files directly inside {root} are read")
    try:
        path = (root / name).resolve()
        inside = path.is_relative_to(root.resolve())
    except (OSError, RuntimeError):   # a symlink loop
        inside = False
    if not inside:
        raise UnusableInputError(f"{what}: {root / name} is a link that leads outside {root}; "
                                 "refusing to read it")
    return path


def _read_raw(what: str, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise UnusableInputError(f"{what}: file not found: {path}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnusableInputError(f"{what}: {path} is not a regular file")
    count = math.prod(shape)
    expected_bytes = count * dtype.itemsize
    if st.st_size != expected_bytes:
        raise UnusableInputError(
            f"{what}: {path} has {st.st_size} bytes, expected {expected_bytes} "
            f"({' x '.join(map(str, shape))} {dtype.name} values, little-endian, no header)")
    a = np.fromfile(path, dtype=dtype.newbyteorder("<"), count=count)
    if a.size != count:   # shrank since stat
        raise UnusableInputError(f"{what}: {path} changed while it was read")
    return a.astype(dtype).reshape(shape)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number",
               float: "a number", bool: "a boolean", type(None): "null"}


def _read_manifest(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise UnusableInputError(f"vectors: {path} is larger than {MAX_MANIFEST_BYTES} bytes; "
                                 "not a manifest bngrad wrote")
    try:
        m = json.loads(data)
    except RecursionError:
        raise UnusableInputError(f"vectors: {path} is nested too deeply to be a manifest"
                                 ) from None
    except ValueError as e:
        raise UnusableInputError(f"vectors: {path} is not valid JSON: {e}") from None
    if not isinstance(m, dict):
        raise UnusableInputError(f"vectors: {path} is not a {FORMAT_ID} manifest (it holds "
                                 f"{_JSON_TYPES.get(type(m), 'something else')}, not an object)")
    return m


def _read_npz(path: Path, members: Mapping[str, tuple[Any, np.dtype, tuple[int, ...]]]
              ) -> dict[str, np.ndarray]:
    """Arrays from ``vectors.npz``, each header checked against the manifest before its data
    is read (a header may declare any size)."""
    headers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    arrays = {}
    with zipfile.ZipFile(path) as archive:
        for name, (key, dtype, shape) in members.items():
            if not isinstance(key, str) or f"{key}.npy" not in archive.namelist():
                raise UnusableInputError(f"{name}: no array {_short(key)} in {path}")
            with archive.open(f"{key}.npy") as f:
                version = np.lib.format.read_magic(f)
                if version not in headers:
                    raise UnusableInputError(f"{name}: {path} holds it in .npy format "
                                             f"{version}, expected 1.0 or 2.0")
                got_shape, _, got_dtype = headers[version](f)
            if got_dtype.newbyteorder("=") != dtype or tuple(got_shape) != shape:
                raise UnusableInputError(f"{name}: {got_dtype}{tuple(got_shape)} in {path}, "
                                         f"manifest says {dtype}{shape}")
            with archive.open(f"{key}.npy") as f:
                arrays[name] = np.lib.format.read_array(f, allow_pickle=False).astype(dtype)
    return arrays


def _tolerance(name: str, value: Any) -> float:
    """A tolerance: a finite real number >= 0 (bool and NaN refused; -0 taken as 0)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a finite number >= 0, got {_short(value)}")
    if not (math.isfinite(float(value)) and float(value) >= 0):
        raise ArgumentValueError(f"{name}: expected a finite number >= 0, got {float(value)}")
    return float(value) + 0.0  # (-0.0 + 0.0 is 0.0: a report says atol=0, not atol=-0)


def _tolerances(name: str, value: Any) -> np.ndarray:
    """A tolerance, or a 1-D array of them (float64; 0-D for one value): finite, >= 0."""
    if not isinstance(value, np.ndarray):
        return np.asarray(_tolerance(name, value))
    if value.ndim > 1 or value.dtype.kind not in "fiu" or not (
            np.isfinite(value).all() and (value >= 0).all()):
        raise ArgumentValueError(f"{name}: expected finite numbers >= 0 in a 1-D array, got "
                                 f"{value.dtype} of shape {value.shape}")
    return value.astype(np.float64) + 0.0


def _parse_manifest(root: Path, path: Path, m: dict[str, Any]) -> GoldenVectors:
    def bad(field: str, expected: str, value: Any) -> UnusableInputError:
        return UnusableInputError(f"vectors: {path}: {field}: expected {expected}, got "
                                  f"{_short(value)}")

    if m.get("format") != FORMAT_ID:
        raise UnusableInputError(f"vectors: {path} is not a {FORMAT_ID} manifest "
                                 f"(format {_short(m.get('format'))})")
    for key in ("batch", "channel"):
        v = m.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise bad(key, "an int > 0", v)
    batch, channel = m["batch"], m["channel"]
    if batch * channel > MAX_ELEMENTS:
        raise UnusableInputError(f"vectors: {path}: batch*channel = {batch * channel}, more "
                                 f"than golden vectors hold ({MAX_ELEMENTS})")
    for key, allowed in (("dtype", tuple(DTYPES)), ("param_dtype", tuple(DTYPES)),
                         ("distribution", DISTRIBUTIONS), ("file_format", FORMATS)):
        if not isinstance(m.get(key), str) or m[key] not in allowed:
            raise bad(key, "one of " + ", ".join(allowed), m.get(key))
    if m.get("is_train") not in (0, 1) or isinstance(m.get("is_train"), float):
        raise bad("is_train", "0 or 1", m.get("is_train"))
    seed = m.get("seed")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise bad("seed", "an int >= 0", seed)
    eps = m.get("eps")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise bad("eps", "a finite number", eps)
    entries: Any = m.get("arrays")
    tolerances_in: Any = m.get("tolerances")
    for key, value, names in (("arrays", entries, INPUTS + OUTPUTS),
                              ("tolerances", tolerances_in, OUTPUTS)):
        if not isinstance(value, dict):
            raise bad(key, "an object", value)
        missing = [n for n in names if not isinstance(value.get(n), dict)]
        if missing:
            raise UnusableInputError(f"vectors: {path}: {key}: no entry (an object) for "
                                     f"{', '.join(missing)}")

    dtypes = {n: DTYPES[m["dtype"] if n in ("x", "dy", "dx") else m["param_dtype"]]
              for n in INPUTS + OUTPUTS}
    shapes = {n: (batch, channel) if n in ("x", "dy", "dx") else (channel,)
              for n in INPUTS + OUTPUTS}
    for name in INPUTS + OUTPUTS:
        entry = entries[name]
        for key, want in (("dtype", dtypes[name].name), ("shape", list(shapes[name]))):
            if entry.get(key) != want:
                raise bad(f"arrays.{name}.{key}", repr(want), entry.get(key))
        if not isinstance(entry.get("sha256"), str):
            raise bad(f"arrays.{name}.sha256", "a hex string", entry.get("sha256"))
    tolerances = {}
    for name in OUTPUTS:
        t = tolerances_in[name]
        try:
            tolerances[name] = {key: _tolerance(f"tolerances.{name}.{key}", t.get(key, default))
                                for key, default in (("atol", None), ("rtol", None),
                                                     ("scale", 0.0))}
        except (ArgumentTypeError, ArgumentValueError) as e:
            raise UnusableInputError(f"vectors: {path}: {e}") from None
        if tolerances[name]["atol"] > 0 and not tolerances[name]["scale"] > 0:
            # (compare's per-channel atol is atol * (channel's scale / scale))
            raise bad(f"tolerances.{name}.scale", "a number > 0 where atol is > 0 (atol = "
                      "4*eps*scale)", t.get("scale"))

    if m["file_format"] == "npz":
        npz_path = _inside(root, NPZ_FILE, "vectors")
        if not npz_path.is_file():
            raise UnusableInputError(f"vectors: file not found: {root / NPZ_FILE}")
        if _file_sha256(npz_path) != m.get("archive_sha256"):
            raise UnusableInputError(f"vectors: {root / NPZ_FILE} does not match its sha256 in "
                                     f"{path}; it changed since it was written")
        arrays = _read_npz(npz_path, {n: (entries[n].get("key"), dtypes[n], shapes[n])
                                      for n in INPUTS + OUTPUTS})
    else:
        arrays = {n: _read_raw(n, _inside(root, entries[n].get("file"), n), dtypes[n],
                               shapes[n]) for n in INPUTS + OUTPUTS}
    for name, a in arrays.items():
        if _sha256(_little_endian(a).tobytes()) != entries[name]["sha256"]:
            raise UnusableInputError(f"{name}: data does not match its sha256 in {path}; "
                                     "the file changed since it was written")
    return GoldenVectors(batch=batch, channel=channel, dtype=m["dtype"],
                         param_dtype=m["param_dtype"], is_train=bool(m["is_train"]),
                         seed=seed, distribution=m["distribution"], eps=float(eps),
                         arrays=arrays, tolerances=tolerances)


def load_vectors(directory: PathLike) -> GoldenVectors:
    """Read vectors written by :func:`save_vectors`, checking sizes and sha256 of every array.

    Only plain file names directly inside ``directory`` are read (a manifest naming
    ``../x`` or ``/etc/x``, or a symlink leading outside, is refused), and every field,
    dtype, shape and tolerance is checked before any data is read.

    Raises
    ------
    UnusableInputError
        Missing or unreadable manifest or file, wrong size, or a checksum that does not match.
    """
    root = Path(directory)
    if not root.is_dir():
        raise UnusableInputError(f"vectors: {root} is not a directory (write one with "
                                 "`bngrad vectors ... --out DIR`)")
    path = _inside(root, MANIFEST, "vectors")
    if not path.is_file():
        raise UnusableInputError(f"vectors: no {MANIFEST} in {root} (write one with "
                                 "`bngrad vectors ... --out DIR`)")
    try:
        return _parse_manifest(root, path, _read_manifest(path))
    except UnusableInputError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
            OSError, EOFError, zipfile.BadZipFile) as e:
        raise UnusableInputError(f"vectors: cannot read {root}: {type(e).__name__}: {e}") from e


def read_output(path: PathLike, vectors: GoldenVectors, name: str) -> np.ndarray:
    """A device's output ``name`` (dx, dbias or dscale): raw little-endian, the expected's dtype."""
    _choice("output", name, OUTPUTS)
    return _read_raw(name, Path(path), vectors.output_dtype(name), vectors.shape(name))


# --------------------------------------------------------------------------- comparison

def _ordered(a: np.ndarray) -> np.ndarray:
    """float16/float32 bit patterns as int64, monotonic in value: sign-magnitude to integer.

    Non-negative values keep their bits, negative ones become ``-(bits & magnitude mask)``;
    +0 and -0 both map to 0, adjacent representable values to adjacent integers.
    """
    bits = np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}").astype(np.int64)
    sign = np.int64(1) << (8 * a.dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


def ulp_distance(expected: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Error in ULPs: how many representable values of the dtype lie between two values.

    Counted on ordered bit patterns: for a float16 / float32 value with bits ``b`` (uint16 /
    uint32) the key is ``b`` when the sign bit is clear and ``-(b & 0x7fff...)`` when it is
    set; the distance is ``|key(got) - key(expected)|``. So one step toward zero and one step
    away are both 1, +0 and -0 are 0 apart, and the smallest subnormal is 1 from zero.
    Equal values (the same infinity, NaN and NaN) are 0 apart; otherwise, where either is NaN
    or infinite, the distance is ``inf``.

    Parameters
    ----------
    expected, got : numpy.ndarray
        Same float16 or float32 dtype, same shape.

    Returns
    -------
    numpy.ndarray
        float64, the same shape (integers, exact up to 2**53, or inf).
    """
    expected, got = np.asarray(expected), np.asarray(got)
    if expected.dtype != got.dtype or expected.dtype not in DTYPES.values():
        raise ArgumentTypeError(f"ulp_distance: expected two float16 or two float32 arrays, got "
                                f"{expected.dtype} and {got.dtype}")
    if expected.shape != got.shape:
        raise ArgumentValueError(f"ulp_distance: shapes differ: {expected.shape} and {got.shape}")
    expected, got = expected.astype(expected.dtype.newbyteorder("=")), got.astype(
        got.dtype.newbyteorder("="))
    distance = np.abs(_ordered(got) - _ordered(expected)).astype(np.float64)
    finite = np.isfinite(expected) & np.isfinite(got)
    same = (expected == got) | (np.isnan(expected) & np.isnan(got))
    return np.where(same, 0.0, np.where(finite, distance, np.inf))


@dataclass(frozen=True)
class ElementError:
    """One element of an output: where it is, what was expected, what the device gave."""

    index: tuple[int, ...]         # (batch, channel) for dx, (channel,) for dbias / dscale
    dtype: str                     # "float16" or "float32"
    expected: float
    got: float
    expected_bits: int             # the raw IEEE 754 bits
    got_bits: int
    abs_err: float                 # |got - expected|, inf where either is NaN/inf and they differ
    rel_err: Optional[float]       # abs_err / |expected|; None where expected is 0
    ulp: float                     # ulp_distance(expected, got)

    def where(self) -> str:
        if len(self.index) == 2:
            return f"batch {self.index[0]}, channel {self.index[1]}"
        return f"channel {self.index[0]}"

    def _value(self, value: float, bits: int) -> str:
        digits = 2 * np.dtype(self.dtype).itemsize
        # the shortest decimal that reads back as this value in its dtype, and its bits
        return f"{str(np.dtype(self.dtype).type(value))} (0x{bits:0{digits}x})"

    def cells(self) -> tuple[str, ...]:
        """where, expected, got (decimal and hex bits), abs err, rel err, ULP: report cells."""
        rel = "-" if self.rel_err is None else f"{self.rel_err:.3e}"
        return (self.where(), self._value(self.expected, self.expected_bits),
                self._value(self.got, self.got_bits), f"{self.abs_err:.3e}", rel,
                f"{self.ulp:.0f}")


@dataclass
class OutputComparison:
    """How one output compares with its expected values.

    ``max_rel_err`` is over the elements whose expected value is not 0 (0.0 when there are
    none): relative to 0 there is no relative error, and ``max_abs_err`` and ``max_ulp_err``
    show those. ``worst`` is the element furthest beyond its tolerance (largest
    ``|err| - (atol + rtol*|expected|)``, or ULPs beyond ``ulp``; the first in row-major order
    on ties), None when every element equals its expected value; ``failures`` the first
    failing elements in row-major order (as many as ``show`` asked), ``over`` how many fail.
    """

    name: str
    count: int
    max_abs_err: float
    max_rel_err: float
    max_ulp_err: float
    over: int                                  # elements beyond tolerance
    first_over: Optional[tuple[int, ...]]      # (batch, channel) for dx, (channel,) otherwise
    criterion: str                             # the tolerance applied, in words
    worst: Optional[ElementError] = None
    failures: list[ElementError] = field(default_factory=list)
    shifted: int = 0                           # dx: channels shifted as a whole (mean_tol)
    first_shifted: Optional[int] = None        # the first such channel
    shift: float = 0.0                         # its mean error over the batch
    shift_tol: float = 0.0                     # and what it was allowed

    @property
    def passed(self) -> bool:
        return self.over == 0 and self.shifted == 0

    def where(self) -> str:
        if self.first_over is None:
            return "-"
        if len(self.first_over) == 2:
            return f"batch {self.first_over[0]}, channel {self.first_over[1]}"
        return f"channel {self.first_over[0]}"


def _table(rows: list[tuple[str, ...]], indent: str = "") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [(indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths))).rstrip()
            for row in rows]


@dataclass
class ComparisonReport:
    """The result of :func:`compare`: one :class:`OutputComparison` per output compared."""

    outputs: list[OutputComparison]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def format(self) -> str:
        """The summary table, then per output its worst element and first failures."""
        rows: list[tuple[str, ...]] = [("output", "elements", "max abs err", "max rel err",
                                        "max ULP", "over tol", "first over tol", "tolerance")]
        for o in self.outputs:
            rows.append((o.name, str(o.count), f"{o.max_abs_err:.3e}", f"{o.max_rel_err:.3e}",
                         f"{o.max_ulp_err:.4g}", str(o.over), o.where(), o.criterion))
        lines = _table(rows)
        head = ("", "where", "expected (bits)", "got (bits)", "abs err", "rel err", "ULP")
        for o in self.outputs:
            if o.worst is None:     # every element equals its expected value
                continue
            if o.passed:
                lines.append(f"{o.name}: worst element (every element within tolerance):")
            else:
                lines.append(f"{o.name}: worst element, and the first {len(o.failures)} of "
                             f"{o.over} over tolerance (row-major order):")
            table = [head, ("worst",) + o.worst.cells()]
            table += [(f"#{i}",) + e.cells() for i, e in enumerate(o.failures, 1)]
            lines += _table(table, "  ")
        for o in self.outputs:
            if o.shifted:
                lines.append(
                    f"{o.name}: {o.shifted} channel(s) shifted as a whole: the mean error over "
                    f"the batch in channel {o.first_shifted} is {o.shift:.3e}, beyond "
                    f"{o.shift_tol:.3e} (half its atol): a term missing or wrong in that "
                    "channel's formula, not rounding")
        return "\n".join(lines + ["PASS" if self.passed else "FAIL"])


def _show(value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) \
            or value < 0:
        raise ArgumentValueError(f"show: expected an int >= 0, got {_short(value)}")
    return int(value)


def compare_output(name: str, actual: np.ndarray, expected: np.ndarray, *,
                   atol: Union[float, np.ndarray] = 0.0, rtol: float = 0.0,
                   ulp: Optional[float] = None, show: int = SHOW,
                   mean_tol: Optional[np.ndarray] = None) -> OutputComparison:
    """Errors of ``actual`` against ``expected`` (same float16/float32 dtype and shape).

    An element passes when it equals the expected value (NaN for NaN, the same infinity;
    +0 and -0 are equal) or, both being finite, when ``|err| <= atol + rtol*|expected|``
    (``ulp_distance <= ulp`` when ``ulp`` is given). A NaN or infinity where a finite value
    is expected always fails. Tolerances must be finite and >= 0.

    Parameters
    ----------
    name : str
        The output's name, for the report.
    actual, expected : numpy.ndarray
    atol : float or numpy.ndarray
        One value, or one per channel (the last axis).
    rtol : float
    ulp : float, optional
        Judge by :func:`ulp_distance` instead of atol/rtol.
    show : int >= 0
        How many failing elements to keep in ``failures`` (the first in row-major order).
    mean_tol : numpy.ndarray (channel,), optional
        For a (batch, channel) output: each channel also fails when the mean of its errors
        (``got - expected``, over its finite elements) is beyond this in magnitude, a shift of
        the whole channel that rounding does not make (``shifted`` in the result).

    Returns
    -------
    OutputComparison
    """
    atol = _tolerances("atol", atol)
    rtol = _tolerance("rtol", rtol)
    ulp = None if ulp is None else _tolerance("ulp", ulp)
    show = _show(show)
    expected = np.asarray(expected)
    actual = np.asarray(actual)
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise UnusableInputError(f"{name}: expected {expected.dtype}{expected.shape}, got "
                                 f"{actual.dtype}{actual.shape}")
    if atol.ndim and (expected.ndim == 0 or atol.shape != expected.shape[-1:]):
        raise ArgumentValueError(f"atol: expected one value or one per channel "
                                 f"({expected.shape[-1:]}), got shape {atol.shape}")
    if mean_tol is not None:
        mean_tol = _tolerances("mean_tol", mean_tol)
        if expected.ndim != 2 or mean_tol.shape != expected.shape[-1:]:
            raise ArgumentValueError(f"mean_tol: expected one value per channel of a (batch, "
                                     f"channel) output, got shape {mean_tol.shape} for "
                                     f"{name} of shape {expected.shape}")
    act, exp = actual.astype(np.float64), expected.astype(np.float64)
    ulps = ulp_distance(expected, actual)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        same = (act == exp) | (np.isnan(act) & np.isnan(exp))
        finite = np.isfinite(act) & np.isfinite(exp)
        err = np.where(same, 0.0, np.where(finite, np.abs(act - exp), np.inf))
        rel = np.where(exp != 0, err / np.abs(exp), 0.0)
        if ulp is None:
            beyond = err - (atol + rtol * np.abs(exp))
            most = float(atol.max(initial=0.0))
            criterion = ("atol=0 rtol=0 (exact)" if most == 0 and rtol == 0
                         else f"atol={most:.3g} rtol={rtol:.3g}" if atol.ndim == 0
                         else f"atol<={most:.3g} per channel rtol={rtol:.3g}")
        else:
            beyond = ulps - ulp
            criterion = f"ulp={ulp:g}"
        ok = same | (finite & (beyond <= 0))
        beyond = np.where(same, -np.inf, np.where(finite, beyond, np.inf))
    flat_ok = ok.reshape(-1)
    bad = np.flatnonzero(~flat_ok)

    def element(flat: int) -> ElementError:
        index = tuple(int(i) for i in np.unravel_index(flat, exp.shape))
        bits = lambda a: int(np.ascontiguousarray(a).reshape(-1).view(  # noqa: E731
            f"u{a.dtype.itemsize}")[flat])
        e = float(exp.reshape(-1)[flat])
        return ElementError(index=index, dtype=expected.dtype.name, expected=e,
                            got=float(act.reshape(-1)[flat]), expected_bits=bits(expected),
                            got_bits=bits(actual), abs_err=float(err.reshape(-1)[flat]),
                            rel_err=None if e == 0 else float(rel.reshape(-1)[flat]),
                            ulp=float(ulps.reshape(-1)[flat]))

    worst = None
    if exp.size and not same.all():
        worst = element(int(np.argmax(beyond.reshape(-1))))
    largest = lambda a: float(a.max()) if a.size else 0.0  # noqa: E731
    result = OutputComparison(
        name=name, count=int(exp.size), max_abs_err=largest(err), max_rel_err=largest(rel),
        max_ulp_err=largest(ulps), over=int(bad.size),
        first_over=element(int(bad[0])).index if bad.size else None, criterion=criterion,
        worst=worst, failures=[element(int(i)) for i in bad[:show]])
    if mean_tol is not None and exp.size:
        with np.errstate(invalid="ignore"):
            signed = np.where(finite, act - exp, 0.0)
            mean_err = signed.sum(axis=0) / np.maximum(finite.sum(axis=0), 1)
        off = np.flatnonzero(np.abs(mean_err) > mean_tol)
        if off.size:
            c = int(off[0])
            result.shifted, result.first_shifted = int(off.size), c
            result.shift, result.shift_tol = float(mean_err[c]), float(mean_tol[c])
    return result


def compare(vectors: Union[GoldenVectors, PathLike],
            outputs: Mapping[str, Union[np.ndarray, PathLike]], *,
            atol: Optional[float] = None, rtol: Optional[float] = None,
            ulp: Optional[float] = None, show: int = SHOW) -> ComparisonReport:
    """Compare a device's outputs with golden vectors.

    Parameters
    ----------
    vectors : GoldenVectors or path of a vectors directory
    outputs : mapping of "dx", "dbias", "dscale" to arrays or raw .bin paths
        At least one. Arrays must have the expected dtype and shape, (batch, channel) for dx
        and (channel,) otherwise, or be flat arrays of those elements in row-major order;
        files are raw little-endian in that dtype.
    atol, rtol : float, optional
        Override the manifest's defaults (for every output; the one not given keeps its
        default), and the defaults' per-channel rules (module docstring). Finite and >= 0.
    ulp : float, optional
        Judge by :func:`ulp_distance` instead; not together with atol/rtol. Finite and >= 0.
    show : int, default 10
        How many failing elements per output the report lists.

    Returns
    -------
    ComparisonReport
        ``.passed``, ``.format()`` and one :class:`OutputComparison` per output.

    Raises
    ------
    UnusableInputError
        Missing file, wrong size or dtype, unreadable vectors.
    ArgumentValueError, ArgumentTypeError
        No outputs, an unknown output name, a tolerance that is negative, infinite, NaN or not
        a number, or ``ulp`` together with ``atol``/``rtol``.
    """
    atol, rtol, ulp = (None if v is None else _tolerance(n, v)
                       for n, v in (("atol", atol), ("rtol", rtol), ("ulp", ulp)))
    if ulp is not None and (atol is not None or rtol is not None):
        raise ArgumentValueError("ulp: give either ulp or atol/rtol, not both")
    show = _show(show)
    if not isinstance(vectors, GoldenVectors):
        vectors = load_vectors(vectors)
    if not outputs:
        raise ArgumentValueError("outputs: expected at least one of dx, dbias, dscale")
    results = []
    channel_scales: Optional[dict[str, np.ndarray]] = None  # (the defaults' rule, once)
    for name, value in outputs.items():
        _choice("output", name, OUTPUTS)
        dtype, shape = vectors.output_dtype(name), vectors.shape(name)
        if isinstance(value, np.ndarray):
            if value.dtype != dtype or value.size != math.prod(shape):
                raise UnusableInputError(
                    f"{name}: expected {math.prod(shape)} {dtype.name} values, got "
                    f"{value.size} {value.dtype} values")
            if value.ndim > 1 and value.shape != shape:  # (a transposed array, read row-major,
                raise UnusableInputError(                # would put values in other places)
                    f"outputs[{name!r}]: expected shape {shape} (or a flat array of its "
                    f"{math.prod(shape)} values in row-major order), got shape {value.shape}")
            actual = value.reshape(shape)
        elif isinstance(value, (str, bytes, os.PathLike)):
            actual = read_output(os.fsdecode(value), vectors, name)
        else:
            raise ArgumentTypeError(f"outputs[{name!r}]: expected a NumPy array or a file's "
                                    f"path, got {type(value).__name__}")
        default = vectors.tolerances[name]
        given_atol: Union[float, np.ndarray] = atol if atol is not None else default["atol"]
        mean_tol = None
        if atol is None and rtol is None and ulp is None and default["atol"] > 0:
            # The defaults per channel: the manifest's atol is the largest channel's, each
            # channel's in proportion to its own terms; and dx's channels must not be
            # shifted as a whole (module docstring). Not for exact vectors (atol 0): any
            # error fails there, and its mean says nothing of a missing term.
            if channel_scales is None:
                channel_scales = _channel_term_scales(vectors.arrays, vectors.is_train)
            given_atol = default["atol"] * (channel_scales[name] / default["scale"])
            mean_tol = given_atol / 2 if name == "dx" else None
        results.append(compare_output(
            name, actual, vectors.arrays[name], ulp=ulp, show=show, atol=given_atol,
            rtol=default["rtol"] if rtol is None else rtol, mean_tol=mean_tol))
    return ComparisonReport(results)
