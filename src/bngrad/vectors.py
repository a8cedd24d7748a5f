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

Default tolerances (stored in the manifest, per output)
-------------------------------------------------------
An element passes when ``|device - expected| <= atol + rtol * |expected|`` with
``rtol = 4 * eps`` and ``atol = 4 * eps * scale``, where ``eps`` is the machine epsilon of the
output's dtype (float32 1.19e-7, float16 9.77e-4) and ``scale`` the largest magnitude of the
terms behind that output (dx: ``|invar*scale| * (|dy| + |sum dy|/m + |xhat * sum dy*xhat|/m)``;
dbias: ``sum |dy|``; dscale: ``sum |dy*xhat|``): a result that cancels can be far smaller
than the terms it came from, and no floating-point method gets its relative error small.
``ulp=U`` instead passes elements within U units in the last place of the output dtype.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import numpy as np

from . import reference
from ._validate import positive_int
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
    "generate",
    "load_vectors",
    "read_output",
    "save_vectors",
    "write_vectors",
]

DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16)}
DISTRIBUTIONS = ("normal", "uniform", "exact")
FORMATS = ("bin", "npz")
INPUTS = ("x", "dy", "mean", "invar", "scale")
OUTPUTS = ("dx", "dbias", "dscale")
EPS = 1e-5                      # turns the variance into invar for normal/uniform data
TOLERANCE_FACTOR = 4.0          # atol = 4*eps*scale, rtol = 4*eps
MANIFEST = "manifest.json"
NPZ_FILE = "vectors.npz"
FORMAT_ID = "bngrad-golden-vectors/1"
LAYOUT = "row-major [batch][channel] (channel fastest), little-endian IEEE 754, no header"

PathLike = Union[str, Path]


class UnusableInputError(ArgumentValueError):
    """Vectors or device outputs that cannot be compared at all (missing, wrong size, corrupt)."""


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


def _term_scales(arrays: Mapping[str, np.ndarray], train: bool) -> dict[str, float]:
    """Largest magnitude of the terms behind each output, float64 (see the module docstring)."""
    x, dy, mean, invar, scale = (np.asarray(arrays[n]).astype(np.float64) for n in INPUTS)
    m = x.shape[0]
    with np.errstate(invalid="ignore", over="ignore"):
        xhat = (x - mean) * invar
        dy_xhat = np.abs(dy * xhat)
        dx_terms = np.abs(dy)
        if train:
            dx_terms = dx_terms + np.abs(dy.sum(0)) / m + np.abs(xhat * (dy * xhat).sum(0)) / m
        dx_terms = dx_terms * np.abs(invar * scale)

    def largest(a: np.ndarray) -> float:
        a = a[np.isfinite(a)]
        return float(a.max()) if a.size else 0.0

    return {"dx": largest(dx_terms), "dbias": largest(np.abs(dy).sum(0)),
            "dscale": largest(dy_xhat.sum(0))}


def default_tolerances(arrays: Mapping[str, np.ndarray], train: bool
                       ) -> dict[str, dict[str, float]]:
    """Per output: ``{"atol": 4*eps*scale, "rtol": 4*eps, "scale": scale}``, eps of its dtype."""
    scales = _term_scales(arrays, train)
    tolerances = {}
    for name in OUTPUTS:
        eps = float(np.finfo(arrays[name].dtype).eps)
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
    for c in range(channel):
        pos, neg = z[:, c] > 0, z[:, c] < 0
        dy[pos, c] = q[c] * (u[c] + noise_pos[:, c])
        dy[neg, c] = q[c] * (v[c] + noise_neg[:, c])
    scale = rng.integers(2, 8, channel) / 4.0 * rng.choice([-1.0, 1.0], channel)  # 0.5 .. 1.75
    if train:
        mean, invar = mu, 1.0 / a
    else:  # running statistics: near, but not equal to, the batch's; still exact
        mean = mu + a * rng.integers(-2, 3, channel) / 8.0
        invar = 2.0 ** rng.integers(-1, 2, channel) / a
    return {"x": x, "dy": dy, "mean": mean, "invar": invar, "scale": scale}


