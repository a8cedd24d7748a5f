"""Golden vectors (bngrad.vectors, `bngrad vectors` / `bngrad compare`).

Round trips pass; an output moved just beyond its tolerance fails at the right (batch, channel);
unusable input exits 2; files, manifest and checksums are what they claim; the exact
distribution is exact (checked with rational arithmetic); bngrad.dsp passes its own vectors.
"""

from __future__ import annotations

import hashlib
import io
import json
from fractions import Fraction

import numpy as np
import pytest

from bngrad import __version__, dsp, reference, vectors
from bngrad.cli import main
from bngrad.errors import ArgumentTypeError, ArgumentValueError

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


def channel_scales(out, name):
    """docs/dsp.md's scale_c of output ``name``, from the stored inputs, per channel."""
    g = vectors.load_vectors(out)
    x, dy, mean, invar, scale = (g.inputs[n].astype(np.float64) for n in
                                 ("x", "dy", "mean", "invar", "scale"))
    xhat = (x - mean) * invar
    if name == "dbias":
        return np.abs(dy).sum(0)
    if name == "dscale":
        return np.abs(dy * xhat).sum(0)
    m = len(x)
    terms = np.abs(dy) + np.abs(dy.sum(0)) / m + np.abs(xhat) * np.abs((dy * xhat).sum(0)) / m
    return (np.abs(invar * scale) * terms).max(0)


@pytest.mark.parametrize("name", OUTPUTS)
def test_just_beyond_default_tolerance_fails(tmp_path, capsys, name):
    """Move one element to the first representable value beyond atol_c + rtol*|expected|,
    its channel's bound (docs/dsp.md: the manifest's atol is the largest channel's)."""
    out = write(tmp_path, "--seed", "3", dtype="fp16")
    manifest = json.loads((out / "manifest.json").read_text())
    tol = manifest["tolerances"][name]
    good, path = device_copy(out, tmp_path, name)
    flat = 37 if name == "dx" else 5
    channel = flat % 64
    scales = channel_scales(out, name)
    assert tol["scale"] == pytest.approx(scales.max(), rel=1e-12)
    assert scales[channel] < 0.9 * scales.max()  # a channel whose own bound is the tighter
    e = float(good.reshape(-1)[flat])
    bound = tol["atol"] * scales[channel] / scales.max() + tol["rtol"] * abs(e)
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
    with pytest.raises(TypeError, match=r"outputs\['dx'\]: expected a NumPy array or a file's "
                                        "path, got list"):
        vectors.compare(golden, {"dx": golden.arrays["dx"].tolist()})


def test_empty_out_dir_is_refused(tmp_path, monkeypatch, capsys):
    """Path("") is the current folder: an empty --out would write there."""
    monkeypatch.chdir(tmp_path)
    assert main(["vectors", "--out", "", "--batch", "4", "--channel", "3", "--dtype", "fp32"]) == 2
    assert "--out: expected a folder, got an empty path" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["--batch", "5", "--dist", "exact"], "even batch"),
    (["--batch", "0"], "--batch: expected an int > 0"),       # flags, not Python names
    (["--channel", "-3"], "--channel: expected an int > 0"),
    (["--param-dtype", "fp16"], "--param-dtype: fp32 data"),   # fp32 data, fp16 per-channel
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
    assert "tolerances: no entry (an object) for dbias" in capsys.readouterr().err


# ------------------------------------------------------------------------ reading only inside DIR

def _edit_manifest(out, edit):
    m = json.loads((out / "manifest.json").read_text())
    edit(m)
    (out / "manifest.json").write_text(json.dumps(m))


def _one_line_exit_2(capsys, out, *extra, files=None):
    """compare exits 2 with one line on stderr and no traceback; returns that line."""
    capsys.readouterr()
    assert compare(out, *extra, files=files) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("name", ["../other/x.bin", "sub/x.bin", "..", ""])
def test_manifest_names_outside_dir_are_refused(tmp_path, capsys, name):
    """A manifest entry naming ../other/x.bin (same bytes, same sha256) used to load it."""
    out = write(tmp_path)
    for where in (tmp_path / "other", out / "sub"):
        where.mkdir()
        (where / "x.bin").write_bytes((out / "x.bin").read_bytes())
    _edit_manifest(out, lambda m: m["arrays"]["x"].update(file=name))
    err = _one_line_exit_2(capsys, out)
    assert "not a plain file name" in err and "x:" in err


