"""Golden vectors (bngrad.vectors, `bngrad vectors` / `bngrad compare`).

Round trips pass; an output moved just beyond its tolerance fails at the right (batch, channel);
unusable input exits 2; files, manifest and checksums are what they claim; the exact
distribution is exact (checked with rational arithmetic); bngrad.dsp passes its own vectors.
"""

from __future__ import annotations

import hashlib
import json
from fractions import Fraction

import numpy as np
import pytest

from bngrad import __version__, dsp, reference, vectors
from bngrad.cli import main
from bngrad.errors import ArgumentValueError

OUTPUTS = ("dx", "dbias", "dscale")
DTYPE = {"fp16": np.dtype(np.float16), "fp32": np.dtype(np.float32)}


def write(tmp_path, *extra, batch=4, channel=64, dtype="fp32", name="v"):
    out = tmp_path / name
    argv = ["vectors", "--batch", str(batch), "--channel", str(channel), "--dtype", dtype,
            "--out", str(out), *extra]
    assert main(argv) == 0
    return out


def compare(out, *extra, outputs=OUTPUTS, files=None):
    """`bngrad compare` on ``files`` (default: the expected outputs themselves)."""
    files = files or {name: out / f"{name}.bin" for name in outputs}
    argv = ["compare", str(out)]
    for name, path in files.items():
        argv += [f"--{name}", str(path)]
    return main(argv + list(extra))


def device_copy(out, tmp_path, name="dx"):
    """A 'device output': a copy of the expected file, to be tampered with."""
    dtype = np.dtype(json.loads((out / "manifest.json").read_text())["arrays"][name]["dtype"])
    return np.fromfile(out / f"{name}.bin", dtype=dtype.newbyteorder("<")).astype(dtype), \
        tmp_path / f"device_{name}.bin"


def bump_ulps(a, flat_index, k):
    """``a`` with element ``flat_index`` moved k units in the last place away from zero."""
    b = a.copy()
    bits = b.reshape(-1).view(f"u{a.itemsize}")
    bits[flat_index] += k
    return b


# --------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("dist", vectors.DISTRIBUTIONS)
@pytest.mark.parametrize("mode", [[], ["--eval"]], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_round_trip_passes(tmp_path, capsys, dtype, mode, dist):
    out = write(tmp_path, "--dist", dist, *mode, dtype=dtype)
    assert compare(out) == 0
    text = capsys.readouterr().out
    assert "PASS" in text and all(name in text for name in OUTPUTS)


def test_round_trip_npz(tmp_path):
    out = write(tmp_path, "--format", "npz", "--dtype", "fp16", "--param-dtype", "fp32",
                dtype="fp16")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "vectors.npz"]
    golden = vectors.load_vectors(out)
    assert golden.arrays["dx"].dtype == np.float16 and golden.arrays["dbias"].dtype == np.float32
    same = vectors.generate(4, 64, "fp16", param_dtype="fp32")
    for name, a in same.arrays.items():
        np.testing.assert_array_equal(golden.arrays[name], a)
    report = vectors.compare(golden, golden.expected)
    assert report.passed
    device = tmp_path / "dx.bin"                    # device outputs are raw .bin regardless
    golden.arrays["dx"].tofile(device)
    assert compare(out, files={"dx": device}) == 0


# --------------------------------------------------------------------------- failures

@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_one_element_beyond_ulp_tolerance_fails_at_its_index(tmp_path, capsys, dtype):
    out = write(tmp_path, dtype=dtype)
    dx, path = device_copy(out, tmp_path)
    flat = 2 * 64 + 17                              # batch 2, channel 17
    bump_ulps(dx, flat, 3).tofile(path)
    assert compare(out, "--ulp", "3", files={"dx": path}) == 0    # at the limit: passes
    bump_ulps(dx, flat, 4).tofile(path)
    capsys.readouterr()
    assert compare(out, "--ulp", "3", files={"dx": path}) == 1
    text = capsys.readouterr().out
    assert "batch 2, channel 17" in text and "FAIL" in text
    row = next(line for line in text.splitlines() if line.startswith("dx"))
    assert row.split()[4] == "4" and row.split()[5] == "1"       # max ULP 4, one over


def test_single_flipped_ulp_fails_under_ulp_zero(tmp_path, capsys):
    out = write(tmp_path, "--dist", "exact", dtype="fp16")
    dx, path = device_copy(out, tmp_path)
    bump_ulps(dx, 3 * 64 + 5, 1).tofile(path)
    assert compare(out, "--ulp", "0", files={"dx": path}) == 1
    assert "batch 3, channel 5" in capsys.readouterr().out
    assert compare(out, "--ulp", "1", files={"dx": path}) == 0


