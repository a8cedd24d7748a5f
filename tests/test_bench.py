"""`bngrad bench` and its library (bngrad._bench): the instrument, on tiny cases.

Speed itself is not tested here (that is what the benchmark reports); these tests check that
the instrument measures what it says: the floor kernel computes a*dy + b*x, the memory probe
sees a temporary, filters select the right cases, and a run writes a table, JSON and a PNG,
with and without PyTorch.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from bngrad import _bench as bench
from bngrad import _dtypes, cli
from bngrad._bench import machine, measure, results
from bngrad.errors import ArgumentValueError
from tolerances import assert_close

TINY = [
    bench.Case((4, 3, 5, 6), "float32", "contiguous"),
    bench.Case((4, 3, 5, 6), "bfloat16", "channels_last"),
    bench.Case((33, 5), "float32", "contiguous"),
    bench.Case((2, 4, 3, 5), "float32", "mixed"),
    bench.Case((2, 4, 3, 5), "float16", "sliced"),
]


def _expected_floor(dy, x, a, b):
    shape = [1] * x.ndim
    shape[1] = -1
    a64, b64 = a.astype(np.float64).reshape(shape), b.astype(np.float64).reshape(shape)
    return a64 * dy.astype(np.float64) + b64 * x.astype(np.float64)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "mixed_r"])
@pytest.mark.parametrize("shape", [(3, 5, 7, 9), (70000, 3), (2, 3, 40000), (5, 2, 3, 4, 6)],
                         ids=lambda s: "x".join(map(str, s)))
def test_floor_computes_a_dy_plus_b_x(shape, layout, dtype):
    """Every kernel path (runs per channel, tiled coefficients, several tiles) vs NumPy."""
    data = bench.make_arrays(bench.Case(shape, dtype, layout), seed=3)
    C = shape[1]
    rng = np.random.default_rng(1)
    a, b = rng.uniform(-2, 2, C), rng.uniform(-2, 2, C)
    for threads in (1, 2):
        got = bench.floor_pass(data.floor_dy, data.floor_x, a, b, num_threads=threads)
        assert got.dtype == _dtypes.spec(dtype).numpy and got.shape == shape
        assert got.strides == data.floor_x.strides, "floor output must keep the input's layout"
        ct = np.float64 if dtype == "float64" else np.float32
        expected = _expected_floor(data.floor_dy, data.floor_x, a.astype(ct), b.astype(ct))
        assert_close(got, expected, what=f"floor dx ({threads} threads)")


def test_floor_in_place_matches_and_reuses_its_output():
    data = bench.make_arrays(bench.Case((4, 6, 8, 8), "float32", "contiguous"))
    a, b = np.full(6, 2.0), np.full(6, -1.0)
    fresh = bench.make_floor(data.floor_dy, data.floor_x, a, b)
    fixed = bench.make_floor(data.floor_dy, data.floor_x, a, b, in_place=True)
    first, second = fixed(), fixed()
    assert first is second
    np.testing.assert_array_equal(fresh(), first)
    assert fresh() is not fresh()


@pytest.mark.parametrize("case", TINY, ids=lambda c: c.label)
def test_bngrad_out_contender_writes_bngrads_result_into_one_buffer(case):
    from bngrad._bench.contenders import CONTENDERS
    data = bench.make_arrays(case, seed=2)
    opts = bench.Options(threads=2)
    fresh = CONTENDERS["bngrad"][0](data, 2, opts)
    into_out = CONTENDERS["bngrad_out"][0](data, 2, opts)
    first, second = into_out()[0], into_out()[0]
    assert first is second, "bngrad_out must reuse one grad_input buffer"
    bits = f"u{first.dtype.itemsize}"  # the same bits (NumPy compares no bfloat16)
    np.testing.assert_array_equal(fresh()[0].view(bits), first.view(bits))


def test_summary_gives_large_float32_cases_into_out_per_layout():
    def result(shape, layout, out_ms, floor_ms):
        timings = {"bngrad_out": measure.Timing([out_ms], 1),
                   "floor_in_place": measure.Timing([floor_ms], 1)}
        return results.CaseResult(bench.Case(shape, "float32", layout), timings)
    big, small = (32, 256, 56, 56), (4, 3, 5, 6)
    cases = [result(big, "contiguous", 1.2, 1.0), result(big, "contiguous", 3.0, 2.0),
             result(big, "contiguous", 1.0, 1.0), result(big, "channels_last", 1.7, 1.0),
             result(small, "channels_last", 9.0, 1.0), result(big, "mixed", 9.0, 1.0)]
    summary = results.SuiteResult("quick", bench.Options(threads=2), {}, cases).summary()
    assert summary["median_out_ratio_to_floor_in_place_fp32_ge_64mib"] == pytest.approx(
        {"contiguous": 1.2, "channels_last": 1.7})


def test_floor_rejects_arrays_of_different_layouts():
    data = bench.make_arrays(bench.Case((2, 3, 4, 5), "float32", "mixed"))
    with pytest.raises(ValueError, match="same strides|equal strides"):
        bench.make_floor(data.grad_out, data.input, np.ones(3), np.ones(3))


@pytest.mark.parametrize("layout", list(bench.LAYOUTS))
def test_case_arrays_have_the_layout_they_claim(layout):
    case = bench.Case((2, 3, 4, 5), "float32", layout)
    d = bench.make_arrays(case)
    assert d.grad_out.shape == d.input.shape == case.shape
    cl_strides = (4 * 5 * 3 * 4, 4, 5 * 3 * 4, 3 * 4)  # NHWC memory, NCHW shape
    c_strides = (3 * 4 * 5 * 4, 4 * 5 * 4, 5 * 4, 4)
    dy_strides, x_strides = {
        "contiguous": (c_strides, c_strides), "channels_last": (cl_strides, cl_strides),
        "mixed": (cl_strides, c_strides), "mixed_r": (c_strides, cl_strides),
    }.get(layout, (c_strides, None))
    assert d.grad_out.strides == dy_strides
    if layout == "sliced":
        assert not d.input.flags.c_contiguous and d.input.strides[-1] == 4
    else:
        assert d.input.strides == x_strides
    # the floor runs on dense arrays in the input's layout, with the same values
    assert d.floor_dy.strides == d.floor_x.strides
    np.testing.assert_array_equal(d.floor_dy, d.grad_out)
    np.testing.assert_array_equal(d.floor_x, d.input)


def test_select_cases_filters_and_aliases():
    default = bench.select_cases("default")
    shapes = {(c.shape, c.dtype, c.layout) for c in default}
    for shape in [(32, 64, 112, 112), (32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14),
                  (32, 2048, 7, 7)]:  # the ResNet-50 shapes, both layouts, float32
        assert (shape, "float32", "contiguous") in shapes
        assert (shape, "float32", "channels_last") in shapes
    assert {c.layout for c in default} == set(bench.LAYOUTS)
    assert {"bfloat16", "float16"} <= {c.dtype for c in default}

    bf = bench.select_cases("default", ["bf16"], ["nhwc"])
    assert bf and all(c.dtype == "bfloat16" and c.layout == "channels_last" for c in bf)
    both = bench.select_cases("resnet50", ["fp32,bfloat16"], ["NCHW"])
    assert {c.dtype for c in both} == {"float32", "bfloat16"}
    assert len(both) == len(bench.RESNET50_SHAPES) * 2
    # small layers, each map in both layouts, and 2-D ones; all below 2 MiB per array
    small = bench.select_cases("small")
    assert {(c.shape, c.layout) for c in small if len(c.shape) == 4} == {
        (s, lay) for s in [(16, 128, 14, 14), (16, 512, 4, 4), (64, 64, 8, 8), (4, 256, 7, 7),
                           (8, 64, 28, 28)] for lay in ("contiguous", "channels_last")}
    assert any(len(c.shape) == 2 for c in small)
    assert all(c.bytes_per_array < 2 << 20 for c in small)


@pytest.mark.parametrize("args, message", [
    (("nope", None, None), "^suite: unknown suite 'nope'"),
    (("quick", ["float8"], None), "^dtypes: unknown dtype 'float8'.*bf16"),
    (("quick", None, ["diagonal"]), "^layouts: unknown layout 'diagonal'"),
    (("quick", ["float64"], None), "^no case of suite 'quick'"),
])
def test_select_cases_errors_name_the_argument(args, message):
    """Library errors name the Python argument; only the command speaks of flags."""
    with pytest.raises(ArgumentValueError, match=message) as caught:
        bench.select_cases(*args)
    assert "--" not in str(caught.value)


def test_run_checks_name_the_argument():
    with pytest.raises(ArgumentValueError, match="^threads: expected an integer from 1 to"):
        bench.check_threads(0)
    with pytest.raises(ArgumentValueError, match="^repeat: expected at least 1, got 0"):
        bench.check_repeat(0)


def test_memory_probe_sees_a_temporary():
    if not measure.reset_peak_rss():
        pytest.skip("peak RSS cannot be reset on this platform (Linux /proc/self/clear_refs)")
    n = 64 << 20

    def with_temporary():
        tmp = np.ones(n, np.uint8)  # paged in: counts in the resident set
        return np.zeros(16, np.uint8) + tmp[:16]

    def without():
        return np.zeros(16, np.uint8)

    seen = bench.measure_extra_memory(with_temporary, 16)
    assert seen["rss_extra"] >= 0.9 * n
    assert seen["numpy_traced_peak"] >= n
    assert bench.measure_extra_memory(without, 16)["rss_extra"] < 8 << 20


@pytest.fixture
def tiny_suite(monkeypatch):
    monkeypatch.setitem(bench.SUITES, "quick", (lambda: list(TINY), 2, "tiny"))


def _run_cli(tmp_path, *extra):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["bench", "--suite", "quick", "--repeat", "2", "--threads", "2",
                   "--json", str(out_json), "--plot", str(out_png), *extra])
    assert rc == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def strict(constant):  # NaN / Infinity are not JSON
        raise AssertionError(f"{constant} in the JSON output")
    return json.loads(out_json.read_text(), parse_constant=strict)


def test_cli_runs_a_suite_and_writes_json_and_plot(tiny_suite, tmp_path, capsys):
    pytest.importorskip("torch")
    result = _run_cli(tmp_path, "--scaling", "--markdown", str(tmp_path / "bench.md"))
    out = capsys.readouterr().out
    assert "geometric mean" in out and "floor" in out
    md = (tmp_path / "bench.md").read_text().splitlines()
    table = [line for line in md if line.startswith("|")]
    assert len(table) == 2 + len(TINY) + 1  # header, rule, one row per case, geometric mean
    assert len({line.count("|") for line in table}) == 1
    assert "4x3x5x6" in table[2] and "geometric mean" in table[-1]

    # a saved run renders the same table again, without running anything
    again = tmp_path / "again.md"
    assert cli.main(["bench", "--load", str(tmp_path / "bench.json"),
                     "--markdown", str(again)]) == 0
    assert again.read_text() == (tmp_path / "bench.md").read_text()

    assert result["machine"]["threads"] == result["options"]["threads"] == 2
    for key in ("cpu_model", "cores", "date", "numpy", "numba", "torch", "bngrad"):
        assert result["machine"][key]
    assert len(result["cases"]) == len(TINY)
    for got, case in zip(result["cases"], TINY):
        assert (tuple(got["shape"]), got["dtype"], got["layout"]) == (
            case.shape, case.dtype, case.layout)
        for name in ("bngrad", "torch", "reference", "floor", "floor_in_place", "bngrad_out",
                     "bngrad@1"):
            t = got["timings"][name]
            assert len(t["samples_ms"]) >= 2 and t["q1_ms"] <= t["median_ms"] <= t["q3_ms"]
        bn, th, fl, bo, fi = (got["timings"][k]["median_ms"] for k in (
            "bngrad", "torch", "floor", "bngrad_out", "floor_in_place"))
        assert got["speedup_vs_torch"] == pytest.approx(th / bn)
        assert got["ratio_to_floor"] == pytest.approx(bn / fl)
        assert got["out_ratio_to_floor_in_place"] == pytest.approx(bo / fi)
        assert got["gbps"] == pytest.approx(3 * got["bytes_per_array"] / (bn * 1e-3) / 1e9)
        assert got["deterministic_across_threads"] is True
        assert 0 < got["cores_busy"] <= 2 * 1.1  # CPU time of at most 2 threads, clock slack
        assert got["max_rel_diff_vs_torch"] < 0.05  # same answer as PyTorch (guard, not a test)
        assert got["extra_memory"]["bngrad"]["numpy_traced_peak"] >= 0
    assert result["summary"]["geomean_speedup_vs_torch"] > 0


def test_cli_fused_op_times_the_pairs_against_torch_and_plain(tiny_suite, tmp_path, capsys):
    pytest.importorskip("torch")
    result = _run_cli(tmp_path, "--op", "fused", "--scaling", "--markdown",
                      str(tmp_path / "bench.md"))
    out = capsys.readouterr().out
    assert "--op fused" in out and "plain" in out and "kept MiB" in out
    assert [(tuple(c["shape"]), c["dtype"], c["layout"], c["op"]) for c in result["cases"]] == [
        (case.shape, case.dtype, case.layout, op) for case in TINY
        for op in ("relu", "add-relu")]
    for got in result["cases"]:
        bn, th, plain = (got["timings"][k]["median_ms"] for k in ("bngrad", "torch", "plain"))
        assert got["baseline"] == "plain" and "floor" not in got["timings"]
        assert got["speedup_vs_torch"] == pytest.approx(th / bn)
        assert got["ratio_to_floor"] == pytest.approx(bn / plain)
        assert got["gbps"] is None
        x = got["bytes_per_array"]
        n = int(np.prod(got["shape"]))
        assert got["kept_for_backward_bytes"] == {"bngrad": x + (n + 7) // 8, "torch": 2 * x}
        assert got["deterministic_across_threads"] is True
        assert got["max_rel_diff_vs_torch"] < 0.05  # same answer as PyTorch (guard, not a test)
    md = [line for line in (tmp_path / "bench.md").read_text().splitlines()
          if line.startswith("|")]
    assert len(md) == 2 + 2 * len(TINY) + 1 and "add-relu" in md[3]
    assert set(result["contenders"]) == {"bngrad", "torch", "reference", "plain"}


def test_select_cases_fused_op_doubles_each_case():
    fused = bench.select_cases("quick", op="fused")
    plain = bench.select_cases("quick")
    assert [(c.shape, c.dtype, c.layout) for c in fused[::2]] == [
        (c.shape, c.dtype, c.layout) for c in plain]
    assert [c.op for c in fused] == ["relu", "add-relu"] * len(plain)
    with pytest.raises(ArgumentValueError, match="^op: unknown operation 'relu'"):
        bench.select_cases("quick", op="relu")


def test_cli_without_torch_says_so(tiny_suite, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    result = _run_cli(tmp_path, "--no-memory")
    out = capsys.readouterr().out
    assert "PyTorch is not installed" in out
    assert result["machine"]["torch"] is None
    for got in result["cases"]:
        assert "torch" not in got["timings"]
        assert "PyTorch is not installed" in got["skipped"]["torch"]
        assert got["speedup_vs_torch"] is None and got["ratio_to_floor"] > 0


def test_cli_reference_cap_and_list(tiny_suite, tmp_path, capsys):
    result = _run_cli(tmp_path, "--reference-cap", "100", "--no-memory")
    for got in result["cases"]:
        assert ("reference" in got["timings"]) == (np.prod(got["shape"]) <= 100)
    assert cli.main(["bench", "--suite", "quick", "--list"]) == 0
    assert "4x3x5x6 bfloat16 NHWC" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--threads", "0"], "--threads: expected an integer from 1 to"),
    (["--repeat", "0"], "--repeat: expected at least 1, got 0"),
    (["--dtype", "int8"], "--dtype: unknown dtype 'int8'"),
    (["--layout", "nchw,diagonal"], "--layout: unknown layout 'diagonal'"),
    (["--reference-cap", "-1"], "--reference-cap: expected >= 0, got -1"),
    # output files are checked before the run, not after it (the figures were lost)
    (["--json", "/nonexistent-folder/run.json"], "--json: the folder '/nonexistent-folder'"),
    (["--markdown", "/"], "--markdown: expected a file to write, got the folder '/'"),
])
def test_cli_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    assert cli.main(["bench", "--suite", "quick", *argv]) == 2
    out = " ".join(capsys.readouterr().out.split())  # rich may wrap a long line
    assert f"bngrad bench: {message}" in out


def test_cli_startup_times_cold_and_warm_first_calls(tiny_suite, tmp_path, monkeypatch, capsys):
    """Fresh processes with a private kernel cache: the cold one compiles, the warm one loads."""
    monkeypatch.setitem(bench.SUITES, "quick", (lambda: TINY[:1], 1, "one case"))
    monkeypatch.setattr(machine, "STARTUP_CALLS", machine.STARTUP_CALLS[:1])
    result = _run_cli(tmp_path, "--startup", "--no-memory")
    assert "First call in a fresh process" in capsys.readouterr().out
    startup = result["startup"]
    first = startup["calls"][0]
    cold, warm = startup["cold"], startup["warm"]
    assert 0 < warm["first_call_s"][first] < cold["first_call_s"][first]
    assert 0 < warm["import_s"] and warm["process_s"] >= warm["import_s"]


@pytest.mark.parametrize("module, argv", [("rich", []), ("matplotlib", ["--plot", "x.png"])])
def test_cli_without_the_bench_extra_says_how_to_install_it(module, argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)
    assert cli.main(["bench", "--suite", "quick", *argv]) == 2
    assert "pip install '.[bench]'" in capsys.readouterr().err


def test_bare_bench_runs_the_quick_suite():
    args = cli.build_parser().parse_args(["bench"])
    assert args.suite == "quick"


def test_table_fits_a_narrow_terminal_and_names_the_largest_difference(tiny_suite, tmp_path):
    from rich.console import Console

    from bngrad import _cli_bench

    pytest.importorskip("torch")
    _run_cli(tmp_path, "--scaling")
    result = bench.SuiteResult.read_json(tmp_path / "bench.json")
    for width, dropped in ((200, ()), (110, ("NumPy ms",)), (60, ("NumPy ms", "GB/s"))):
        console = Console(width=width, record=True)
        console.print(_cli_bench._table(result, width))
        text = console.export_text()
        assert max(len(line) for line in text.splitlines()) <= width
        assert "bngrad" in text and "PyTorch" in text and "floor" in text
        for name in dropped:
            assert name not in text
    # without a width (a pipe, --markdown) every column stays
    console = Console(width=400, record=True)
    console.print(_cli_bench._table(result))
    assert "NumPy ms" in console.export_text()
    label = result.summary()["max_rel_diff_case"]
    assert label in {c.case.label for c in result.cases}
    assert any(label in note for note in _cli_bench._notes(result))


# --- torch.compile (--compile): optional, compiled once per case outside the timings ----------

COMPILE_CASES = TINY[:2]  # float32 NCHW, bfloat16 NHWC: each case costs seconds of compiling
# importing inductor warns from inside torch itself (its own use of torch.jit)
torch_internal_warning = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _strip_torch_compile(data: dict) -> dict:
    """``data`` (a --json run) as an older bngrad, without torch.compile, would have written it."""
    data = json.loads(json.dumps(data))
    del data["options"]["torch_compile"]
    data["contenders"].pop("torch_compile")
    for key in [k for k in data["summary"] if "torch_compile" in k]:
        del data["summary"][key]
    for case in data["cases"]:
        for key in ("speedup_vs_torch_compile", "max_rel_diff_vs_torch_compile"):
            del case[key]
        del case["timings"]["torch_compile"]
    return data


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory):
    """One --compile run on COMPILE_CASES, shared (compiling is slow): (JSON, folder,
    torch.compile's keyword arguments per call, graphs dynamo compiled during the run)."""
    torch = pytest.importorskip("torch")
    from torch._dynamo.utils import counters

    from bngrad._bench import contenders
    if contenders.find_cxx() is None:
        pytest.skip("no C++ compiler for inductor (torch._inductor.config.cpp.cxx)")
    tmp = tmp_path_factory.mktemp("compiled")
    calls, real = [], torch.compile

    def spy(fn, **kwargs):
        calls.append(kwargs)
        return real(fn, **kwargs)
    graphs = counters["stats"]["unique_graphs"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench.SUITES, "quick", (lambda: list(COMPILE_CASES), 2, "tiny"))
        mp.setattr(torch, "compile", spy)
        result = _run_cli(tmp, "--compile", "--markdown", str(tmp / "bench.md"))
    return result, tmp, calls, counters["stats"]["unique_graphs"] - graphs


@torch_internal_warning
def test_cli_compile_times_torch_compile_compiled_once_per_case(compiled_run):
    result, _, calls, graphs = compiled_run
    # inductor, static shapes, one graph per case: nothing recompiles inside the timed rounds
    assert calls == [{"backend": "inductor", "dynamic": False, "fullgraph": True}] * 2
    assert graphs == len(COMPILE_CASES)
    assert result["options"]["torch_compile"] is True
    assert "torch_compile" in result["contenders"]
    assert len(result["cases"]) == len(COMPILE_CASES)
    for got in result["cases"]:
        assert "torch_compile" not in got["skipped"]
        t = got["timings"]["torch_compile"]
        assert len(t["samples_ms"]) >= 2 and t["q1_ms"] <= t["median_ms"] <= t["q3_ms"]
        bn, tc = (got["timings"][k]["median_ms"] for k in ("bngrad", "torch_compile"))
        assert got["speedup_vs_torch_compile"] == pytest.approx(tc / bn)
        # compared like PyTorch's: the same grad_input (a guard, not a test of torch.compile)
        assert got["max_rel_diff_vs_torch_compile"] < 0.05
    summary = result["summary"]
    assert summary["geomean_speedup_vs_torch_compile"] == pytest.approx(
        bench.geomean(c["speedup_vs_torch_compile"] for c in result["cases"]))
    assert summary["min_speedup_vs_torch_compile_case"] in {
        bench.Case(tuple(c["shape"]), c["dtype"], c["layout"]).label for c in result["cases"]}


@torch_internal_warning
def test_cli_compile_markdown_has_the_column_and_ratio_and_old_json_loads(compiled_run,
                                                                          tmp_path):
    result, tmp, _, _ = compiled_run
    md = (tmp / "bench.md").read_text()
    table = [line.split("|")[1:-1] for line in md.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in table[0]]
    assert header.index("torch.compile ms") == header.index("PyTorch ms") + 1
    assert header.index("vs torch.compile") == header.index("vs PyTorch") + 1
    ratio = header.index("vs torch.compile")
    for row, got in zip(table[2:], result["cases"]):
        assert row[ratio].strip() == f"{got['speedup_vs_torch_compile']:.2f}x"
    assert table[-1][ratio].strip() == (
        f"{result['summary']['geomean_speedup_vs_torch_compile']:.2f}x")
    assert "--compile" in md and "Slowest vs torch.compile" in md
    assert "Largest |bngrad - torch.compile|" in md

    # a saved run renders the same again; a file from before --compile loads without it
    again = tmp_path / "again.md"
    assert cli.main(["bench", "--load", str(tmp / "bench.json"), "--markdown", str(again)]) == 0
    assert again.read_text() == md
    old = tmp_path / "old.json"
    old.write_text(json.dumps(_strip_torch_compile(result)))
    loaded = bench.SuiteResult.read_json(str(old))
    assert loaded.options.torch_compile is False
    assert all(c.speedup_vs_torch_compile is None for c in loaded.cases)
    assert cli.main(["bench", "--load", str(old), "--markdown", str(again)]) == 0
    assert "torch.compile" not in again.read_text() and "vs PyTorch" in again.read_text()


@torch_internal_warning
def test_cli_compile_without_a_cxx_compiler_says_why_and_runs_the_rest(tiny_suite, tmp_path,
                                                                     monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    from bngrad._bench import contenders

    monkeypatch.setitem(bench.SUITES, "quick", (lambda: TINY[:1], 2, "one case"))
    monkeypatch.setattr(contenders.shutil, "which", lambda name, *a, **k: None)
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a))
    assert contenders.find_cxx() is None
    result = _run_cli(tmp_path, "--compile", "--no-memory", "--markdown",
                      str(tmp_path / "bench.md"))
    out = " ".join(capsys.readouterr().out.split())  # rich may wrap a long line
    assert "torch.compile: torch.compile needs a C++ compiler" in out
    assert calls == []
    got = result["cases"][0]
    assert "C++ compiler" in got["skipped"]["torch_compile"]
    assert "torch_compile" not in got["timings"] and "torch" in got["timings"]
    assert got["speedup_vs_torch_compile"] is None and got["speedup_vs_torch"] > 0
    md = (tmp_path / "bench.md").read_text().splitlines()
    header = [cell.strip() for cell in md[2].split("|")[1:-1]]
    row = [cell.strip() for cell in md[4].split("|")[1:-1]]
    assert row[header.index("torch.compile ms")] == row[header.index("vs torch.compile")] == "-"