def test_absolute_manifest_name_is_refused_without_probing_it(tmp_path, capsys):
    """An absolute name used to be stat-ed: "has 631 bytes" told the size of any file."""
    out = write(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 631)
    _edit_manifest(out, lambda m: m["arrays"]["dy"].update(file=str(secret)))
    err = _one_line_exit_2(capsys, out)
    assert "not a plain file name" in err and "631" not in err and "bytes" not in err


def test_symlink_leading_outside_dir_is_refused(tmp_path, capsys):
    out = write(tmp_path)
    outside = tmp_path / "outside.bin"
    outside.write_bytes((out / "x.bin").read_bytes())          # same bytes: sha256 matches
    (out / "x.bin").unlink()
    (out / "x.bin").symlink_to(outside)
    err = _one_line_exit_2(capsys, out)
    assert "leads outside" in err
    # a link that stays inside DIR is read as before
    (out / "x.bin").unlink()
    (out / "real_x.bin").write_bytes(outside.read_bytes())
    (out / "x.bin").symlink_to("real_x.bin")
    assert compare(out) == 0


def test_manifest_symlink_leading_outside_dir_is_refused(tmp_path, capsys):
    out = write(tmp_path)
    moved = tmp_path / "elsewhere.json"
    (out / "manifest.json").rename(moved)
    (out / "manifest.json").symlink_to(moved)
    assert "leads outside" in _one_line_exit_2(capsys, out)


# --------------------------------------------------------------------------- writing safely

def test_existing_vectors_are_not_replaced_without_force(tmp_path, capsys):
    out = write(tmp_path, "--seed", "1")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["vectors", "--batch", "4", "--channel", "64", "--dtype", "fp32", "--seed", "2",
            "--out", str(out)]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds golden vectors" in err and "--force" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert main(argv + ["--force"]) == 0
    assert (out / "x.bin").read_bytes() != before["x.bin"]
    assert compare(out) == 0


def test_api_refuses_to_overwrite_unless_asked(tmp_path):
    golden = vectors.generate(2, 8, "fp32")
    vectors.save_vectors(golden, tmp_path / "v")
    with pytest.raises(vectors.ExistingVectorsError, match="overwrite=True"):
        vectors.save_vectors(golden, tmp_path / "v")
    with pytest.raises(vectors.ExistingVectorsError):
        vectors.write_vectors(tmp_path / "v", 2, 8)
    vectors.save_vectors(golden, tmp_path / "v", overwrite=True)
    vectors.write_vectors(tmp_path / "v", 2, 8, seed=4, overwrite=True)
    assert vectors.load_vectors(tmp_path / "v").seed == 4


def test_other_files_in_dir_are_allowed_and_kept(tmp_path):
    out = tmp_path / "v"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    write(tmp_path)
    write(tmp_path, "--force", "--format", "npz")
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["refused", "force"])
def test_symlink_in_out_dir_is_never_written_through(tmp_path, capsys, force):
    out = tmp_path / "v"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (out / "x.bin").symlink_to(victim)
    argv = ["vectors", "--batch", "4", "--channel", "8", "--dtype", "fp32", "--out", str(out)]
    assert main(argv + force) == (0 if force else 2)
    assert victim.read_bytes() == b"keep me"
    if force:   # the link itself was replaced by the vector file
        assert not (out / "x.bin").is_symlink() and (out / "x.bin").stat().st_size == 4 * 32
        assert compare(out) == 0
    else:
        assert (out / "x.bin").is_symlink() and not (out / "manifest.json").exists()


def test_no_temporary_files_are_left(tmp_path):
    out = write(tmp_path)
    write(tmp_path, "--force", "--format", "npz")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "vectors.npz"]


@pytest.mark.parametrize("first, second, gone", [
    ("bin", "npz", [f"{n}.bin" for n in ("x", "dy", "mean", "invar", "scale", *OUTPUTS)]),
    ("npz", "bin", ["vectors.npz"]),
])
def test_force_removes_the_other_formats_files_only(tmp_path, first, second, gone):
    """npz written over .bin vectors used to leave the .bin files beside an npz manifest."""
    out = write(tmp_path, "--format", first)
    (out / "notes.bin").write_bytes(b"not ours")
    write(tmp_path, "--format", second, "--force")
    names = {p.name for p in out.iterdir()}
    assert not names & set(gone)
    assert "notes.bin" in names and "manifest.json" in names
    assert json.loads((out / "manifest.json").read_text())["file_format"] == second


# --------------------------------------------------------------------------- tolerances