@pytest.mark.parametrize("name", OUTPUTS)
def test_just_beyond_default_tolerance_fails(tmp_path, capsys, name):
    """Move one element to the first representable value beyond atol + rtol*|expected|."""
    out = write(tmp_path, "--seed", "3", dtype="fp16")
    manifest = json.loads((out / "manifest.json").read_text())
    tol = manifest["tolerances"][name]
    good, path = device_copy(out, tmp_path, name)
    flat = 37 if name == "dx" else 5
    e = float(good.reshape(-1)[flat])
    bound = tol["atol"] + tol["rtol"] * abs(e)
    within = bad = good.copy()
    k = 0
    while True:   # step up one ULP at a time; the last value inside the bound, then the first out
        k += 1
        candidate = bump_ulps(good, flat, k)
        if abs(float(candidate.reshape(-1)[flat]) - e) > bound:
            bad = candidate
            break
        within = candidate
    files = {n: out / f"{n}.bin" for n in OUTPUTS}
    files[name] = path
    within.tofile(path)
    assert compare(out, files=files) == 0
    bad.tofile(path)
    capsys.readouterr()
    assert compare(out, files=files) == 1
    where = "batch 0, channel 37" if name == "dx" else "channel 5"
    text = capsys.readouterr().out
    assert where in text
    row = next(line for line in text.splitlines() if line.startswith(name))
    assert row.split()[5] == "1"


def test_first_failure_is_the_first_in_row_major_order(tmp_path):
    out = write(tmp_path)
    golden = vectors.load_vectors(out)
    dx = golden.arrays["dx"].copy()
    dx[3, 1] += 1.0
    dx[1, 60] -= 1.0
    report = vectors.compare(golden, {"dx": dx})
    (result,) = report.outputs
    assert not report.passed and result.over == 2 and result.first_over == (1, 60)
    assert result.max_abs_err == pytest.approx(1.0, rel=1e-6)


def test_nan_and_inf_fail(tmp_path):
    golden = vectors.load_vectors(write(tmp_path))
    for bad in (np.nan, np.inf):
        dbias = golden.arrays["dbias"].copy()
        dbias[7] = bad
        result = vectors.compare(golden, {"dbias": dbias}).outputs[0]
        assert result.first_over == (7,) and result.max_abs_err == np.inf


def test_tolerance_overrides(tmp_path):
    golden = vectors.load_vectors(write(tmp_path))
    dx = golden.arrays["dx"].copy()
    dx[0, 0] += np.float32(1e-3)
    assert not vectors.compare(golden, {"dx": dx}).passed
    assert vectors.compare(golden, {"dx": dx}, atol=2e-3).passed
    assert not vectors.compare(golden, {"dx": dx}, atol=0.0, rtol=0.0).passed
    assert vectors.compare(golden, {"dx": golden.arrays["dx"]}, atol=0.0, rtol=0.0).passed


# --------------------------------------------------------------------------- unusable input

def test_missing_file_exits_2(tmp_path, capsys):
    out = write(tmp_path)
    assert compare(out, files={"dx": tmp_path / "nowhere.bin"}) == 2
    assert "file not found" in capsys.readouterr().err


def test_wrong_size_exits_2(tmp_path, capsys):
    out = write(tmp_path, dtype="fp16")
    dx, path = device_copy(out, tmp_path)
    dx[:-1].tofile(path)
    assert compare(out, files={"dx": path}) == 2
    err = capsys.readouterr().err
    assert "510 bytes, expected 512" in err and "float16" in err
    dx.astype(np.float32).tofile(path)              # right count, wrong dtype: 1024 bytes
    assert compare(out, files={"dx": path}) == 2


def test_missing_manifest_exits_2(tmp_path, capsys):
    out = write(tmp_path)
    (out / "manifest.json").unlink()
    assert compare(out) == 2
    assert "manifest.json" in capsys.readouterr().err


def test_changed_golden_file_exits_2(tmp_path, capsys):
    out = write(tmp_path)
    data = bytearray((out / "dx.bin").read_bytes())
    data[5] ^= 0x01
    (out / "dx.bin").write_bytes(bytes(data))
    assert compare(out) == 2
    assert "sha256" in capsys.readouterr().err


def test_ulp_with_atol_exits_2(tmp_path):
    out = write(tmp_path)
    assert compare(out, "--ulp", "1", "--atol", "1e-3") == 2


def test_api_rejects_wrong_array(tmp_path):
    golden = vectors.load_vectors(write(tmp_path))
    with pytest.raises(vectors.UnusableInputError, match="float32"):
        vectors.compare(golden, {"dx": golden.arrays["dx"].astype(np.float64)})
    with pytest.raises(vectors.UnusableInputError, match="256"):
        vectors.compare(golden, {"dx": golden.arrays["dx"][:2]})


