"""``bngrad bench``: argument parsing, progress bar, results table and plot over bngrad._bench.

Glue only: what is measured and how lives in :mod:`bngrad._bench`, whose errors name Python
arguments; :func:`_in_flag_terms` says them in this command's flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

from .errors import ArgumentValueError

_MIB = 1 << 20

#: argument of bngrad._bench (the first word of its error messages) -> this command's flag
_FLAGS = {"suite": "--suite", "dtypes": "--dtype", "layouts": "--layout",
          "threads": "--threads", "repeat": "--repeat", "op": "--op"}


def _in_flag_terms(exc: ArgumentValueError) -> str:
    """The library's message, with the argument it names ("threads: ...") as its flag."""
    message = str(exc)
    argument, sep, rest = message.partition(": ")
    return f"{_FLAGS[argument]}: {rest}" if sep and argument in _FLAGS else message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ._bench import LAYOUTS, SUITES

    suites = "; ".join(f"{name}: {desc}" for name, (_, _, desc) in SUITES.items())
    parser.add_argument("--suite", default="quick", choices=list(SUITES),
                        help=f"which cases to run (default: quick; the default suite takes "
                             f"several minutes). {suites}")
    parser.add_argument("--dtype", action="append", metavar="NAMES",
                        help="only cases of these dtypes, comma-separated: float64, float32, "
                             "float16, bfloat16 (aliases fp32, bf16, ...)")
    parser.add_argument("--layout", action="append", metavar="NAMES",
                        help="only cases of these layouts, comma-separated: "
                             + ", ".join(LAYOUTS) + " (aliases nchw, nhwc, ...)")
    parser.add_argument("--op", default="backward", choices=["backward", "fused"],
                        help="what to time: batch norm's backward (default), or the fused "
                             "pairs BN -> ReLU and BN -> add -> ReLU, forward + backward, "
                             "against PyTorch's unfused sequence and bngrad's plain batch "
                             "norm forward + backward")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="threads for every contender (default: all cores)")
    parser.add_argument("--repeat", type=int, metavar="R",
                        help="timed rounds per case; medians are reported (default: per suite)")
    parser.add_argument("--json", metavar="FILE", help="write the raw figures as JSON")
    parser.add_argument("--plot", metavar="FILE.png",
                        help="write a PNG of speedup vs PyTorch and ratio to the floor")
    parser.add_argument("--markdown", metavar="FILE.md",
                        help="write the table and notes as Markdown (for a README)")
    parser.add_argument("--scaling", action="store_true",
                        help="also time bngrad and the floor on one thread (speedup, and "
                             "bitwise determinism across thread counts)")
    parser.add_argument("--compile", action="store_true",
                        help="also time torch.compile (inductor, default mode, dynamic=False) "
                             "of the PyTorch column's ops: column torch.compile ms and ratio "
                             "vs torch.compile. Compiled once per case before timing (seconds "
                             "per case); needs PyTorch and a C++ compiler (g++, or $CXX), "
                             "else the reason is shown and the rest still runs")
    parser.add_argument("--startup", action="store_true",
                        help="also time the first call in fresh processes, cold (compiling) "
                             "and with a warm kernel cache")
    parser.add_argument("--reference-cap", type=int, default=1 << 22, metavar="ELEMENTS",
                        help="time the NumPy reference only up to this many elements "
                             "(default: %(default)s; 0: never)")
    parser.add_argument("--no-memory", action="store_true",
                        help="skip measuring peak extra memory")
    parser.add_argument("--list", action="store_true", help="list the selected cases and exit")
    parser.add_argument("--load", metavar="FILE",
                        help="render a run saved with --json (table, --plot, --markdown) "
                             "instead of running")


def _missing_extra(module: str) -> Optional[str]:
    try:
        __import__(module)
    except ImportError:
        return (f"bngrad bench: {module} is not installed; install the benchmark extra with: "
                "pip install '.[bench]' (in bngrad's clone)")
    return None


