"""The DSP verification kit: the vector suite, the C99 harness and host reference, dsp-check.

The kit is built with the system C compiler into tmp_path and run on a few cases of the suite;
a reference made wrong on purpose (one ULP in one element, one channel never written) fails
with its case and element named, one that writes past a buffer is BROKE, and a case the harness
skipped or never reached is MISSING, never judged on an earlier run's outputs; the kit's
Makefile rebuilds when the implementation or the flags change; the float16 conversion agrees
with NumPy's bit for bit; a malformed case directory is an error naming the file, not a crash.
`make dsp-check` runs the whole suite, under ASan/UBSan too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from bngrad import dsp_suite, vectors
from bngrad.cli import main

CC = shutil.which("cc") or shutil.which("gcc")
MAKE, AR = shutil.which("make"), shutil.which("ar")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")
needs_make = pytest.mark.skipif(None in (CC, MAKE, AR), reason="no C compiler, make or ar")
STRICT = ["-std=c99", "-O1", "-Wall", "-Wextra", "-Werror", "-pedantic"]
BY_NAME = {case.name: case for case in dsp_suite.CASES}
# a few cases that touch every function, both parameter types and each kind of data
FEW = ["fp32_s_b4_c64_train_exact", "fp32_p_b4_c32_train_exact", "fp16_s_b4_c64_train_exact",
       "fp16_p_b4_c32_train_exact", "fp32_s_b4_c64_train_normal",
       "fp16_s_b2_c17_eval_exact_pfp32", "fp16_s_b16_c32_train_subnormal",
       "fp16_s_b4_c16_train_huge", "fp32_s_b3_c64_eval_subnormal", "fp16_s_b4_c64_train_zerovar",
       "fp32_s_b1_c17_train_normal", "fp32_s_b4_c17_train_exact_mask80"]


def build(kit, out, *sources, defines=()):
    """Compile the harness with ``sources`` (default: the host reference) under STRICT."""
    sources = sources or ("batchnormgrad_ref.c", "bng_half.c")
    cmd = [CC, *STRICT, *defines, "-I", str(kit), "-o", str(out), str(kit / "bng_harness.c"),
           *(str(kit / s) if (kit / s).exists() else str(s) for s in sources), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def harness(exe, *dirs):
    return subprocess.run([str(exe), *map(str, dirs)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit")
    assert main(["dsp-kit", "--out", str(out), "--force"]) == 0
    return out


@pytest.fixture(scope="module")
def harnesses(kit, tmp_path_factory):
    if CC is None:
        pytest.skip("no C compiler")
    bin_dir = tmp_path_factory.mktemp("bin")
    return (build(kit, bin_dir / "bng_harness"),
            build(kit, bin_dir / "bng_harness_hpf32", defines=["-DBNG_HP_PARAMS_FLOAT"]))


def suite(tmp_path, names=FEW):
    out = tmp_path / "suite"
    dsp_suite.write_suite(out, cases=[BY_NAME[n] for n in names])
    return out


def verdicts(root, capsys):
    """dsp-check's verdict for each case of ``root``, in order (its output is kept in
    ``verdicts.out``)."""
    capsys.readouterr()
    main(["dsp-check", str(root)])
    verdicts.out = capsys.readouterr().out
    return [line.split()[0] for line in verdicts.out.splitlines()[:-1]]


# --------------------------------------------------------------------------- the suite

def test_suite_covers_the_issue_and_stays_small(tmp_path):
    cases = dsp_suite.CASES
    assert {1, 2, 3, 4096} <= {c.batch for c in cases}
    assert {1, 15, 16, 17, 31, 32, 33, 64, 1000} <= {c.channel for c in cases}
    assert {c.function_name for c in cases} == {f"{p}_batch_norm_grad_{s}" for p in ("fp", "hp")
                                                for s in ("s", "p")}
    assert {c.dist for c in cases} >= {"normal", "exact", "offset", "huge", "subnormal",
                                       "zerovar"}
    assert {c.train for c in cases} == {True, False}
    assert {c.params for c in cases if c.dtype == "fp16"} == {"fp16", "fp32"}
    assert len({c.core_mask for c in cases if c.function == "s"}) >= 5
    # the reference's two examples: shared storage 4 x 64 on 0xff, private storage 4 x 32
    assert BY_NAME["fp32_s_b4_c64_train_normal"].core_mask == 0xFF
    assert "fp32_p_b4_c32_train_normal" in BY_NAME

    assert main(["vectors", "--suite", "dsp", "--out", str(tmp_path / "s")]) == 0
    root = tmp_path / "s"
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 20e6
    assert dsp_suite.read_index(root) == [c.name for c in cases]
    for case in cases:
        golden = vectors.load_vectors(root / case.name)
        manifest = json.loads((root / case.name / "manifest.json").read_text())
        fields = dict(line.split(" ", 1) for line in (root / case.name / "case.txt")
                      .read_text().splitlines() if line and not line.startswith("#"))
        assert (golden.batch, golden.channel, golden.dtype, golden.param_dtype,
                golden.is_train, golden.distribution) == (
            int(fields["batch"]), int(fields["channel"]), fields["dtype"],
            fields["param_dtype"], fields["is_train"] == "1", case.dist)
        assert fields["function"] == manifest["dsp_case"]["function"] == case.function_name
        assert ("core_mask" in fields) == (case.function == "s")
        assert manifest["dsp_case"]["exercises"] and all(np.isfinite(a).all()
                                                         for a in golden.arrays.values())


def test_suite_refuses_to_overwrite_and_force_removes_stale_outputs(tmp_path, capsys):
    root = suite(tmp_path, FEW[:2])
    stale = root / FEW[0] / "dx.out.bin"
    stale.write_bytes(b"old")
    (root / FEW[1] / "broke.txt").write_text("fp_batch_norm_grad_p wrote into input x\n")
    before = (root / FEW[0] / "x.bin").read_bytes()
    assert main(["vectors", "--suite", "dsp", "--out", str(root)]) == 2
    assert "--force" in capsys.readouterr().err and stale.exists()
    assert main(["vectors", "--suite", "dsp", "--out", str(root), "--batch", "4"]) == 2
    assert "--batch: not used with --suite" in capsys.readouterr().err
    dsp_suite.write_suite(root, overwrite=True, cases=[BY_NAME[n] for n in FEW[:2]])
    assert not stale.exists() and (root / FEW[0] / "x.bin").read_bytes() == before
    assert not (root / FEW[1] / "broke.txt").exists()


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_regimes_are_what_they_claim(dtype):
    t = np.dtype(np.float16 if dtype == "fp16" else np.float32)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    offset = vectors.generate(64, 16, dtype, dist="offset").arrays
    assert (np.abs(f64(offset["mean"])) > 60 * f64(offset["x"]).std(axis=0)).all()
    huge = vectors.generate(8, 16, dtype, dist="huge").arrays
    assert (np.abs(f64(huge["x"])) > 0.25 * float(np.finfo(t).max)).all()
    assert all(np.isfinite(a).all() for a in huge.values())
    sub = vectors.generate(8, 16, dtype, dist="subnormal").arrays
    assert (np.abs(f64(sub["dy"])) < float(np.finfo(t).smallest_normal)).all()
    assert (sub["dy"] != 0).mean() > 0.9 and (sub["dx"] != 0).any()
    zero = vectors.generate(8, 17, dtype, dist="zerovar").arrays
    spread = f64(zero["x"]).max(axis=0) - f64(zero["x"]).min(axis=0)
    assert (spread[::4] == 0).all() and (spread[1::4] > 0).all()


# --------------------------------------------------------------------------- the C kit

def test_half_conversion_matches_numpy_bit_for_bit(kit, tmp_path):
    if CC is None:
        pytest.skip("no C compiler")
    src = tmp_path / "conv.c"
    src.write_text(r'''
#include <stdio.h>
#include <string.h>
#include "bng_half.h"
int main(int argc, char **argv) {
    FILE *in = fopen(argv[1], "rb"), *halves = fopen(argv[2], "wb");
    FILE *doubles = fopen(argv[3], "wb");
    double d;
    unsigned i;
    uint16_t h;
    (void)argc;
    for (i = 0; i < 65536; i++) {
        d = bng_half_to_double((uint16_t)i);
        fwrite(&d, 8, 1, doubles);
    }
    while (fread(&d, 8, 1, in) == 1) {
        h = bng_double_to_half(d);
        fwrite(&h, 2, 1, halves);
    }
    fclose(in); fclose(halves); fclose(doubles);
    return 0;
}
''')
    exe = tmp_path / "conv"
    subprocess.run([CC, *STRICT, "-I", str(kit), "-o", str(exe), str(src),
                    str(kit / "bng_half.c"), "-lm"], check=True, capture_output=True)
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = np.sort(np.unique(every[np.isfinite(every)].astype(np.float64)))
    mid = (finite[:-1] + finite[1:]) / 2                  # ties: to even
    rng = np.random.default_rng(0)
    doubles = np.concatenate([
        finite, mid, np.nextafter(mid, np.inf), np.nextafter(mid, -np.inf),
        [65504.0, 65519.99, 65520.0, 65536.0, 1e300, 2.0 ** -25, 2.0 ** -26, 3 * 2.0 ** -26,
         5e-324, 0.0, -0.0, np.inf, -np.inf, np.nan],
        rng.choice([-1, 1], 20000) * 2.0 ** rng.uniform(-30, 17, 20000)])
    (tmp_path / "in.bin").write_bytes(doubles.astype("<f8").tobytes())
    subprocess.run([str(exe), tmp_path / "in.bin", tmp_path / "h.bin", tmp_path / "d.bin"],
                   check=True)
    got_half = np.fromfile(tmp_path / "h.bin", dtype="<u2")
    with np.errstate(over="ignore"):
        want_half = doubles.astype(np.float16)
    nan = np.isnan(want_half)
    assert np.isnan(got_half.view(np.float16)[nan]).all()
    np.testing.assert_array_equal(got_half[~nan], want_half[~nan].view(np.uint16))
    got_double = np.fromfile(tmp_path / "d.bin", dtype="<f8")
    np.testing.assert_array_equal(got_double, every.astype(np.float64))  # NaN == NaN here


@needs_cc
def test_kit_builds_strict_and_passes_its_cases(kit, harnesses, tmp_path, capsys):
    root = suite(tmp_path)
    for args in ([harnesses[0]], [harnesses[1], "-k"]):   # as `make run`: -k keeps the
        run = harness(*args, root)                          # first build's outputs
        assert run.returncode == 0, run.stderr
    assert main(["dsp-check", str(root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines[:-1]] == [["PASS", name] for name in FEW]
    assert lines[-1] == f"{len(FEW)} cases: {len(FEW)} PASS"


WRONG = r'''
/* The host reference, made wrong on purpose in one function. */
#include <string.h>
#define fp_batch_norm_grad_p ref_fp_batch_norm_grad_p
#define hp_batch_norm_grad_s ref_hp_batch_norm_grad_s
#include "batchnormgrad_ref.c"
#undef fp_batch_norm_grad_p
#undef hp_batch_norm_grad_s
void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params);
void hp_batch_norm_grad_s(half *x, half *dy, half *dx, long long *params, int core_mask);

void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params)
{
    uint32_t bits;      /* one ULP off in dx at batch 1, channel 5 */
    ref_fp_batch_norm_grad_p(x, dy, dx, params);
    memcpy(&bits, &dx[params[6] + 5], 4);
    bits += 1;
    memcpy(&dx[params[6] + 5], &bits, 4);
}

void hp_batch_norm_grad_s(half *x, half *dy, half *dx, long long *params, int core_mask)
{
    /* channel 7 never written: keep what dx, dbias, dscale held there */
    long long b, channel = params[6];
    half keep_dx[8], keep_dbias, keep_dscale;
    half *dbias = (half *)(intptr_t)params[3], *dscale = (half *)(intptr_t)params[4];
    for (b = 0; b < params[5]; b++)
        keep_dx[b] = dx[b * channel + 7];
    keep_dbias = dbias[7];
    keep_dscale = dscale[7];
    ref_hp_batch_norm_grad_s(x, dy, dx, params, core_mask);
    for (b = 0; b < params[5]; b++)
        dx[b * channel + 7] = keep_dx[b];
    dbias[7] = keep_dbias;
    dscale[7] = keep_dscale;
}
'''


@needs_cc
def test_wrong_reference_fails_with_case_and_element_named(kit, tmp_path, capsys):
    (tmp_path / "wrong.c").write_text(WRONG)
    exe = build(kit, tmp_path / "wrong_harness", tmp_path / "wrong.c", "bng_half.c")
    names = FEW[:4]     # fp32 _s, fp32 _p, fp16 _s, fp16 _p; exact data, batch 4
    root = suite(tmp_path, names)
    assert harness(exe, root).returncode == 0
    assert main(["dsp-check", str(root), "--report"]) == 1
    out = capsys.readouterr().out
    lines = {line.split()[1]: line for line in out.splitlines() if line[:4] in ("PASS", "FAIL")}
    assert lines["fp32_s_b4_c64_train_exact"].startswith("PASS")
    assert lines["fp16_p_b4_c32_train_exact"].startswith("PASS")
    ulp = lines["fp32_p_b4_c32_train_exact"]
    assert ulp.startswith("FAIL") and "dx: 1 of 128 over tolerance" in ulp
    assert "first at batch 1, channel 5" in ulp and ", 1 ULP" in ulp
    skipped = lines["fp16_s_b4_c64_train_exact"]
    assert skipped.startswith("FAIL") and "dx: 4 of 256 over tolerance" in skipped
    assert "first at batch 0, channel 7" in skipped and "got nan" in skipped
    results = {r.name: r for r in dsp_suite.check_suite(root)}
    for output in results["fp16_s_b4_c64_train_exact"].report.outputs:
        assert output.over == (4 if output.name == "dx" else 1)
        assert output.first_over[-1] == 7
    assert out.splitlines()[-1] == "4 cases: 2 PASS, 2 FAIL"


STOPS = r"""
/* The host reference, except that fp_batch_norm_grad_p stops the harness, as a crash would
   (exit, not a signal: no core file). */