@pytest.mark.parametrize("argv, message", [
    (["--batch", "5", "--dist", "exact"], "even batch"),
    (["--batch", "0"], "batch"),
    (["--channel", "-3"], "channel"),
    (["--param-dtype", "fp16"], "param_dtype"),          # fp32 data with fp16 per-channel
])
def test_vectors_bad_arguments_exit_2(tmp_path, capsys, argv, message):
    defaults = {"--batch": "4", "--channel": "8", "--dtype": "fp32"}
    for i in range(0, len(argv), 2):
        defaults[argv[i]] = argv[i + 1]
    args = ["vectors", "--out", str(tmp_path / "v")]
    for key, value in defaults.items():
        args += [key, value]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "v" / "manifest.json").exists()


def test_exact_refuses_sizes_it_cannot_keep_exact():
    with pytest.raises(ArgumentValueError, match="exactly representable in float16"):
        vectors.generate(65536, 16, "fp16", dist="exact")
    assert vectors.generate(65536, 16, "fp16", dist="exact", param_dtype="fp32").batch == 65536


# --------------------------------------------------------------------------- files and manifest

def test_manifest_and_files(tmp_path):
    out = write(tmp_path, "--eval", "--seed", "7", "--dist", "uniform", batch=3, channel=5,
                dtype="fp16")
    m = json.loads((out / "manifest.json").read_text())
    assert (m["batch"], m["channel"], m["is_train"], m["dtype"], m["param_dtype"]) == \
        (3, 5, 0, "fp16", "fp16")
    assert (m["seed"], m["distribution"], m["bngrad_version"]) == (7, "uniform", __version__)
    assert "row-major [batch][channel]" in m["layout"] and "little-endian" in m["layout"]
    assert m["functions"] == ["hp_batch_norm_grad_s", "hp_batch_norm_grad_p"]
    assert set(m["tolerances"]) == set(OUTPUTS)
    for name, entry in m["arrays"].items():
        data = (out / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert len(data) == int(np.prod(entry["shape"])) * 2
        assert entry["shape"] == ([3, 5] if name in ("x", "dy", "dx") else [5])
        assert entry["role"] == ("expected" if name in OUTPUTS else "input")


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    a = write(tmp_path, "--seed", "1", name="a")
    b = write(tmp_path, "--seed", "1", name="b")
    c = write(tmp_path, "--seed", "2", name="c")
    for name in ("x", "dy", "dx"):
        assert (a / f"{name}.bin").read_bytes() == (b / f"{name}.bin").read_bytes()
        assert (a / f"{name}.bin").read_bytes() != (c / f"{name}.bin").read_bytes()


def _stored(out):
    m = json.loads((out / "manifest.json").read_text())
    return {name: np.fromfile(out / e["file"], dtype=np.dtype(e["dtype"]).newbyteorder("<"))
            .astype(e["dtype"]).reshape(e["shape"]) for name, e in m["arrays"].items()}, m


@pytest.mark.parametrize("mode", [[], ["--eval"]], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_expected_is_the_reference_rounded_once(tmp_path, dtype, mode):
    a, m = _stored(write(tmp_path, *mode, "--dist", "normal", batch=5, channel=9, dtype=dtype))
    f = {n: a[n].astype(np.float64) for n in ("x", "dy", "mean", "invar", "scale")}
    if m["is_train"]:
        dx, dscale, dbias = reference.batch_norm_backward(
            f["dy"], f["x"], f["scale"], None, None, f["mean"], f["invar"], True)
        # train statistics are the batch's, of the stored x, rounded once
        mean, var = reference.batch_norm_moments(f["x"])
        np.testing.assert_array_equal(a["mean"], mean.astype(DTYPE[dtype]))
        np.testing.assert_array_equal(a["invar"], (1 / np.sqrt(var + 1e-5)).astype(DTYPE[dtype]))
    else:
        _, _, dscale, dbias = reference.batch_norm_backward_reduce(
            f["dy"], f["x"], f["mean"], f["invar"])
        dx = f["dy"] * f["invar"] * f["scale"]
    for name, value in (("dx", dx), ("dbias", dbias), ("dscale", dscale)):
        np.testing.assert_array_equal(a[name], value.astype(DTYPE[dtype]), err_msg=name)


# --------------------------------------------------------------------------- the exact distribution

def _fractions(a):
    return np.vectorize(Fraction, otypes=[object])(np.asarray(a, dtype=np.float64))


@pytest.mark.parametrize("mode", [[], ["--eval"]], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("batch", [6, 4])
def test_exact_distribution_is_exact(tmp_path, dtype, mode, batch):
    """With rational arithmetic: the statistics are the true ones and the files hold the exact
    gradients (the seed's formula), so no rounding happened anywhere."""
    a, m = _stored(write(tmp_path, "--dist", "exact", "--seed", "5", *mode, batch=batch,
                         channel=16, dtype=dtype))
    x, dy, mean, invar, scale = (_fractions(a[n]) for n in ("x", "dy", "mean", "invar", "scale"))
    if m["is_train"]:
        true_mean = x.sum(axis=0) / batch
        true_var = ((x - true_mean) ** 2).sum(axis=0) / batch
        assert (mean == true_mean).all()
        assert all(i * i * v == 1 for i, v in zip(invar, true_var))     # invar = 1/sqrt(var)
    xhat = (x - mean) * invar
    sum_dy, sum_dy_xhat = dy.sum(axis=0), (dy * xhat).sum(axis=0)
    if m["is_train"]:
        dx = scale * invar / batch * (batch * dy - sum_dy - xhat * sum_dy_xhat)
        assert any(v != 0 for v in sum_dy) and any(v != 0 for v in sum_dy_xhat)
    else:
        dx = dy * invar * scale
    for name, exact in (("dx", dx), ("dbias", sum_dy), ("dscale", sum_dy_xhat)):
        assert (_fractions(a[name]) == exact).all(), name
    # float32 accumulation in two different orders lands exactly on the true sums
    for terms, exact in ((a["dy"].astype(np.float64), sum_dy),
                         ((a["dy"].astype(np.float64) * ((a["x"].astype(np.float64)
                           - a["mean"]) * a["invar"])), sum_dy_xhat)):
        forward = np.cumsum(terms.astype(np.float32), axis=0, dtype=np.float32)[-1]
        backward = np.cumsum(terms[::-1].astype(np.float32), axis=0, dtype=np.float32)[-1]
        assert (_fractions(forward) == exact).all() and (_fractions(backward) == exact).all()


# --------------------------------------------------------------------------- the golden model

def run_dsp(golden, core_mask=0xFF):
    """bngrad.dsp as the device: its outputs, in the vectors' dtypes."""
    inputs = {n: golden.arrays[n].reshape(-1).copy() for n in ("x", "dy")}
    dx = np.empty_like(inputs["x"])
    outs = {n: np.empty_like(golden.arrays[n]) for n in ("dbias", "dscale")}
    p = dsp.BatchNormGradParams(golden.arrays["mean"], golden.arrays["invar"],
                                golden.arrays["scale"], outs["dbias"], outs["dscale"],
                                golden.batch, golden.channel, golden.is_train)
    fn = dsp.hp_batch_norm_grad_s if golden.dtype == "fp16" else dsp.fp_batch_norm_grad_s
    fn(inputs["x"], inputs["dy"], dx, p.as_params(), core_mask)
    return {"dx": dx, **outs}


@pytest.mark.parametrize("dist", vectors.DISTRIBUTIONS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype, param_dtype", [("fp32", "fp32"), ("fp16", "fp16"),
                                                ("fp16", "fp32")])
def test_golden_model_passes_its_vectors(tmp_path, capsys, dtype, param_dtype, train, dist):
    golden = vectors.generate(6, 48, dtype, train=train, seed=11, dist=dist,
                              param_dtype=param_dtype)
    outputs = run_dsp(golden)
    report = vectors.compare(golden, outputs)
    assert report.passed, report.format()
    # through the files and the command too
    out = tmp_path / "v"
    vectors.save_vectors(golden, out)
    files = {}
    for name, value in outputs.items():
        files[name] = tmp_path / f"device_{name}.bin"
        value.astype(value.dtype.newbyteorder("<")).tofile(files[name])
    assert compare(out, files=files) == 0, capsys.readouterr().out


def test_golden_model_fails_vectors_of_the_other_mode(tmp_path):
    """The comparison has teeth: train-mode outputs against eval vectors fail."""
    golden = vectors.generate(6, 48, "fp32", train=False, seed=12)
    golden.is_train = True
    outputs = run_dsp(golden)
    golden.is_train = False
    report = vectors.compare(golden, outputs)
    assert not report.passed
    assert {o.name for o in report.outputs if not o.passed} == {"dx"}


def test_manifest_without_tolerances_exits_2(tmp_path, capsys):
    out = write(tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    del m["tolerances"]["dbias"]
    (out / "manifest.json").write_text(json.dumps(m))
    assert compare(out) == 2
    assert "cannot read" in capsys.readouterr().err