def _check_writable(flag: str, path: Optional[str]) -> None:
    """ArgumentValueError where a file cannot be written at ``path`` (None: not asked for)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ArgumentValueError(f"{flag}: expected a file to write, got the folder {path!r}")
    if not os.path.isdir(folder):
        raise ArgumentValueError(f"{flag}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ArgumentValueError(f"{flag}: {path!r} cannot be written (permissions)")


def run(args: argparse.Namespace) -> int:
    for module in ["rich"] + (["matplotlib"] if args.plot else []):
        message = _missing_extra(module)
        if message:  # before running for minutes, not after
            print(message, file=sys.stderr)
            return 2
    from rich.console import Console

    from . import _bench as bench

    console = Console()
    if not console.is_terminal:  # a file or pipe: rich would wrap the table at 80 columns
        console = Console(width=160)
    try:
        cases = bench.select_cases(args.suite, args.dtype, args.layout, args.op)
        threads = bench.check_threads(args.threads if args.threads is not None
                                      else bench.default_threads())
        repeat = bench.check_repeat(args.repeat if args.repeat is not None
                                    else bench.SUITES[args.suite][1])
        if args.reference_cap < 0:
            raise ArgumentValueError(f"--reference-cap: expected >= 0, got {args.reference_cap}")
        for flag, path in (("--json", args.json), ("--plot", args.plot),
                           ("--markdown", args.markdown)):
            _check_writable(flag, path)  # before running for minutes, not after
    except ArgumentValueError as exc:
        console.print(f"[red]bngrad bench: {_in_flag_terms(exc)}[/red]")
        return 2
    if args.list:
        for case in cases:
            console.print(f"{case.label}  ({case.bytes_per_array / _MIB:.1f} MiB per array)")
        return 0

    if args.load:
        try:
            result = bench.SuiteResult.read_json(args.load)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            console.print(f"[red]bngrad bench: --load {args.load}: not a saved run: {exc}[/red]")
            return 2
    else:
        opts = bench.Options(threads=threads, repeat=repeat, reference_cap=args.reference_cap,
                             scaling=args.scaling, memory=not args.no_memory,
                             torch_compile=args.compile)
        result = _run_with_progress(console, bench, args.suite, cases, opts)
        if args.startup:
            with console.status("Timing the first call in fresh processes (cold, then warm)..."):
                result.startup = bench.measure_startup()

    console.print(_table(result, console.width if console.is_terminal else None))
    for line in _notes(result):
        console.print(line)
    if args.json:
        result.write_json(args.json)
        console.print(f"Raw figures written to {args.json}")
    if args.plot:
        write_plot(result, args.plot)
        console.print(f"Plot written to {args.plot}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(result))
        console.print(f"Markdown table written to {args.markdown}")
    return 0


def _run_with_progress(console, bench, suite, cases, opts):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    columns = (TextColumn("[bold]bench[/bold]"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(cases))

        def on_progress(done: float, text: str) -> None:
            progress.update(task, completed=done, description=text)
        return bench.run_suite(suite, cases, opts, on_progress)


# ---------------------------------------------------------------------------------------------
# rendering

def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt(value, pattern):
    return "-" if value is None else pattern.format(value)


def _x(value: Optional[float]) -> str:
    return _fmt(value, "{:.2f}x")


def _compiled(result) -> bool:
    """Whether ``result`` is a run with torch.compile (``--compile``; older files: no)."""
    return result.options.torch_compile


def _grid(result):
    """(title, column names, rows, geometric-mean row, row is slower than PyTorch, eager or
    compiled)."""
    from ._bench import geomean

    cases, s = result.cases, result.summary()
    m = result.machine
    scaling = any(c.scaling is not None for c in cases)
    memory = any("bngrad" in c.extra_memory for c in cases)
    fused, compiled = _fused(result), _compiled(result)
    title = (f"bngrad bench --suite {result.suite}{' --op fused' if fused else ''}"
             f"{' --compile' if compiled else ''}: "
             f"{m['cpu_model']}, {m['cores']} cores, {result.options.threads} threads"
             f"{_pool_words(m)}, {m['date']}")
    base = "plain" if fused else "floor"
    # torch.compile's columns sit beside PyTorch's (time, then ratio); only with --compile
    tc_ms, tc_x = (["torch.compile ms"], ["vs torch.compile"]) if compiled else ([], [])
    columns = ["shape", "dtype", "layout" + (", op" if fused else ""), "bngrad ms",
               "PyTorch ms", *tc_ms, "NumPy ms", f"{base} ms", "vs PyTorch", *tc_x,
               f"/ {base}"]
    columns += ["kept MiB (PyTorch)"] if fused else ["GB/s"]
    if scaling:
        columns += [f"1->{result.options.threads} thr", "cores busy"]
    if memory:
        columns.append("extra MiB")
    rows, slower = [], []
    for c in cases:
        speedup, vs_compiled = c.speedup_vs_torch, c.speedup_vs_torch_compile
        row = [c.case.shape_text, c.case.dtype,
               c.case.layout_name + (f" {c.case.op}" if fused else ""),
               _ms(c.median("bngrad")), _ms(c.median("torch")),
               *([_ms(c.median("torch_compile"))] if compiled else []),
               _ms(c.median("reference")), _ms(c.median(c.baseline)), _x(speedup),
               *([_x(vs_compiled)] if compiled else []), _x(c.ratio_to_floor)]
        row.append(_kept(c) if fused else _fmt(c.gbps(), "{:.1f}"))
        if scaling:
            row += [_x(c.scaling), _fmt(c.cores_busy, "{:.2f}")]
        if memory:
            extra = c.extra_memory.get("bngrad", {}).get("rss_extra")
            row.append("-" if extra is None else f"{extra / _MIB:.2f}")
        rows.append(row)
        slower.append(any(v is not None and v < 1 for v in (speedup, vs_compiled)))
    total = ["geometric mean", "", "", "", "", *([""] if compiled else []), "", "",
             _x(s["geomean_speedup_vs_torch"]),
             *([_x(s["geomean_speedup_vs_torch_compile"])] if compiled else []),
             _x(s["geomean_ratio_to_floor"]),
             "" if fused else _fmt(geomean(c.gbps() for c in cases), "{:.1f}")]
    if scaling:
        total += [_x(s["geomean_scaling_1_to_n"]), ""]
    if memory:
        total.append("")
    return title, columns, rows, total, slower


def _pool_words(machine: dict) -> str:
    """Which threads ran bngrad's kernels (absent from runs saved before it was recorded)."""
    words = {"torch": " (bngrad on PyTorch's team)", "numba": " (bngrad on Numba's pool)"}
    return words.get(str(machine.get("kernel_pool")), "")