#include <stdlib.h>
#define fp_batch_norm_grad_p ref_fp_batch_norm_grad_p
#include "batchnormgrad_ref.c"
#undef fp_batch_norm_grad_p
void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params);

void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params)
{
    (void)x, (void)dy, (void)dx, (void)params;
    exit(99);
}
"""

OVERRUN = r"""
/* The host reference, except that fp_batch_norm_grad_s writes one element past the end of dx
   and fp_batch_norm_grad_p into its input x. */
#define fp_batch_norm_grad_s ref_fp_batch_norm_grad_s
#define fp_batch_norm_grad_p ref_fp_batch_norm_grad_p
#include "batchnormgrad_ref.c"
#undef fp_batch_norm_grad_s
#undef fp_batch_norm_grad_p
void fp_batch_norm_grad_s(float *x, float *dy, float *dx, long long *params, int core_mask);
void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params);

void fp_batch_norm_grad_s(float *x, float *dy, float *dx, long long *params, int core_mask)
{
    ref_fp_batch_norm_grad_s(x, dy, dx, params, core_mask);
    dx[params[5] * params[6]] = 0.0f;
}

void fp_batch_norm_grad_p(float *x, float *dy, float *dx, long long *params)
{
    ref_fp_batch_norm_grad_p(x, dy, dx, params);
    x[0] += 1.0f;
}
"""


@needs_cc
def test_cases_skipped_or_never_reached_are_missing(kit, harnesses, tmp_path, capsys):
    """The harness left an earlier run's outputs in place for a case it skipped (-DBNG_NO_HP,
    the FT78NE build) or never reached (the library stopped it before), and dsp-check passed
    cases the library never ran."""
    root = suite(tmp_path, FEW[:4])     # fp32 _s, fp32 _p, fp16 _s, fp16 _p

    def reference_run():
        assert harness(harnesses[0], root).returncode == 0
        assert verdicts(root, capsys) == ["PASS"] * 4

    reference_run()
    run = harness(build(kit, tmp_path / "no_hp", defines=["-DBNG_NO_HP"]), root)
    assert run.returncode == 0 and run.stdout.count("skip   ") == 2
    assert verdicts(root, capsys) == ["PASS", "PASS", "MISSING", "MISSING"]
    assert (f"MISSING {FEW[2]}  no dx.out.bin, dbias.out.bin, dscale.out.bin: not run (the "
            "harness skipped this case, saying why, or stopped before it") in verdicts.out

    reference_run()
    (tmp_path / "stops.c").write_text(STOPS)
    stops = build(kit, tmp_path / "stops", tmp_path / "stops.c", "bng_half.c")
    assert harness(stops, root).returncode == 99
    assert verdicts(root, capsys) == ["PASS", "MISSING", "MISSING", "MISSING"]

    # the hp_ cases with float16 parameters are the first build's: the second keeps their
    # outputs with -k (as `make run` runs it), and only then
    reference_run()
    assert harness(harnesses[1], "-k", root).returncode == 0
    assert verdicts(root, capsys) == ["PASS"] * 4
    assert harness(harnesses[1], root).returncode == 0
    assert verdicts(root, capsys) == ["PASS", "PASS", "MISSING", "MISSING"]


@needs_cc
def test_a_write_past_a_buffer_is_broke_in_dsp_check(kit, harnesses, tmp_path, capsys):
    """The harness caught a write past the end of dx (its message cut off before the buffer's
    name) and exited 1, but left only correct outputs behind: dsp-check said PASS, and from a
    board, where only the files come back, nothing else told."""
    (tmp_path / "overrun.c").write_text(OVERRUN)
    exe = build(kit, tmp_path / "overrun", tmp_path / "overrun.c", "bng_half.c")
    root = suite(tmp_path, FEW[:2])     # fp32 _s, fp32 _p
    run = harness(exe, root)
    assert run.returncode == 1
    assert f"broke  {root / FEW[0]}: fp_batch_norm_grad_s wrote past the end of dx\n" in run.stdout
    assert f"broke  {root / FEW[1]}: fp_batch_norm_grad_p wrote into input x\n" in run.stdout
    assert (root / FEW[0] / "broke.txt").read_text() == \
        "fp_batch_norm_grad_s wrote past the end of dx\n"
    assert verdicts(root, capsys) == ["BROKE", "BROKE"]
    lines = verdicts.out.splitlines()
    assert lines[0] == (f"BROKE   {FEW[0]}  fp_batch_norm_grad_s wrote past the end of dx (the "
                        "harness's broke.txt)")
    assert "fp_batch_norm_grad_p wrote into input x" in lines[1]
    assert lines[-1] == "2 cases: 2 BROKE"
    assert main(["dsp-check", str(root)]) == 1
    capsys.readouterr()
    # the next run starts clean
    assert harness(harnesses[0], root).returncode == 0
    assert not (root / FEW[0] / "broke.txt").exists()
    assert verdicts(root, capsys) == ["PASS", "PASS"]


@needs_make
def test_make_rebuilds_when_the_implementation_or_flags_change(tmp_path, capsys):
    """After a build of the reference, `make IMPL=wrong.c` with wrong.c older than the harness
    said "Nothing to be done", and a library named only in LDLIBS was never relinked: the
    reference was tested again, a false PASS on every case."""
    kit = tmp_path / "kit"
    assert main(["dsp-kit", "--out", str(kit)]) == 0
    root = suite(tmp_path, FEW[:4])     # all four run by bng_harness (hp_ parameters half)
    (kit / "wrong.c").write_text(WRONG)
    os.utime(kit / "wrong.c", (1e9, 1e9))     # 2001: older than any harness built here
    for lib, source in (("ref", "batchnormgrad_ref.c"), ("wrong", "wrong.c")):
        subprocess.run([CC, "-std=c99", "-O1", "-c", source, "bng_half.c"], cwd=kit, check=True)
        subprocess.run([AR, "rcs", f"lib{lib}.a", source[:-1] + "o", "bng_half.o"], cwd=kit,
                       check=True)
    harness_exe = kit / "bng_harness"

    def make_and_run(*settings):
        done = subprocess.run([MAKE, "-C", str(kit), "bng_harness", *settings],
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
        assert harness(harness_exe, root).returncode == 0
        return verdicts(root, capsys)

    wrong = ["PASS", "FAIL", "FAIL", "PASS"]
    assert make_and_run() == ["PASS"] * 4
    assert make_and_run("IMPL=wrong.c bng_half.c") == wrong
    built = harness_exe.stat().st_mtime_ns
    assert make_and_run("IMPL=wrong.c bng_half.c") == wrong
    assert harness_exe.stat().st_mtime_ns == built      # the same settings: no rebuild
    assert make_and_run("IMPL=", "LDLIBS=-L. -lref -lm") == ["PASS"] * 4
    assert make_and_run("IMPL=", "LDLIBS=-L. -lwrong -lm") == wrong
    assert make_and_run("IMPL=", "LDLIBS=-L. -lwrong -lm", "CFLAGS=-std=c99 -O0") == wrong
    assert harness_exe.stat().st_mtime_ns != built


@needs_make
def test_make_run_runs_both_builds_and_never_leaves_old_outputs(tmp_path, capsys):
    """(Found by a newcomer.) `make run` stopped after the first harness exited 1 (a case broke
    a buffer), so the hp_ cases with float parameters were never run (MISSING); and where the
    build of an IMPL failed, no harness ran, the earlier run's outputs stayed, and dsp-check
    passed them. Also: an IMPL outside the kit directory finds the kit's headers."""
    kit = tmp_path / "kit"
    assert main(["dsp-kit", "--out", str(kit)]) == 0
    names = [FEW[0], FEW[1], FEW[2], "fp16_s_b2_c17_eval_exact_pfp32"]
    root = suite(tmp_path, names)
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / "overrun.c").write_text(OVERRUN)

    def make_run(*settings):
        return subprocess.run([MAKE, "-C", str(kit), "run", f"SUITE={root}", *settings],
                              capture_output=True, text=True)

    done = make_run(f"IMPL={elsewhere / 'overrun.c'} bng_half.c")
    assert done.returncode != 0, done.stdout + done.stderr
    assert verdicts(root, capsys) == ["BROKE", "BROKE", "PASS", "PASS"], verdicts.out
    assert make_run().returncode == 0
    assert verdicts(root, capsys) == ["PASS"] * 4
    (elsewhere / "typo.c").write_text("this is not C\n")
    done = make_run(f"IMPL={elsewhere / 'typo.c'} bng_half.c")
    assert done.returncode != 0 and "typo.c" in done.stderr
    assert verdicts(root, capsys) == ["MISSING"] * 4, verdicts.out