@torch_internal_warning
def test_compile_failure_becomes_unavailable_with_its_first_line(monkeypatch):
    torch = pytest.importorskip("torch")
    from bngrad._bench import contenders

    def failing(fn, **kwargs):
        def run(*args):
            raise RuntimeError("backend='inductor' raised:\nCompilerError: cc1plus died\n"
                               "  the long traceback")
        return run
    monkeypatch.setattr(contenders, "find_cxx", lambda: "g++")
    monkeypatch.setattr(torch, "compile", failing)
    opts = bench.Options(threads=1, torch_compile=True)
    for case in (TINY[0], bench.Case((2, 3, 4, 5), "float32", "contiguous", "add-relu")):
        factory = contenders.contenders(case.op, torch_compile=True)["torch_compile"][0]
        with pytest.raises(contenders.Unavailable) as caught:
            factory(bench.make_arrays(case), 1, opts)
        assert str(caught.value) == ("torch.compile failed: RuntimeError: backend='inductor' "
                                     "raised: CompilerError: cc1plus died")
    monkeypatch.setitem(sys.modules, "torch", None)  # no PyTorch: said, not raised
    with pytest.raises(contenders.Unavailable, match="PyTorch is not installed"):
        factory(bench.make_arrays(TINY[0]), 1, opts)