def _fused(result) -> bool:
    """Whether ``result`` is a run of the fused ops (``--op fused``)."""
    return any(c.case.fused for c in result.cases)


def _kept(c) -> str:
    """Memory kept for the backward per pair, bngrad's and (PyTorch's), in MiB."""
    ours, theirs = c.kept_bytes("bngrad"), c.kept_bytes("torch")
    return f"{ours / _MIB:.1f} ({theirs / _MIB:.1f})"


# Columns a narrow terminal can do without (name prefixes), dropped in this order; the case,
# bngrad ms, the ratios (vs PyTorch, vs torch.compile, / floor) always stay. --json and
# --markdown keep every column.
_OPTIONAL_COLUMNS = ("NumPy ms", "cores busy", "GB/s", "extra MiB", "kept", "floor ms",
                     "plain ms", "1->", "torch.compile ms", "PyTorch ms")


def _fit(columns, rows, total, width: Optional[int]):
    """Drop optional columns until the table fits ``width`` terminal cells (None: keep all)."""
    def cells(keep):
        return sum(max(len(r[i]) for r in [columns, total] + rows) + 3 for i in keep) + 1

    keep = list(range(len(columns)))
    for prefix in _OPTIONAL_COLUMNS:
        if width is None or cells(keep) <= width:
            break
        keep = [i for i in keep if not columns[i].startswith(prefix)]
    pick = lambda row: [row[i] for i in keep]  # noqa: E731
    return pick(columns), [pick(r) for r in rows], pick(total)


def _table(result, width: Optional[int] = None):
    """The results as a rich Table, narrowed to ``width`` cells if given."""
    from rich.table import Table

    title, columns, rows, total, slower = _grid(result)
    columns, rows, total = _fit(columns, rows, total, width)
    table = Table(title=title, title_justify="left")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i < 3 else "right")
    for row, red in zip(rows, slower):
        table.add_row(*row, style="red" if red else None)
    table.add_section()
    table.add_row(*total, style="bold")
    return table


def markdown(result) -> str:
    """The results table and notes as Markdown (for a README)."""
    from rich.text import Text

    title, columns, rows, total, _ = _grid(result)
    lines = [f"**{title}**", "",
             "| " + " | ".join(columns) + " |",
             "| " + " | ".join("---" if i < 3 else "---:" for i in range(len(columns))) + " |"]
    for row in rows + [[f"**{total[0]}**"] + total[1:]]:
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += [Text.from_markup(note).plain for note in _notes(result)]
    return "\n".join(lines) + "\n"