@needs_cc
def test_harness_refuses_malformed_case_directories(harnesses, tmp_path):
    exe = harnesses[0]
    root = suite(tmp_path, FEW[:1])
    case = root / FEW[0]
    text = (case / "case.txt").read_text()
    x = (case / "x.bin").read_bytes()

    (case / "x.bin").write_bytes(x[:-1])
    run = harness(exe, case)
    assert run.returncode == 2 and "x.bin: has 1023 bytes, expected 1024" in run.stderr
    (case / "x.bin").write_bytes(x + b"\0")
    run = harness(exe, case)
    assert run.returncode == 2 and "x.bin: has more than 1024 bytes, expected 1024" in run.stderr
    (case / "x.bin").write_bytes(x)
    for bad, message in [(text.replace("batch 4", "batch 0"), "unusable value for batch"),
                         (text.replace("batch 4", "batch 4x"), "unusable value for batch"),
                         (text.replace("channel 64", "channel 67108865"),
                          "unusable value for channel"),
                         (text + "batch 4\n", "repeated key batch"),
                         (text + "colour blue\n", "unknown key colour"),
                         (text.replace("core_mask 0xff\n", ""), "core_mask: expected"),
                         (text.replace("fp_batch_norm_grad_s", "fp_batch_norm_grad_q"),
                          "function: expected"),
                         ("x" * 600 + "\n", "line too long")]:
        (case / "case.txt").write_text(bad)
        run = harness(exe, case)
        assert run.returncode == 2 and message in run.stderr, (message, run.stderr)
    (case / "case.txt").write_text(text)
    (root / "index.txt").write_text("../elsewhere\n")
    run = harness(exe, root)
    assert run.returncode == 2 and "index.txt: line 1: expected a case directory name" in run.stderr
    run = harness(exe, tmp_path / "nowhere")
    assert run.returncode == 2 and "no case.txt" in run.stderr
    assert harness(exe, case).returncode == 0