@torch_internal_warning
def test_cli_without_compile_flag_compiles_nothing(tiny_suite, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    from torch._dynamo.utils import counters

    monkeypatch.setitem(bench.SUITES, "quick", (lambda: TINY[:2], 2, "two cases"))
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(a))
    graphs = counters["stats"]["unique_graphs"]
    result = _run_cli(tmp_path, "--no-memory", "--markdown", str(tmp_path / "bench.md"))
    assert calls == [] and counters["stats"]["unique_graphs"] == graphs
    assert result["options"]["torch_compile"] is False
    assert "torch_compile" not in result["contenders"]
    for got in result["cases"]:
        assert "torch_compile" not in got["timings"] and "torch_compile" not in got["skipped"]
        assert got["speedup_vs_torch_compile"] is None and "torch" in got["timings"]
    assert "torch.compile" not in (tmp_path / "bench.md").read_text()


def _saved_run(tmp_path) -> dict:
    """A small run as --json writes it, built without timing anything."""
    timing = measure.Timing([1e-3, 2e-3, 3e-3], 4)
    case = results.CaseResult(TINY[0], {"bngrad": timing, "torch": timing, "floor": timing},
                            {"reference": "over the cap"}, {"bngrad": {"rss_extra": 1024}},
                            1e-7, True, 1.5, 2)
    startup = {"cold": {"import_s": 1.0, "first_call_s": {"a": 2.0}},
               "warm": {"import_s": 0.5, "first_call_s": {"a": 0.1}}, "calls": ["a"]}
    result = results.SuiteResult("quick", bench.Options(threads=2), machine.machine_info(2),
                               [case], startup)
    result.write_json(str(tmp_path / "run.json"))
    return json.loads((tmp_path / "run.json").read_text())


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("cases"), "saved run: missing 'cases'"),
    (lambda d: d.update(cases={}), "saved run: 'cases' must be a list, got {}"),
    (lambda d: d["cases"].append(3), "'cases'[1] must be an object, got 3"),
    (lambda d: d["options"].update(threads="2"), "'threads' must be an integer, got '2'"),
    (lambda d: d["options"].update(threads=0), "'threads' must be at least 1, got 0"),
    (lambda d: d["options"].update(scaling=1), "'scaling' must be true or false, got 1"),
    (lambda d: d["machine"].pop("cpu_model"), "'machine': missing 'cpu_model'"),
    (lambda d: d["machine"].update(cores=True), "'cores' must be an integer, got True"),
    (lambda d: d["cases"][0].update(dtype="float8"), "'dtype' must be one of"),
    (lambda d: d["cases"][0].update(layout=None), "'layout' must be a string, got None"),
    (lambda d: d["cases"][0].update(shape=[4]), "'shape' must be at least 2 positive sizes"),
    (lambda d: d["cases"][0].update(shape=[4, "3"]), "'shape'[1] must be an integer, got '3'"),
    (lambda d: d["cases"][0]["timings"]["torch"].update(samples_ms=[]),
     "timing 'torch': 'samples_ms' must be non-negative numbers"),
    (lambda d: d["cases"][0]["timings"]["torch"].update(samples_ms=["fast"]),
     "'samples_ms'[0] must be a number, got 'fast'"),
    (lambda d: d["cases"][0]["timings"]["bngrad"].pop("number"), "missing 'number'"),
    (lambda d: d["cases"][0]["skipped"].update(torch=0), "'torch' must be a string, got 0"),
    (lambda d: d["cases"][0]["extra_memory"]["bngrad"].update(rss_extra="1 MiB"),
     "'rss_extra' must be an integer or null"),
    (lambda d: d["cases"][0].update(max_rel_diff_vs_torch="small"),
     "'max_rel_diff_vs_torch' must be a number or null"),
    (lambda d: d["startup"].update(calls=[]), "startup: 'calls' is empty"),
    (lambda d: d["startup"]["warm"].update(first_call_s={}), "no time for the first call 'a'"),
    (lambda d: d["startup"]["cold"].pop("import_s"), "'cold': missing 'import_s'"),
    # JSON's integers have no bound, and Python's JSON reader takes NaN and Infinity
    (lambda d: d["cases"][0].update(max_rel_diff_vs_torch=10**400),
     "'max_rel_diff_vs_torch' must be a finite number, got a number of 401 digits"),
    (lambda d: d["cases"][0]["timings"]["bngrad"].update(samples_ms=[10**400]),
     "'samples_ms' must be a finite number"),
    (lambda d: d["cases"][0]["timings"]["bngrad"].update(samples_ms=[float("nan")]),
     "'samples_ms' must be a finite number, got nan"),
    (lambda d: d["cases"][0]["timings"]["torch"].update(samples_ms=[float("inf")]),
     "'samples_ms' must be a finite number, got inf"),
    (lambda d: d["cases"][0].update(shape=[10**200, 10**200]), "of at most 2**53 elements"),
])
def test_cli_load_of_an_edited_file_names_the_field(tmp_path, capsys, edit, message):
    """A hand-edited saved run is refused in one line naming the field (was: a traceback from
    deep inside the rendering)."""
    data = _saved_run(tmp_path)
    path = tmp_path / "run.json"
    assert cli.main(["bench", "--load", str(path)]) == 0  # the file as written renders
    capsys.readouterr()
    edit(data)
    path.write_text(json.dumps(data))
    assert cli.main(["bench", "--load", str(path)]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert f"bngrad bench: --load {path}: not a saved run: " in out
    assert message in out


@pytest.mark.parametrize("text", ["", "[1, 2]", "{\"suite\": 1", "null",
                                  "[" * 100000 + "]" * 100000])  # (RecursionError)
def test_cli_load_of_what_is_not_a_run_exits_2(tmp_path, capsys, text):
    (tmp_path / "x.json").write_text(text)
    assert cli.main(["bench", "--load", str(tmp_path / "x.json")]) == 2
    assert "not a saved run" in capsys.readouterr().out
    assert cli.main(["bench", "--load", str(tmp_path)]) == 2  # a folder