@pytest.mark.parametrize("flag", ["--atol", "--rtol", "--ulp"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_cli_tolerance_must_be_finite_and_non_negative(tmp_path, capsys, flag, value):
    """--atol inf used to pass a NaN output (inf <= inf)."""
    out = write(tmp_path)
    dx, path = device_copy(out, tmp_path)
    dx[0] = np.nan
    dx.tofile(path)
    err = _one_line_exit_2(capsys, out, f"{flag}={value}", files={"dx": path})
    assert f"{flag}: expected a finite number >= 0" in err


@pytest.mark.parametrize("flag", ["--atol", "--rtol", "--ulp"])
def test_cli_negative_zero_tolerance_is_zero(tmp_path, capsys, flag):
    """(Found by hostile testing.) --atol -0 was reported as atol=-0."""
    out = write(tmp_path)
    assert compare(out, flag, "-0") == 0
    report = capsys.readouterr().out
    assert f"{flag[2:]}=0" in report and "=-0" not in report


@pytest.mark.parametrize("name", ["atol", "rtol", "ulp"])
@pytest.mark.parametrize("value", [np.inf, np.nan, -1.0, "1", True])
def test_api_tolerance_must_be_finite_and_non_negative(tmp_path, name, value):
    golden = vectors.generate(2, 8, "fp32")
    with pytest.raises((ArgumentValueError, ArgumentTypeError), match=name):
        vectors.compare(golden, golden.expected, **{name: value})
    with pytest.raises((ArgumentValueError, ArgumentTypeError), match=name):
        vectors.compare_output("dx", golden.arrays["dx"], golden.arrays["dx"], **{name: value})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_output_fails_under_any_tolerance(bad):
    expected = np.array([1.0, 0.0, -2.0], np.float32)
    got = expected.copy()
    got[1] = bad
    for kwargs in ({"atol": 1e300, "rtol": 1e300}, {"ulp": 1e300}):
        result = vectors.compare_output("dx", got, expected, **kwargs)
        assert result.over == 1 and result.first_over == (1,)


@pytest.mark.parametrize("key, value", [("atol", -1.0), ("rtol", -0.5), ("atol", "NaN"),
                                        ("rtol", "Infinity"), ("atol", "0.1"), ("atol", None)])
def test_manifest_tolerance_must_be_finite_and_non_negative(tmp_path, capsys, key, value):
    """A negative atol in the manifest used to fail elements equal to the expected value."""
    out = write(tmp_path)
    text = (out / "manifest.json").read_text()
    m = json.loads(text)
    m["tolerances"]["dx"][key] = "@@"
    text = json.dumps(m).replace('"@@"', value if isinstance(value, str) and value in
                                 ("NaN", "Infinity") else json.dumps(value))
    (out / "manifest.json").write_text(text)
    err = _one_line_exit_2(capsys, out)
    assert f"tolerances.dx.{key}" in err


@pytest.mark.parametrize("scale", [0.0, None])
def test_manifest_scale_must_be_positive_where_atol_is(tmp_path, capsys, scale):
    """(Found by hostile testing.) A scale of 0, or none, beside an atol > 0: compare divided
    by it (NumPy's warning, then an error about an array that named neither the manifest nor
    the field)."""
    out = write(tmp_path)
    m = json.loads((out / "manifest.json").read_text())
    assert m["tolerances"]["dx"]["atol"] > 0
    if scale is None:
        del m["tolerances"]["dx"]["scale"]
    else:
        m["tolerances"]["dx"]["scale"] = scale
    (out / "manifest.json").write_text(json.dumps(m))
    err = _one_line_exit_2(capsys, out)
    assert "manifest.json: tolerances.dx.scale: expected a number > 0 where atol is > 0" in err


# --------------------------------------------------------------------------- unusable manifests

@pytest.mark.parametrize("text", ["[]", '"s"', "42", "null", "true", "{", "\xff",
                                  "[" * 100000 + "]" * 100000])
def test_malformed_manifest_exits_2(tmp_path, capsys, text):
    """[], "s", 42, null used to raise AttributeError; deep nesting RecursionError."""
    out = write(tmp_path)
    (out / "manifest.json").write_bytes(text.encode("latin-1"))
    err = _one_line_exit_2(capsys, out)
    assert "manifest.json" in err


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(arrays=[]), "arrays: expected an object"),
    (lambda m: m["arrays"].update(dx=3), "arrays: no entry (an object) for dx"),
    (lambda m: m.update(batch="4"), "batch: expected an int > 0"),
    (lambda m: m.update(batch=2 ** 40), "more than golden vectors hold"),
    (lambda m: m.update(channel=-1), "channel: expected an int > 0"),
    (lambda m: m.update(dtype="fp64"), "dtype: expected one of fp32, fp16"),
    (lambda m: m["arrays"]["dx"].update(shape=[2 ** 50]), "arrays.dx.shape"),
    (lambda m: m["arrays"]["x"].update(dtype="object"), "arrays.x.dtype"),
    (lambda m: m["arrays"]["x"].update(file=["x.bin"]), "not a plain file name"),
    (lambda m: m.update(is_train="yes"), "is_train: expected 0 or 1"),
    (lambda m: m.update(file_format="tar"), "file_format"),
])
def test_malformed_manifest_fields_exit_2(tmp_path, capsys, edit, message):
    out = write(tmp_path)
    _edit_manifest(out, edit)
    assert message in _one_line_exit_2(capsys, out)