_IN_WORDS = {"contiguous": "channels-first", "channels_last": "channels-last"}


def _notes(result) -> List[str]:
    cases, s = result.cases, result.summary()
    notes = []
    others = result.machine.get("other_processes_cores")
    if others is not None and others > 0.1:
        notes.append(f"[yellow]Other processes kept {others:.2f} of "
                     f"{result.machine['cores']} cores busy on average during the run: the "
                     "figures are noisy (PyTorch's OpenMP suffers most); rerun on an idle "
                     "machine to trust them.[/yellow]")
    skipped: dict[str, str] = {}
    for c in cases:
        for name, why in c.skipped.items():
            skipped.setdefault(name, why)
    if "torch" in skipped:
        notes.append(f"[yellow]PyTorch: {skipped['torch']}[/yellow]")
    if "torch_compile" in skipped and "torch" not in skipped:  # no PyTorch: said just above
        notes.append(f"[yellow]torch.compile: {skipped['torch_compile']}[/yellow]")
    if _compiled(result):
        notes.append("torch.compile: the PyTorch column's ops compiled by inductor (default "
                     "mode, dynamic=False, C++ kernels built for this thread count), compiled "
                     "once per case before timing; vs torch.compile = its time / bngrad time. "
                     "In half precision it keeps intermediates in float32 where eager PyTorch "
                     "rounds each op's output, so its ReLU decisions (--op fused) can differ "
                     "from the others'.")
    if "reference" in skipped:
        notes.append(f"NumPy: {skipped['reference']} (--reference-cap).")
    if _fused(result):
        notes.append("bngrad: the fused forward (side input for add-relu, 1-bit mask) + "
                     "backward (given the mask; grad_side_input for add-relu). PyTorch: the ops "
                     "autograd runs for BN -> (add ->) ReLU and back (native_batch_norm, add, "
                     "relu, threshold_backward, native_batch_norm_backward). plain: bngrad's "
                     "batch_norm_forward + batch_norm_backward on the same arrays (no add, no "
                     "ReLU); / plain = bngrad time / plain time. kept MiB: what a training "
                     "step keeps for the backward per pair, bngrad x + 1 bit per element "
                     "(PyTorch: x + y). Medians; spreads are in --json. The largest "
                     "difference to PyTorch below may be large without either being wrong: an "
                     "element whose ReLU input rounds to the other side of 0 in PyTorch's batch "
                     "norm moves a whole element's gradient (tests check bngrad against the "
                     "float64 reference).")
    else:
        notes.append("floor: one fused pass dx = a*dy + b*x over the same bytes and threads, "
                     "allocating its output as bngrad does; / floor = bngrad time / floor "
                     "time. GB/s: 3 arrays' traffic / bngrad time. Medians; spreads are in "
                     "--json.")
    fresh = result.median_fresh_memory_share()
    if fresh is not None:
        notes.append(f"Fresh output memory (page faults, zeroing) is a median "
                     f"{100 * fresh:.0f}% of the floor's time.")
    if s["min_speedup_vs_torch"] is not None:
        notes.append(f"Slowest vs PyTorch: {s['min_speedup_vs_torch']:.2f}x "
                     f"({s['min_speedup_case']}).")
    if s["min_speedup_vs_torch_compile"] is not None:
        notes.append(f"Slowest vs torch.compile: {s['min_speedup_vs_torch_compile']:.2f}x "
                     f"({s['min_speedup_vs_torch_compile_case']}).")
    if s["median_ratio_to_floor_fp32_ge_64mib"] is not None:
        notes.append(f"float32 NCHW/channels-last cases of >= 64 MiB per array: median "
                     f"{s['median_ratio_to_floor_fp32_ge_64mib']:.2f}x the floor "
                     f"({s['fp32_ge_64mib_cases']} cases).")
    into_out = s["median_out_ratio_to_floor_in_place_fp32_ge_64mib"]
    if into_out:
        notes.append("The same cases with out= (one reused grad_input), against the floor "
                     "into one reused output: median " + ", ".join(
                         f"{v:.2f}x ({_IN_WORDS[k]})" for k, v in into_out.items()) + ".")
    if s["geomean_gbps_by_dtype"]:
        notes.append("GB/s by dtype (geometric mean): " + ", ".join(
            f"{k} {v:.1f}" for k, v in s["geomean_gbps_by_dtype"].items()))
    if s["max_bngrad_extra_bytes"] is not None:
        notes.append(f"Peak extra memory of a bngrad call beyond grad_input: at most "
                     f"{s['max_bngrad_extra_bytes'] / _MIB:.2f} MiB.")
    if s["max_rel_diff_vs_torch"] is not None:
        notes.append(f"Largest |bngrad - PyTorch| / max|PyTorch| over grad_input: "
                     f"{s['max_rel_diff_vs_torch']:.1e} ({s['max_rel_diff_case']}).")
    if s["max_rel_diff_vs_torch_compile"] is not None:
        notes.append(f"Largest |bngrad - torch.compile| / max|torch.compile| over grad_input: "
                     f"{s['max_rel_diff_vs_torch_compile']:.1e} "
                     f"({s['max_rel_diff_vs_torch_compile_case']}).")
    if s["deterministic_across_threads"] is not None:
        differ = [c.case.label for c in cases if c.deterministic_across_threads is False]
        verdict = ("yes, every case" if not differ
                   else "[red]NO[/red] for " + "; ".join(differ))
        notes.append(f"Bitwise identical results on 1 and {result.options.threads} threads: "
                     f"{verdict}.")
    if result.startup:
        cold, warm = result.startup["cold"], result.startup["warm"]
        first = result.startup["calls"][0]
        notes.append(
            f"First call in a fresh process ({first}): warm cache: import "
            f"{warm['import_s']:.2f} s + call {warm['first_call_s'][first]:.2f} s; cold "
            f"(compiling): import {cold['import_s']:.2f} s + call "
            f"{cold['first_call_s'][first]:.2f} s. Other dtypes/layouts, cold: " + ", ".join(
                f"{k} {v:.1f} s" for k, v in cold["first_call_s"].items() if k != first))
    return notes