def _lowest_bit(values: np.ndarray) -> float:
    """Largest power of two dividing every nonzero value (float64 inputs)."""
    nonzero = values[values != 0]
    if nonzero.size == 0:
        return 1.0
    mantissa, exponent = np.frexp(nonzero)
    ints = np.abs(mantissa * 2.0 ** 53).astype(np.int64)
    trailing = np.log2((ints & -ints).astype(np.float64)).astype(np.int64)
    return float(2.0 ** int(np.min(exponent - 53 + trailing)))


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
        for c in range(terms.shape[1]):
            t = terms[:, c]
            g = _lowest_bit(t)
            if (not np.array_equal(t.astype(np.float32).astype(np.float64), t)
                    or np.abs(t).sum() > 2.0 ** 24 * g):
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
        A bad argument, or ``dist="exact"`` for sizes it cannot keep exact (an odd batch, or
        sums too large for the dtype); the message says which and what to do.
    """
    batch = positive_int("batch", batch)
    channel = positive_int("channel", channel)
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
                         arrays=arrays, tolerances=default_tolerances(arrays, train))


# --------------------------------------------------------------------------- files

def _little_endian(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
        "tolerance_rule": ("an element passes when |device - expected| <= atol + rtol*|expected|;"
                           f" rtol = {TOLERANCE_FACTOR:g}*eps, atol = {TOLERANCE_FACTOR:g}*eps*"
                           "scale, eps the machine epsilon of the output dtype, scale the "
                           "largest magnitude of the terms behind the output"),
    }


def save_vectors(vectors: GoldenVectors, out_dir: PathLike, file_format: str = "bin"
                 ) -> dict[str, Any]:
    """Write ``vectors`` under ``out_dir`` (created if needed); returns the manifest."""
    file_format = _choice("format", file_format, FORMATS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(vectors, file_format)
    arrays = {name: _little_endian(vectors.arrays[name]) for name in INPUTS + OUTPUTS}
    if file_format == "bin":
        for name, a in arrays.items():
            (out / f"{name}.bin").write_bytes(a.tobytes())
    else:
        np.savez(out / NPZ_FILE, **arrays)
        manifest["archive_sha256"] = _sha256((out / NPZ_FILE).read_bytes())
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def write_vectors(out_dir: PathLike, batch: int, channel: int, dtype: str = "fp32", *,
                  train: bool = True, seed: int = 0, dist: str = "normal",
                  param_dtype: Optional[str] = None, file_format: str = "bin"
                  ) -> dict[str, Any]:
    """:func:`generate` then :func:`save_vectors` (what ``bngrad vectors`` does); the manifest."""
    _choice("format", file_format, FORMATS)
    vectors = generate(batch, channel, dtype, train=train, seed=seed, dist=dist,
                       param_dtype=param_dtype)
    return save_vectors(vectors, out_dir, file_format)


def _read_raw(what: str, path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if not path.is_file():
        raise UnusableInputError(f"{what}: file not found: {path}")
    expected_bytes = math.prod(shape) * dtype.itemsize
    size = path.stat().st_size
    if size != expected_bytes:
        raise UnusableInputError(
            f"{what}: {path} has {size} bytes, expected {expected_bytes} "
            f"({' x '.join(map(str, shape))} {dtype.name} values, little-endian, no header)")
    return np.fromfile(path, dtype=dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def load_vectors(directory: PathLike) -> GoldenVectors:
    """Read vectors written by :func:`save_vectors`, checking sizes and sha256 of every array.

    Raises
    ------
    UnusableInputError
        Missing or unreadable manifest or file, wrong size, or a checksum that does not match.
    """
    root = Path(directory)
    path = root / MANIFEST
    if not path.is_file():
        raise UnusableInputError(f"vectors: no {MANIFEST} in {root} (write one with "
                                 "`bngrad vectors ... --out DIR`)")
    try:
        m = json.loads(path.read_text())
        if m.get("format") != FORMAT_ID:
            raise UnusableInputError(f"vectors: {path} is not a {FORMAT_ID} manifest "
                                     f"(format {m.get('format')!r})")
        file_format = m["file_format"]
        archive = None
        if file_format == "npz":
            npz_path = root / NPZ_FILE
            if not npz_path.is_file():
                raise UnusableInputError(f"vectors: file not found: {npz_path}")
            if _sha256(npz_path.read_bytes()) != m["archive_sha256"]:
                raise UnusableInputError(f"vectors: {npz_path} does not match its sha256 in "
                                         f"{path}; it changed since it was written")
            with np.load(npz_path) as npz:
                archive = {key: npz[key] for key in npz.files}
        arrays = {}
        for name in INPUTS + OUTPUTS:
            entry = m["arrays"][name]
            dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
            if archive is None:
                a = _read_raw(name, root / entry["file"], dtype, shape)
            else:
                a = archive[entry["key"]]
                if a.dtype.newbyteorder("=") != dtype or a.shape != shape:
                    raise UnusableInputError(f"{name}: {a.dtype}{a.shape} in {NPZ_FILE}, "
                                             f"manifest says {dtype}{shape}")
                a = a.astype(dtype)
            if _sha256(_little_endian(a).tobytes()) != entry["sha256"]:
                raise UnusableInputError(f"{name}: data does not match its sha256 in {path}; "
                                         "the file changed since it was written")
            arrays[name] = a
        tolerances = {name: {"atol": float(m["tolerances"][name]["atol"]),
                             "rtol": float(m["tolerances"][name]["rtol"]),
                             "scale": float(m["tolerances"][name].get("scale", 0.0))}
                      for name in OUTPUTS}
        return GoldenVectors(batch=int(m["batch"]), channel=int(m["channel"]),
                             dtype=m["dtype"], param_dtype=m["param_dtype"],
                             is_train=bool(m["is_train"]), seed=int(m["seed"]),
                             distribution=m["distribution"], eps=float(m["eps"]),
                             arrays=arrays, tolerances=tolerances)
    except UnusableInputError:
        raise
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise UnusableInputError(f"vectors: cannot read {root}: {type(e).__name__}: {e}") from e


def read_output(path: PathLike, vectors: GoldenVectors, name: str) -> np.ndarray:
    """A device's output ``name`` (dx, dbias or dscale): raw little-endian, the expected's dtype."""
    _choice("output", name, OUTPUTS)
    return _read_raw(name, Path(path), vectors.output_dtype(name), vectors.shape(name))


# --------------------------------------------------------------------------- comparison

@dataclass
class OutputComparison:
    """How one output compares with its expected values."""

    name: str
    count: int
    max_abs_err: float
    max_rel_err: float
    max_ulp_err: float
    over: int                                  # elements beyond tolerance
    first_over: Optional[tuple[int, ...]]      # (batch, channel) for dx, (channel,) otherwise
    criterion: str                             # the tolerance applied, in words

    @property
    def passed(self) -> bool:
        return self.over == 0

    def where(self) -> str:
        if self.first_over is None:
            return "-"
        if len(self.first_over) == 2:
            return f"batch {self.first_over[0]}, channel {self.first_over[1]}"
        return f"channel {self.first_over[0]}"


@dataclass
class ComparisonReport:
    """The result of :func:`compare`: one :class:`OutputComparison` per output compared."""

    outputs: list[OutputComparison]

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outputs)

    def format(self) -> str:
        rows = [("output", "elements", "max abs err", "max rel err", "max ULP", "over tol",
                 "first over tol", "tolerance")]
        for o in self.outputs:
            rows.append((o.name, str(o.count), f"{o.max_abs_err:.3e}", f"{o.max_rel_err:.3e}",
                         f"{o.max_ulp_err:.4g}", str(o.over), o.where(), o.criterion))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                 for row in rows]
        return "\n".join(lines + ["PASS" if self.passed else "FAIL"])


def _non_negative(name: str, value: Optional[float]) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name}: expected a number >= 0, got {value!r}")
    if not float(value) >= 0:
        raise ArgumentValueError(f"{name}: expected a number >= 0, got {value!r}")
    return float(value)


def compare_output(name: str, actual: np.ndarray, expected: np.ndarray, *, atol: float = 0.0,
                   rtol: float = 0.0, ulp: Optional[float] = None) -> OutputComparison:
    """Errors of ``actual`` against ``expected`` (same dtype and shape), in that dtype's ULPs.

    An element passes when it equals the expected value (NaN for NaN, same infinity), or, if
    both are finite, ``|err| <= atol + rtol*|expected|`` (or ``<= ulp`` ULPs when ``ulp`` is given).
    """
    act, exp = actual.astype(np.float64), expected.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        same = (act == exp) | (np.isnan(act) & np.isnan(exp))
        err = np.where(same, 0.0, np.abs(act - exp))
        err = np.where(np.isfinite(err), err, np.inf)
        rel = np.where(err == 0, 0.0, err / np.abs(exp))
        spacing = np.spacing(np.abs(expected)).astype(np.float64)   # ULP in the output dtype
        ulps = np.where(err == 0, 0.0, err / spacing)
        ulps = np.where(np.isnan(ulps), np.inf, ulps)
        if ulp is None:
            ok = err <= atol + rtol * np.abs(exp)
            criterion = f"atol={atol:.3g} rtol={rtol:.3g}"
        else:
            ok = ulps <= ulp
            criterion = f"ulp={ulp:g}"
    bad = np.flatnonzero(~ok.reshape(-1))
    first = tuple(int(i) for i in np.unravel_index(bad[0], exp.shape)) if bad.size else None
    largest = lambda a: float(a.max()) if a.size else 0.0  # noqa: E731
    return OutputComparison(name=name, count=int(exp.size), max_abs_err=largest(err),
                            max_rel_err=largest(rel), max_ulp_err=largest(ulps),
                            over=int(bad.size), first_over=first, criterion=criterion)


def compare(vectors: Union[GoldenVectors, PathLike],
            outputs: Mapping[str, Union[np.ndarray, PathLike]], *,
            atol: Optional[float] = None, rtol: Optional[float] = None,
            ulp: Optional[float] = None) -> ComparisonReport:
    """Compare a device's outputs with golden vectors.

    Parameters
    ----------
    vectors : GoldenVectors or path of a vectors directory
    outputs : mapping of "dx", "dbias", "dscale" to arrays or raw .bin paths
        At least one. Arrays must have the expected dtype and batch*channel (dx) or channel
        elements; files are raw little-endian in that dtype.
    atol, rtol : float, optional
        Override the manifest's defaults (for every output; the one not given keeps its default).
    ulp : float, optional
        Judge by units in the last place instead; not together with atol/rtol.

    Returns
    -------
    ComparisonReport
        ``.passed``, ``.format()`` and one :class:`OutputComparison` per output.

    Raises
    ------
    UnusableInputError
        Missing file, wrong size or dtype, unreadable vectors.
    ArgumentValueError, ArgumentTypeError
        No outputs, an unknown output name, a negative or non-numeric tolerance, or ``ulp``
        together with ``atol``/``rtol``.
    """
    atol, rtol, ulp = (_non_negative(n, v) for n, v in (("atol", atol), ("rtol", rtol),
                                                         ("ulp", ulp)))
    if ulp is not None and (atol is not None or rtol is not None):
        raise ArgumentValueError("ulp: give either ulp or atol/rtol, not both")
    if not isinstance(vectors, GoldenVectors):
        vectors = load_vectors(vectors)
    if not outputs:
        raise ArgumentValueError("outputs: expected at least one of dx, dbias, dscale")
    results = []
    for name, value in outputs.items():
        _choice("output", name, OUTPUTS)
        dtype, shape = vectors.output_dtype(name), vectors.shape(name)
        if isinstance(value, np.ndarray):
            if value.dtype != dtype or value.size != math.prod(shape):
                raise UnusableInputError(
                    f"{name}: expected {math.prod(shape)} {dtype.name} values, got "
                    f"{value.size} {value.dtype} values")
            actual = value.reshape(shape)
        else:
            actual = read_output(value, vectors, name)
        default = vectors.tolerances[name]
        results.append(compare_output(
            name, actual, vectors.arrays[name], ulp=ulp,
            atol=default["atol"] if atol is None else atol,
            rtol=default["rtol"] if rtol is None else rtol))
    return ComparisonReport(results)