def test_dsp_check_says_missing_and_unusable(tmp_path, capsys):
    root = suite(tmp_path, FEW[:2])
    assert main(["dsp-check", str(root)]) == 1
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()] == ["MISSING", "MISSING", "2"]
    assert "no dx.out.bin, dbias.out.bin, dscale.out.bin: not run (the harness" in out
    for name in FEW[:2]:
        for output, file in dsp_suite.OUTPUT_FILES.items():
            shutil.copy(root / name / f"{output}.bin", root / name / file)
    (root / FEW[1] / "dx.out.bin").write_bytes(b"\0" * 3)
    assert main(["dsp-check", str(root)]) == 2
    out = capsys.readouterr().out
    assert f"PASS    {FEW[0]}" in out and f"ERROR   {FEW[1]}" in out and "3 bytes" in out
    assert main(["dsp-check", str(tmp_path / "nowhere")]) == 2
    assert "index.txt" in capsys.readouterr().err


def test_dsp_check_refuses_outputs_of_another_case_than_the_manifests(tmp_path, capsys):
    """(Found by hostile testing.) The harness runs what case.txt says; a case.txt edited to
    another function (or core mask, size) gave a PASS for outputs the named function never
    wrote (here: the expected values themselves). Now an ERROR naming the line; also without
    a case.txt."""
    root = suite(tmp_path, FEW[:1])
    case = root / FEW[0]
    for output, file in dsp_suite.OUTPUT_FILES.items():
        shutil.copy(case / f"{output}.bin", case / file)
    assert main(["dsp-check", str(root)]) == 0
    assert capsys.readouterr().out.startswith(f"PASS    {FEW[0]}")
    text = (case / "case.txt").read_text()
    edits = [("\nfunction fp_batch_norm_grad_s", "\nfunction fp_batch_norm_grad_p", "function"),
             ("\nbatch 4", "\nbatch 14", "batch"), ("\ncore_mask 0xff", "\ncore_mask 0x01",
                                                      "core_mask")]  # (key lines, not comments)
    for old, new, key in edits:
        assert old in text
        (case / "case.txt").write_text(text.replace(old, new, 1))
        assert main(["dsp-check", str(root)]) == 2
        out = capsys.readouterr().out
        assert out.startswith(f"ERROR   {FEW[0]}") and f"case.txt says {key}:" in out, out
    # lines the harness refuses (tests/test_dsp_kit.py's harness test): dsp-check did not
    for junk, said in [("colour blue\n", "unknown key 'colour'"),
                       ("batch 4\n", "repeated key 'batch'"),
                       ("two words here\n", "expected `key value`"), ("lonely\n", "expected"),
                       ("# " + "x" * 600 + "\n", "longer than 510 characters")]:
        (case / "case.txt").write_text(text + junk)
        assert main(["dsp-check", str(root)]) == 2
        out = capsys.readouterr().out
        assert out.startswith(f"ERROR   {FEW[0]}") and said in out, out
    (case / "case.txt").write_text(text.replace("\nbatch 4", "\nbatch 4\f"))  # (C: not a space)
    assert main(["dsp-check", str(root)]) == 2
    assert "case.txt says batch: '4\\x0c'" in capsys.readouterr().out
    (case / "case.txt").write_text(text.replace("\n", "\r\n") + "\n \t # a comment\n")
    assert main(["dsp-check", str(root)]) == 0
    capsys.readouterr()
    (case / "case.txt").unlink()
    assert main(["dsp-check", str(root)]) == 2
    assert "no case.txt: the harness reads the case from it" in capsys.readouterr().out