def write_plot(result, path: str) -> None:
    """Two panels per case: speedup vs PyTorch (higher is better), ratio to the floor (lower)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    cases = result.cases
    labels = [c.case.label for c in cases]
    y = list(range(len(cases)))[::-1]
    fig, (left, right) = plt.subplots(1, 2, sharey=True,
                                      figsize=(12, 1.2 + 0.32 * len(cases)))
    speedups = [c.speedup_vs_torch for c in cases]
    if any(v is not None for v in speedups):
        # log scale: 0.5x and 2x are equally far from parity
        known = [v for v in speedups if v is not None]
        left.barh(y, [float("nan") if v is None else v - 1.0 for v in speedups], left=1.0,
                  color=["tab:red" if v is not None and v < 1 else "tab:green"
                         for v in speedups])
        left.set_xscale("log")
        lo, hi = min(0.5, min(known) / 1.3), max(2.0, max(known) * 1.6)
        left.set_xlim(lo, hi)
        left.set_xticks([t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100) if lo <= t <= hi])
        left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        left.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        _annotate(left, y, speedups)
    else:
        left.text(0.5, 0.5, "PyTorch not installed", ha="center", va="center",
                  transform=left.transAxes)
    left.axvline(1.0, color="black", lw=1)
    left.set_xlabel("speedup vs PyTorch (log scale, higher is better)")
    ratios = [c.ratio_to_floor for c in cases]
    right.barh(y, [float("nan") if v is None else v for v in ratios], color="tab:blue")
    right.set_xlim(0, max([2.0] + [v * 1.15 for v in ratios if v is not None]))
    _annotate(right, y, ratios)
    right.axvline(1.0, color="black", lw=1)
    right.set_xlabel("bngrad fused time / bngrad plain batch norm's (lower is better)"
                     if _fused(result) else
                     "bngrad time / floor time (lower is better, 1 = memory floor)")
    left.set_ylim(-0.7, len(cases) - 0.3)
    left.set_yticks(y)
    left.set_yticklabels(labels, fontsize=8)
    m = result.machine
    fig.suptitle(f"bngrad bench --suite {result.suite}{' --op fused' if _fused(result) else ''}"
                 f": {m['cpu_model']}, "
                 f"{result.options.threads} threads, {m['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _annotate(axes, y, values) -> None:
    for yi, v in zip(y, values):
        if v is not None:
            axes.text(v, yi, f" {v:.2f}x", va="center", fontsize=7)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run it as: bngrad bench")