def test_npz_header_declaring_a_huge_array_exits_2(tmp_path, capsys):
    """A header declaring 2**50 elements used to end in MemoryError."""
    import zipfile
    out = write(tmp_path, "--format", "npz")
    npz = out / "vectors.npz"
    with zipfile.ZipFile(npz) as z:
        members = {name: z.read(name) for name in z.namelist()}
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (2 ** 50,)
    fake = io.BytesIO()
    np.lib.format.write_array_header_1_0(fake, header)
    members["dbias.npy"] = fake.getvalue() + b"\0" * 16
    with zipfile.ZipFile(npz, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    digest = hashlib.sha256(npz.read_bytes()).hexdigest()
    _edit_manifest(out, lambda m: m.update(archive_sha256=digest))
    err = _one_line_exit_2(capsys, out)
    assert "dbias" in err and str(2 ** 50) in err


def test_huge_vectors_are_refused_before_allocating(tmp_path, capsys):
    """--batch 100000000 --channel 100000000 used to end in a MemoryError traceback."""
    argv = ["vectors", "--batch", "100000000", "--channel", "100000000", "--dtype", "fp16",
            "--out", str(tmp_path / "v")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at most 2**26" in err and "--batch, --channel" in err
    with pytest.raises(ArgumentValueError, match="batch, channel"):
        vectors.generate(2 ** 13, 2 ** 13 + 1, "fp32")
    assert vectors.MAX_ELEMENTS == 2 ** 26


def test_memory_error_exits_2_in_one_line(tmp_path, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise MemoryError
    monkeypatch.setattr(vectors, "generate", no_memory)
    argv = ["vectors", "--batch", "4", "--channel", "8", "--dtype", "fp32",
            "--out", str(tmp_path / "v")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not enough memory" in err


# --------------------------------------------------------------------------- exact vectors, strict

def _readme_commands():
    import pathlib
    import shlex
    import re
    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
                 if "bngrad vectors" in b)
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")]
    return [shlex.split(ln.split("#")[0]) for ln in lines]


def _wrong_answers(dx):
    """The three wrong answers the exact default used to pass (fp16, batch 4, channel 64)."""
    zero = tuple(np.argwhere(dx == 0)[0])
    minus_one = tuple(np.argwhere(dx == -1.0)[0])
    nonzero = np.argwhere(dx != 0)
    smallest = tuple(nonzero[np.argmin(np.abs(dx[dx != 0]))])
    for index, value in ((zero, 0.15), (minus_one, -0.9375), (smallest, -dx[smallest])):
        wrong = dx.copy()
        wrong[index] = value
        yield index, wrong


def test_readme_example_fails_the_three_wrong_answers(tmp_path, capsys, monkeypatch):
    """README: `bngrad vectors ... --dist exact` then `bngrad compare` with its default: 0.15
    where 0 is exact, -0.9375 where -1.0 is, and a sign flip used to PASS."""
    monkeypatch.chdir(tmp_path)
    make, check = _readme_commands()
    assert make[0] == "bngrad" and check[0] == "bngrad" and "exact" in make
    assert main(make[1:]) == 0
    golden = vectors.load_vectors(make[make.index("--out") + 1])
    expected = golden.expected
    for name in OUTPUTS:   # the device's files: the right answers
        expected[name].tofile(tmp_path / f"device_{name}.bin")
    assert main(check[1:]) == 0
    assert golden.tolerances["dx"]["atol"] == 0 and golden.tolerances["dx"]["rtol"] == 0
    dx = expected["dx"]
    assert dx.dtype == np.float16 and dx.shape == (4, 64)
    for index, wrong in _wrong_answers(dx):
        wrong.tofile(tmp_path / "device_dx.bin")
        capsys.readouterr()
        assert main(check[1:]) == 1, index
        text = capsys.readouterr().out
        assert f"batch {index[0]}, channel {index[1]}" in text and "FAIL" in text
        # also a check by ULPs, as docs/dsp.md offers for non-power-of-two batches
        assert not vectors.compare(golden, {"dx": wrong}, ulp=1).passed


def test_normal_vectors_keep_the_scaled_default(tmp_path):
    golden = vectors.generate(4, 8, "fp32")
    assert golden.tolerances["dx"]["atol"] > 0 and golden.tolerances["dx"]["rtol"] > 0
    assert "exact equality" not in vectors._manifest(golden, "bin")["tolerance_rule"]
    exact = vectors.generate(4, 8, "fp32", dist="exact")
    assert "exact equality" in vectors._manifest(exact, "bin")["tolerance_rule"]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("batch", [4, 6, 8])
def test_float32_device_lands_exactly_on_exact_vectors(dtype, train, batch):
    """The promise behind the strict default: sums accumulated in float32, in two orders, and
    the formula evaluated in float32 (dividing by m) give exactly the expected outputs."""
    golden = vectors.generate(batch, 32, dtype, train=train, seed=9, dist="exact")
    f = {n: golden.arrays[n].astype(np.float32) for n in ("x", "dy", "mean", "invar", "scale")}
    for rows in (slice(None), slice(None, None, -1)):
        xhat = (f["x"][rows] - f["mean"]) * f["invar"]
        dbias = np.zeros(32, np.float32)
        dscale = np.zeros(32, np.float32)
        for dy_row, xhat_row in zip(f["dy"][rows], xhat):
            dbias += dy_row
            dscale += dy_row * xhat_row
        xhat = (f["x"] - f["mean"]) * f["invar"]
        m = np.float32(batch)
        if train:
            dx = f["scale"] * f["invar"] * (f["dy"] - dbias / m - xhat * (dscale / m))
        else:
            dx = f["dy"] * f["invar"] * f["scale"]
        device = {"dx": dx, "dbias": dbias, "dscale": dscale}
        device = {n: a.astype(golden.arrays[n].dtype) for n, a in device.items()}
        report = vectors.compare(golden, device)
        assert report.passed, report.format()


# --------------------------------------------------------------------------- ULPs and the report

F16_ONE, F16_MINUS_ONE = 0x3C00, 0xBC00


def _h(*bits):
    return np.array(bits, np.uint16).view(np.float16)


def test_ulp_distance_counts_representable_values():
    """By hand from float16 bit patterns: one step either way from -1.0 is 1 ULP (it used to
    be 0.5 toward zero), +0/-0 are 0 apart, crossing zero counts both sides."""
    d = lambda a, b: vectors.ulp_distance(_h(a), _h(b))[0]  # noqa: E731
    assert d(F16_MINUS_ONE, F16_MINUS_ONE - 1) == 1        # toward zero: -0.99951171875
    assert d(F16_MINUS_ONE, F16_MINUS_ONE + 1) == 1        # away: -1.0009765625
    assert d(F16_ONE, F16_ONE - 1) == 1 and d(F16_ONE, F16_ONE + 1) == 1
    assert d(0x0000, 0x8000) == 0                          # +0, -0
    assert d(0x0000, 0x0001) == 1 and d(0x8000, 0x0001) == 1
    assert d(0x8001, 0x0001) == 2                          # -min subnormal .. +min subnormal
    assert d(0x3C00, 0xBC00) == 2 * 0x3C00                 # sign flip of 1.0
    assert d(0x7BFF, 0x7C00) == np.inf                     # max finite vs inf
    assert d(0x7C00, 0x7C00) == 0 and d(0xFC00, 0x7C00) == np.inf
    assert d(0x7E00, 0x7E00) == 0 and d(0x7E00, 0x3C00) == np.inf   # NaN
    f32 = lambda *b: np.array(b, np.uint32).view(np.float32)  # noqa: E731
    assert vectors.ulp_distance(f32(0xBF800000), f32(0xBF7FFFFF))[0] == 1
    assert vectors.ulp_distance(f32(0x80000000), f32(0x00000003))[0] == 3


def test_ulp_distance_rejects_mixed_dtypes():
    with pytest.raises(ArgumentTypeError, match="float16"):
        vectors.ulp_distance(np.zeros(2, np.float16), np.zeros(2, np.float32))


def test_report_ulps_and_relative_error_at_zero():
    """One step toward zero from -1.0 is 1 ULP; an expected 0 has no relative error (it used to
    report inf, and 1.17e8 ULPs for 0.15 vs 0 in float32)."""
    expected = _h(F16_MINUS_ONE, 0x0000, F16_ONE)
    got = _h(F16_MINUS_ONE - 1, 0x0001, F16_ONE)
    r = vectors.compare_output("dx", got, expected, ulp=0)
    assert r.max_ulp_err == 1 and r.over == 2
    assert r.max_rel_err == pytest.approx(2.0 ** -11)       # only the element with expected -1
    (first, second) = r.failures
    assert first.ulp == 1 and first.rel_err == pytest.approx(2.0 ** -11)
    assert second.rel_err is None and second.ulp == 1 and second.abs_err == 2.0 ** -24
    f32 = vectors.compare_output("dx", np.array([0.15], np.float32),
                                 np.array([0.0], np.float32))
    assert f32.max_rel_err == 0.0 and f32.failures[0].ulp == 0x3E19999A


def test_report_lists_worst_and_first_failures(tmp_path, capsys):
    out = write(tmp_path, "--dist", "exact", dtype="fp16")
    golden = vectors.load_vectors(out)
    dx = golden.arrays["dx"].copy()
    dx[0, 3] = np.float16(dx[0, 3]) + np.float16(0.25)           # first in row-major order
    dx[1, 5] = np.float16(dx[1, 5]) + np.float16(4.0)            # worst
    dx[2, 7] = np.nextafter(dx[2, 7], np.float16(np.inf))        # third
    path = tmp_path / "device_dx.bin"
    dx.tofile(path)
    capsys.readouterr()
    assert compare(out, "--show", "2", files={"dx": path}) == 1
    text = capsys.readouterr().out
    lines = text.splitlines()
    worst = next(ln for ln in lines if ln.strip().startswith("worst"))
    exp_bits = int(golden.arrays["dx"][1, 5:6].view(np.uint16)[0])
    got_bits = int(dx[1, 5:6].view(np.uint16)[0])
    assert "batch 1, channel 5" in worst
    assert f"(0x{exp_bits:04x})" in worst and f"(0x{got_bits:04x})" in worst
    assert str(golden.arrays["dx"][1, 5]) in worst and str(dx[1, 5]) in worst
    listed = [ln for ln in lines if ln.strip().startswith("#")]
    assert len(listed) == 2 and "batch 0, channel 3" in listed[0] and \
        "batch 1, channel 5" in listed[1]
    assert "first 2 of 3 over tolerance" in text
    r = vectors.compare(golden, {"dx": dx}, show=1).outputs[0]
    assert r.worst.index == (1, 5) and [e.index for e in r.failures] == [(0, 3)]
    assert r.worst.expected_bits == exp_bits and r.worst.got_bits == got_bits
    assert r.worst.abs_err == 4.0
    assert vectors.compare(golden, {"dx": dx}, show=0).outputs[0].failures == []


def test_report_of_equal_outputs_has_no_element_listing(tmp_path, capsys):
    out = write(tmp_path)
    capsys.readouterr()
    assert compare(out) == 0
    text = capsys.readouterr().out
    assert "worst" not in text and text.rstrip().endswith("PASS")


def test_cli_show_must_not_be_negative(tmp_path, capsys):
    out = write(tmp_path)
    assert "--show" in _one_line_exit_2(capsys, out, "--show", "-1")


# --------------------------------------------------------------------------- the C in docs/dsp.md

def _doc_c_blocks():
    import pathlib
    import re
    doc = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "dsp.md").read_text()
    return re.findall(r"```c\n(.*?)```", doc, flags=re.S)


def _compile(tmp_path, source):
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler on this machine")
    (tmp_path / "t.c").write_text(source)
    subprocess.run([cc, "-std=c99", "-Wall", "-Werror", "-o", str(tmp_path / "t"),
                    str(tmp_path / "t.c")], check=True, capture_output=True)
    return tmp_path / "t"


def test_docs_c_ulp_distance_matches_python(tmp_path):
    import subprocess
    (ulp_c,) = [b for b in _doc_c_blocks() if "ulp_distance" in b]
    assert len([ln for ln in ulp_c.splitlines() if not ln.startswith(("/*", "#"))]) <= 5
    program = _compile(tmp_path, ulp_c + """
#include <stdio.h>
int main(void) {
    unsigned a, b, sign;
    while (scanf("%x %x %x", &a, &b, &sign) == 3)
        printf("%lld\\n", (long long)ulp_distance(a, b, sign));
    return 0;
}
""")
    rng = np.random.default_rng(0)
    for bits_t, float_t, sign in ((np.uint16, np.float16, 0x8000),
                                  (np.uint32, np.float32, 0x80000000)):
        width = 8 * np.dtype(bits_t).itemsize
        a = rng.integers(0, 2 ** width, 400, dtype=np.uint64).astype(bits_t)
        b = np.concatenate([rng.integers(0, 2 ** width, 200, dtype=np.uint64).astype(bits_t),
                            a[200:] ^ bits_t(1), ])     # neighbours too
        a = np.concatenate([a, np.array([0, sign, 1, sign | 1], bits_t)])
        b = np.concatenate([b, np.array([sign, 0, sign | 1, 1], bits_t)])
        finite = np.isfinite(a.view(float_t)) & np.isfinite(b.view(float_t))
        a, b = a[finite], b[finite]
        stdin = "".join(f"{x:x} {y:x} {sign:x}\n" for x, y in zip(a, b))
        out = subprocess.run([str(program)], input=stdin, capture_output=True, text=True,
                             check=True).stdout.split()
        np.testing.assert_array_equal(np.array(out, dtype=np.float64),
                                      vectors.ulp_distance(a.view(float_t), b.view(float_t)))


def test_docs_c_snippet_reads_x_and_writes_device_dx(tmp_path):
    import subprocess
    (io_c,) = [b for b in _doc_c_blocks() if "device_dx.bin" in b]
    assert len(io_c.strip().splitlines()) <= 5
    # the snippet's "..." line stands for the device: here it copies x into dx
    body = io_c.replace("/* ...", "for (int i = 0; i < N; i++) dx[i] = x[i] + dy[i]; /* ...")
    decls = [ln for ln in body.splitlines() if ln.startswith(("enum", "static"))]
    stmts = [ln for ln in body.splitlines() if ln not in decls]
    program = _compile(tmp_path, "#include <stdio.h>\n" + "\n".join(decls)
                       + "\nint main(void) {\n" + "\n".join(stmts) + "\nreturn 0;\n}\n")
    vectors.write_vectors(tmp_path / "golden", 4, 64, "fp32")
    subprocess.run([str(program)], cwd=tmp_path, check=True)
    x = np.fromfile(tmp_path / "golden" / "x.bin", "<f4")
    np.testing.assert_array_equal(np.fromfile(tmp_path / "device_dx.bin", "<f4"), x)


# --- the default tolerances per channel (hostile testing, session 20) ---------------------------

@pytest.fixture(scope="module")
def dsp_suite(tmp_path_factory):
    from bngrad import dsp_suite
    root = tmp_path_factory.mktemp("suite")
    return {c.name: vectors.load_vectors(root / c.name) for c in dsp_suite.write_suite(root)}


def float32_device(g, sequential=True, toward_zero=False):
    """A plain float32 implementation of the seed's formulas: sums in float32 (one after the
    other, or pairwise as NumPy's), results rounded to the output dtype (to nearest, or
    toward zero)."""
    f = np.float32
    x, dy, mean, invar, scale = (g.inputs[n].astype(f) for n in
                                 ("x", "dy", "mean", "invar", "scale"))
    m = f(len(x))
    xhat = (x - mean) * invar
    total = ((lambda a: np.cumsum(a, axis=0, dtype=f)[-1]) if sequential
             else (lambda a: a.sum(0, dtype=f)))
    sum_dy, sum_dy_xhat = total(dy), total(dy * xhat)
    dx = (scale * invar * (dy - sum_dy / m - xhat * (sum_dy_xhat / m)) if g.is_train
          else dy * invar * scale)
    outputs = {}
    with np.errstate(over="ignore", invalid="ignore"):
        for name, value in (("dx", dx), ("dbias", sum_dy), ("dscale", sum_dy_xhat)):
            rounded = value.astype(g.expected[name].dtype)
            if toward_zero:  # one step back where rounding to nearest went away from zero
                away = np.abs(rounded.astype(np.float64)) > np.abs(value.astype(np.float64))
                rounded = np.where(away, np.nextafter(rounded, np.zeros_like(rounded)), rounded)
            outputs[name] = rounded
    return outputs


@pytest.mark.parametrize("sequential, toward_zero", [(True, False), (False, False),
                                                     (True, True)])
def test_a_float32_device_passes_every_suite_case(dsp_suite, sequential, toward_zero):
    failed = [name for name, g in dsp_suite.items()
              if not vectors.compare(g, float32_device(g, sequential, toward_zero)).passed]
    assert not failed


def _formula_errors(g):
    """dx with a formula error each: (what, dx in float64)."""
    a = {n: v.astype(np.float64) for n, v in g.inputs.items()}
    m = len(a["x"])
    xhat = (a["x"] - a["mean"]) * a["invar"]
    k = a["scale"] * a["invar"]
    sum_dy, sum_dy_xhat = a["dy"].sum(0), (a["dy"] * xhat).sum(0)
    errors = {"no sum(dy)/m": k * (a["dy"] - xhat * sum_dy_xhat / m)}
    if m < 64:  # (at batch 4096 a factor 4096/4095 is below float16's resolution)
        errors["/(m-1) in the last term"] = k * (a["dy"] - sum_dy / m
                                                 - xhat * sum_dy_xhat / (m - 1))
    return errors


@pytest.mark.parametrize("case", ["fp16_s_b4096_c16_train_normal_pfp32",
                                  "fp16_s_b4_c64_train_zerovar", "fp32_s_b4_c64_train_normal"])
def test_formula_errors_fail_the_default_tolerances(dsp_suite, case):
    g = dsp_suite[case]
    assert vectors.compare(g, g.expected).passed
    for what, dx in _formula_errors(g).items():
        with np.errstate(over="ignore"):
            report = vectors.compare(g, {"dx": dx.astype(g.expected["dx"].dtype)})
        assert not report.passed, what


def test_a_large_channel_does_not_widen_the_others_bound(dsp_suite):
    """zerovar cases: constant channels (invar ~316) have far larger terms than the others;
    zeroing or rescaling ordinary channels must fail (with one bound per output it passed)."""
    for case in ("fp16_s_b5_c32_eval_zerovar", "fp16_s_b4_c64_train_zerovar"):
        g = dsp_suite[case]
        scales = channel_scales_of(g, "dx")
        ordinary = np.flatnonzero(scales < scales.max() / 10)
        assert ordinary.size
        for c in ordinary:
            dx = g.expected["dx"].copy()
            dx[:, c] = 0
            assert not vectors.compare(g, {"dx": dx}).passed, (case, c)
        dx = g.expected["dx"].astype(np.float64)
        dx[:, ordinary] *= 1.25
        assert not vectors.compare(g, {"dx": dx.astype(np.float16)}).passed, case


def channel_scales_of(g, name):
    """channel_scales (above) for loaded vectors."""
    x, dy, mean, invar, scale = (g.inputs[n].astype(np.float64) for n in
                                 ("x", "dy", "mean", "invar", "scale"))
    xhat = (x - mean) * invar
    terms = np.abs(dy)
    if g.is_train:
        m = len(x)
        terms = terms + np.abs(dy.sum(0)) / m + np.abs(xhat) * np.abs((dy * xhat).sum(0)) / m
    return (np.abs(invar * scale) * terms).max(0)


def test_a_shifted_channel_is_named(tmp_path):
    g = vectors.generate(64, 8, "fp32", seed=1)
    dx = g.expected["dx"].astype(np.float64)
    atol = g.tolerances["dx"]["atol"] * channel_scales_of(g, "dx") / g.tolerances["dx"]["scale"]
    dx[:, 3] += 0.75 * atol[3]    # every element within its bound, the channel shifted
    report = vectors.compare(g, {"dx": dx.astype(np.float32)})
    dx_report = report.outputs[0]
    assert dx_report.over == 0 and dx_report.shifted == 1 and dx_report.first_shifted == 3
    assert not report.passed and "shifted as a whole" in report.format()
    # a given tolerance applies element by element, as given
    assert vectors.compare(g, {"dx": dx.astype(np.float32)}, atol=atol.max()).passed


def test_exact_vectors_take_no_mean_test():
    """Exact vectors are judged by equality alone: one element off fails as one element
    over, without the mean test's diagnosis of a channel "shifted as a whole" (at atol 0 it
    fired on any error, one ULP included, and named a missing term; found by a newcomer
    following docs/dsp.md's example)."""
    g = vectors.generate(4, 64, "fp16", dist="exact")
    dx = g.expected["dx"].copy()
    dx[0, 9] = np.float16(dx[0, 9]) + np.float16(0.0625)
    report = vectors.compare(g, {"dx": dx})
    dx_report = report.outputs[0]
    assert not report.passed and dx_report.over == 1 and dx_report.shifted == 0
    assert "shifted as a whole" not in report.format()


def test_compare_takes_bytes_paths_and_refuses_a_transposed_array(tmp_path):
    out = write(tmp_path, batch=4, channel=8)
    g = vectors.load_vectors(out)
    assert vectors.compare(out, {"dx": bytes(out / "dx.bin")}).passed
    assert vectors.compare(g, {"dx": g.expected["dx"].reshape(-1)}).passed
    with pytest.raises(vectors.UnusableInputError, match=r"outputs\['dx'\]: expected shape"):
        vectors.compare(g, {"dx": np.ascontiguousarray(g.expected["dx"].T)})