def test_dsp_check_refuses_a_core_mask_line_in_a_private_storage_case(tmp_path, capsys):
    """(Found by review.) A _p case's case.txt given a core_mask line, which the harness
    refuses, passed: only the manifest's own keys were compared."""
    root = suite(tmp_path, [FEW[1]])     # fp32 _p
    case = root / FEW[1]
    for output, file in dsp_suite.OUTPUT_FILES.items():
        shutil.copy(case / f"{output}.bin", case / file)
    assert main(["dsp-check", str(root)]) == 0
    capsys.readouterr()
    with open(case / "case.txt", "a") as f:
        f.write("core_mask 0xff\n")
    assert main(["dsp-check", str(root)]) == 2
    assert "case.txt has a core_mask line, which the manifest's case has not" in \
        capsys.readouterr().out


def test_dsp_kit_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "kit"
    assert main(["dsp-kit", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(dsp_suite.KIT_FILES)
    (out / "Makefile").write_text("mine")
    assert main(["dsp-kit", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err and (out / "Makefile").read_text() == "mine"
    assert main(["dsp-kit", "--out", str(out), "--force"]) == 0
    assert (out / "Makefile").read_text() != "mine"


def test_dsp_kit_with_a_folder_where_a_file_goes_writes_nothing(tmp_path, capsys):
    """--force over a kit whose Makefile is a folder: refused before any file is written (it
    wrote README.txt, then failed on the Makefile)."""
    out = tmp_path / "kit"
    (out / "Makefile").mkdir(parents=True)
    assert main(["dsp-kit", "--out", str(out), "--force"]) == 2
    assert "holds a folder named Makefile where the kit writes a file" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["Makefile"]


def test_dsp_check_refuses_a_case_that_leads_out_of_the_suite(tmp_path, capsys):
    """A case folder that is a symbolic link out of the suite is an ERROR, not followed; a
    link inside the suite is followed."""
    root = suite(tmp_path, FEW[:2])
    for name in FEW[:2]:
        for output, file in dsp_suite.OUTPUT_FILES.items():
            shutil.copy(root / name / f"{output}.bin", root / name / file)
    shutil.move(root / FEW[0], tmp_path / "outside")
    (root / FEW[0]).symlink_to(tmp_path / "outside")
    shutil.move(root / FEW[1], root / "inside")
    (root / FEW[1]).symlink_to(root / "inside")
    assert main(["dsp-check", str(root)]) == 2
    out = capsys.readouterr().out
    assert f"ERROR   {FEW[0]}" in out and "leads out of the suite" in out
    assert f"PASS    {FEW[1]}" in out


def test_dsp_check_names_link_loops_and_outputs_that_lead_out(tmp_path, capsys):
    """A case folder that is a symbolic link loop is an ERROR (was a traceback), a suite root
    that is one is unusable input, and an output file linking out of its case is refused as
    an input file is."""
    root = suite(tmp_path, FEW[:3])
    for name in FEW[:3]:
        for output, file in dsp_suite.OUTPUT_FILES.items():
            shutil.copy(root / name / f"{output}.bin", root / name / file)
    shutil.rmtree(root / FEW[0])
    (root / FEW[0]).symlink_to(FEW[0])  # itself
    shutil.move(root / FEW[1] / "dx.out.bin", tmp_path / "dx.out.bin")
    (root / FEW[1] / "dx.out.bin").symlink_to(tmp_path / "dx.out.bin")
    assert main(["dsp-check", str(root)]) == 2
    out = capsys.readouterr().out
    assert f"ERROR   {FEW[0]}" in out and "is a symbolic link loop" in out
    assert f"ERROR   {FEW[1]}" in out and "is a link that leads outside" in out
    assert f"PASS    {FEW[2]}" in out
    (tmp_path / "loop").symlink_to("loop")
    assert main(["dsp-check", str(tmp_path / "loop")]) == 2
    assert "unusable input" in capsys.readouterr().err
