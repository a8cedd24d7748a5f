"""The standard DSP vector suite: the cases that matter for a BatchNormGrad port, and checking
a device's outputs for all of them.

``bngrad vectors --suite dsp --out DIR`` (:func:`write_suite`) writes one subdirectory per case,
each a golden-vectors directory as ``bngrad vectors`` writes it plus ``case.txt``: the same facts
as ``key value`` lines that a C program reads without a JSON parser (which function, its
core_mask, sizes, dtypes). ``DIR/index.txt`` lists the case directories, one per line. The C
harness of ``bngrad dsp-kit`` runs each case and writes ``dx.out.bin``, ``dbias.out.bin`` and
``dscale.out.bin`` beside the vectors (and ``broke.txt`` where the function wrote past an output
or into an input); ``bngrad dsp-check DIR`` (:func:`check_suite`) judges them all, one line per
case.

The cases (:data:`CASES`, about 60, 3 MB, written in a few seconds) cover the two C examples
of the operator reference (fp32 and fp16, as written and with exact data), channel counts at
the edges of 16- and 32-lane vectors and of an 8-core split (1, 15, 16, 17, 31, 32, 33, 64,
1000), batches 1, 2, 3 and 4096, train and eval, float16 parameters and float32 ones for
float16 data, several core masks, and the value regimes that break naive kernels (see
:mod:`bngrad._dsp_regimes`) besides exact data. Every case's ``manifest.json`` records what it
exercises under ``"dsp_case"``.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import re
import secrets
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence, Union

from . import _dsp_regimes, vectors
from .errors import ArgumentValueError

__all__ = ["CASES", "KIT_FILES", "Case", "CaseResult", "check_case", "check_suite",
           "read_index", "write_kit", "write_suite"]

INDEX = "index.txt"
CASE_FILE = "case.txt"
CASE_FORMAT = "bngrad-dsp-case/1"
#: output -> the file the C harness writes it to, in the case directory
OUTPUT_FILES = {name: f"{name}.out.bin" for name in vectors.OUTPUTS}
#: what the harness writes in a case directory where the function wrote past an output or into
#: an input, one line per buffer: the only trace of it when the outputs come back from a board
BROKE_FILE = "broke.txt"
SUITES = ("dsp",)
#: the C kit `bngrad dsp-kit` writes (package data in bngrad/dsp_kit)
KIT_FILES = ("README.txt", "Makefile", "batchnormgrad.h", "bng_harness.c", "batchnormgrad_ref.c",
             "bng_half.h", "bng_half.c")

PathLike = Union[str, Path]

_BATCH = {1: "batch 1: one row, so every variance is 0 and train dx is exactly 0",
          2: "batch 2: the smallest even batch", 3: "batch 3: odd, rows split unevenly",
          4096: "batch 4096: long per-channel sums"}
_CHANNEL = {1: "one channel", 15: "channel 15: one short of a 16-lane vector",
            16: "channel 16: exactly one 16-lane vector",
            17: "channel 17: one past a 16-lane vector",
            31: "channel 31: one short of a 32-lane vector",
            32: "channel 32: exactly one 32-lane vector",
            33: "channel 33: one past a 32-lane vector",
            64: "channel 64: 8 per core on 8 cores",
            1000: "channel 1000: 125 per core on 8 cores, a multiple of no vector width"}
_DIST = {"normal": "normal data", "uniform": "uniform data",
         "exact": "exact data: every expected value exact, checked for exact equality",
         **{name: f"{name} regime: {text}" for name, text in _dsp_regimes.REGIMES.items()}}
_MASK = {0x01: "core_mask 0x01: core 0 alone", 0x03: "core_mask 0x03: 2 cores",
         0x07: "core_mask 0x07: 3 cores, which divide no channel count evenly",
         0x0F: "core_mask 0x0f: 4 cores", 0x80: "core_mask 0x80: core 7 alone",
         0xAA: "core_mask 0xaa: 4 cores, not adjacent", 0xFE: "core_mask 0xfe: 7 cores, not core 0",
         0xFF: "core_mask 0xff: all 8 cores"}


@dataclass(frozen=True)
class Case:
    """One case of the suite: a golden-vectors directory and the call that is to reproduce it.

    ``function`` is ``"s"`` (shared storage, called with ``core_mask``) or ``"p"`` (private
    storage); ``param_dtype`` None means the data dtype; ``note`` is said first in what the
    case exercises.
    """

    dtype: str
    function: str
    batch: int
    channel: int
    dist: str
    train: bool = True
    core_mask: int = 0xFF
    param_dtype: Optional[str] = None
    note: str = ""

    @property
    def function_name(self) -> str:
        return f"{'fp' if self.dtype == 'fp32' else 'hp'}_batch_norm_grad_{self.function}"

    @property
    def params(self) -> str:
        return self.param_dtype or self.dtype

    @property
    def name(self) -> str:
        name = (f"{self.dtype}_{self.function}_b{self.batch}_c{self.channel}_"
                f"{'train' if self.train else 'eval'}_{self.dist}")
        if self.params != self.dtype:
            name += f"_p{self.params}"
        if self.function == "s" and self.core_mask != 0xFF:
            name += f"_mask{self.core_mask:02x}"
        return name

    @property
    def seed(self) -> int:
        """Derived from the name, so that adding a case changes no other case's bytes."""
        return zlib.crc32(self.name.encode())

    def exercises(self) -> list[str]:
        """What the case is for, in a few phrases."""
        what = [self.note] if self.note else []
        what.append(f"{self.function_name} ({'shared' if self.function == 's' else 'private'}"
                    f" storage), {self.dtype} data, {self.params} parameters")
        if self.function == "s":
            what.append(_MASK.get(self.core_mask, f"core_mask 0x{self.core_mask:02x}"))
        what.append("train: batch statistics" if self.train else "eval: running statistics")
        what.append(_BATCH.get(self.batch, f"batch {self.batch}"))
        what.append(_CHANNEL.get(self.channel, f"channel {self.channel}"))
        what.append(_DIST[self.dist])
        return what


def _cases() -> tuple[Case, ...]:
    c = Case
    seed1 = "the reference's shared-storage example"
    seed2 = "the reference's private-storage example"
    cases = [
        # the operator reference's two C examples as written, on both processors, then exact
        c("fp32", "s", 4, 64, "normal", note=seed1 + " (FT78NE)"),
        c("fp32", "p", 4, 32, "normal", note=seed2 + " (FT78NE)"),
        c("fp16", "s", 4, 64, "normal", note=seed1 + " in fp16 (MT7004)"),
        c("fp16", "p", 4, 32, "normal", note=seed2 + " in fp16 (MT7004)"),
        c("fp32", "s", 4, 64, "exact", note=seed1 + ", exact data"),
        c("fp32", "p", 4, 32, "exact", note=seed2 + ", exact data"),
        c("fp16", "s", 4, 64, "exact", note=seed1 + " in fp16, exact data"),
        c("fp16", "p", 4, 32, "exact", note=seed2 + " in fp16, exact data"),
        # channels at vector and core-split edges, exact data
        *(c("fp32", "s", 4, ch, "exact") for ch in (1, 15, 16, 17, 31, 33, 1000)),
        c("fp16", "s", 2, 1, "exact"), c("fp16", "s", 2, 15, "exact"),
        c("fp16", "p", 2, 16, "exact"), c("fp16", "s", 2, 17, "exact"),
        c("fp16", "s", 6, 31, "exact"), c("fp16", "p", 6, 33, "exact"),
        c("fp16", "s", 2, 1000, "exact"),
        # batch edges
        c("fp32", "s", 1, 17, "normal"), c("fp16", "p", 1, 33, "normal"),
        c("fp32", "s", 1, 64, "normal", train=False),
        c("fp16", "s", 1, 1000, "uniform", train=False),
        c("fp32", "s", 3, 16, "normal"), c("fp16", "s", 3, 31, "uniform"),
        c("fp32", "p", 3, 1, "uniform", train=False),
        c("fp32", "s", 4096, 17, "exact"), c("fp16", "s", 4096, 33, "exact", param_dtype="fp32"),
        c("fp16", "s", 4096, 16, "normal", param_dtype="fp32"),
        c("fp32", "p", 4096, 1, "normal", train=False),
        # eval mode, exact data
        c("fp32", "s", 4, 33, "exact", train=False, core_mask=0x0F),
        c("fp16", "p", 8, 64, "exact", train=False),
        c("fp16", "s", 2, 17, "exact", train=False, param_dtype="fp32"),
        c("fp32", "p", 2, 1000, "exact", train=False),
        # value regimes that break naive kernels
        c("fp32", "s", 64, 17, "offset"), c("fp16", "s", 32, 33, "offset"),
        c("fp32", "p", 16, 16, "offset", train=False),
        c("fp16", "s", 256, 15, "offset", param_dtype="fp32"),
        c("fp16", "s", 4, 16, "huge"), c("fp16", "s", 2, 31, "huge", train=False),
        c("fp16", "p", 64, 17, "huge", param_dtype="fp32"), c("fp32", "s", 8, 33, "huge"),
        c("fp32", "p", 3, 64, "huge", train=False),
        c("fp32", "s", 4, 31, "subnormal"), c("fp16", "s", 16, 32, "subnormal"),
        c("fp16", "p", 4, 17, "subnormal", train=False),
        c("fp32", "s", 3, 64, "subnormal", train=False),
        c("fp16", "s", 8, 33, "subnormal", param_dtype="fp32"),
        c("fp32", "s", 8, 17, "zerovar"), c("fp16", "s", 4, 64, "zerovar"),
        c("fp32", "p", 16, 33, "zerovar", train=False), c("fp16", "s", 2, 1, "zerovar"),
        c("fp16", "s", 5, 32, "zerovar", train=False),
        # core masks, exact data
        c("fp32", "s", 4, 64, "exact", core_mask=0x01),
        c("fp32", "s", 4, 64, "exact", core_mask=0x07),
        c("fp32", "s", 4, 17, "exact", core_mask=0x80),
        c("fp16", "s", 4, 33, "exact", core_mask=0xAA),
        c("fp16", "s", 2, 31, "exact", core_mask=0x03),
        c("fp16", "s", 2, 1000, "exact", core_mask=0xFE),
    ]
    names = [case.name for case in cases]
    assert len(set(names)) == len(names), "suite case names must be unique"
    return tuple(cases)


#: The standard suite, in the order ``index.txt`` lists it.
CASES: tuple[Case, ...] = _cases()


# --------------------------------------------------------------------------- writing

def case_text(case: Case) -> str:
    """``case.txt``: ``key value`` lines for the C harness, ``#`` comments saying why."""
    lines = [f"# bngrad DSP suite case {case.name}: `key value` lines, # comments"]
    lines += [f"#   {what}" for what in case.exercises()]
    lines += [f"format {CASE_FORMAT}", f"name {case.name}", f"function {case.function_name}",
              f"dtype {case.dtype}", f"param_dtype {case.params}", f"batch {case.batch}",
              f"channel {case.channel}", f"is_train {int(case.train)}"]
    if case.function == "s":
        lines.append(f"core_mask 0x{case.core_mask:02x}")
    return "\n".join(lines) + "\n"


def _write_text(path: Path, text: Union[str, bytes]) -> None:
    """Write under a temporary name and rename into place (a symlink there is replaced)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_suite(out_dir: PathLike, suite: str = "dsp", *, overwrite: bool = False,
                cases: Optional[Sequence[Case]] = None) -> list[Case]:
    """Write the standard suite under ``out_dir`` (created if needed); returns its cases.

    Parameters
    ----------
    out_dir : str or Path
    suite : "dsp"
    cases : sequence of Case, optional
        Only these (e.g. a few of :data:`CASES` for a small board); default all of the suite.
    overwrite : bool
        Replace a suite already there (``index.txt``, and per case the files
        ``bngrad vectors`` writes, ``case.txt`` and the harness's ``*.out.bin`` and
        ``broke.txt``, which would otherwise be stale); no other file is touched. Without it,
        a directory that holds ``index.txt`` or any case's vectors is refused before anything
        is written.

    Raises
    ------
    vectors.ExistingVectorsError
        Something is already there and ``overwrite`` is False.
    ArgumentValueError
        An unknown suite, or ``out_dir`` is not a directory.
    OSError
        The file system refused.
    """
    if suite not in SUITES:
        raise ArgumentValueError(f"suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    cases = CASES if cases is None else tuple(cases)
    if not cases or not all(isinstance(case, Case) for case in cases):
        raise ArgumentValueError(f"cases: expected a non-empty sequence of Case, got {cases!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ArgumentValueError(f"out_dir: {out} exists and is not a directory")
    present = [INDEX] if os.path.lexists(out / INDEX) else []
    present += [case.name for case in cases if os.path.lexists(out / case.name / vectors.MANIFEST)]
    if present and not overwrite:
        shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3
                                           else "")
        raise vectors.ExistingVectorsError(
            f"out_dir: {out} already holds a vector suite ({shown}); pass overwrite=True to "
            "replace it", out, present)
    out.mkdir(parents=True, exist_ok=True)
    index = [f"# bngrad DSP vector suite {suite}: one case directory per line, "
             "# what it exercises"]
    for case in cases:
        case_dir = out / case.name
        golden = vectors.generate(case.batch, case.channel, case.dtype, train=case.train,
                                  seed=case.seed, dist=case.dist, param_dtype=case.param_dtype)
        manifest = vectors.save_vectors(golden, case_dir, "bin", overwrite=overwrite)
        manifest["dsp_case"] = {"name": case.name, "function": case.function_name,
                                "core_mask": case.core_mask if case.function == "s" else None,
                                "exercises": case.exercises()}
        _write_text(case_dir / vectors.MANIFEST, json.dumps(manifest, indent=2) + "\n")
        _write_text(case_dir / CASE_FILE, case_text(case))
        for name in (*OUTPUT_FILES.values(), BROKE_FILE):   # an earlier run's are stale now
            stale = case_dir / name
            if stale.is_symlink() or stale.is_file():
                stale.unlink()
        index.append(f"{case.name}  # {'; '.join(case.exercises()[:1] + case.exercises()[2:])}")
    _write_text(out / INDEX, "\n".join(index) + "\n")
    return list(cases)


def write_kit(out_dir: PathLike, *, overwrite: bool = False) -> list[str]:
    """Write the portable C99 kit (:data:`KIT_FILES`) into ``out_dir``; returns the file names.

    Raises
    ------
    vectors.ExistingVectorsError
        ``out_dir`` holds a file of the kit and ``overwrite`` is False (nothing is written).
    ArgumentValueError
        ``out_dir`` is not a directory, or holds a folder where the kit writes a file.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ArgumentValueError(f"out_dir: {out} exists and is not a directory")
    present = [name for name in KIT_FILES if os.path.lexists(out / name)]
    folders = [name for name in present if (out / name).is_dir() and not (out / name).is_symlink()]
    if folders:  # checked before writing anything: a kit half replaced is worse than none
        raise ArgumentValueError(f"out_dir: {out} holds a folder named {', '.join(folders)} "
                                 "where the kit writes a file; move it away or choose another "
                                 "out_dir")
    if present and not overwrite:
        raise vectors.ExistingVectorsError(
            f"out_dir: {out} already holds {', '.join(present)}; pass overwrite=True to replace "
            "them", out, present)
    kit = importlib.resources.files("bngrad").joinpath("dsp_kit")
    contents = {name: kit.joinpath(name).read_bytes() for name in KIT_FILES}
    out.mkdir(parents=True, exist_ok=True)
    for name, data in contents.items():
        _write_text(out / name, data)
    return list(KIT_FILES)


# --------------------------------------------------------------------------- checking

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def read_index(suite_dir: PathLike) -> list[str]:
    """The case directory names ``index.txt`` lists (plain names only).

    Raises
    ------
    vectors.UnusableInputError
        No index, an unreadable one, a line that is not a plain directory name, or no cases.
    """
    root = Path(suite_dir)
    path = root / INDEX
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise vectors.UnusableInputError(
            f"suite: cannot read {path} ({e.__class__.__name__}: {e}); write a suite with "
            "`bngrad vectors --suite dsp --out DIR`") from None
    names = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise vectors.UnusableInputError(
                f"suite: {path} line {number}: expected a case directory name, got {name!r}")
        names.append(name)
    if not names:
        raise vectors.UnusableInputError(f"suite: {path} lists no cases")
    return names


@dataclass
class CaseResult:
    """One case's verdict: ``status`` PASS, FAIL (outputs beyond tolerance), BROKE (the
    harness's ``broke.txt``: the function wrote past an output or into an input), MISSING (no
    outputs from the harness: it skipped the case or stopped before it) or ERROR (unusable: a
    wrong-size output, corrupt vectors)."""

    name: str
    status: str
    summary: str
    report: Optional[vectors.ComparisonReport] = field(default=None, repr=False)

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def line(self) -> str:
        return f"{self.status:7s} {self.name}  {self.summary}"


def _summary(report: vectors.ComparisonReport) -> str:
    """The first failing output's count and first failing element, or the largest errors."""
    for o in report.outputs:
        if not o.passed:
            e = o.failures[0] if o.failures else o.worst
            assert e is not None
            exp, got = e.cells()[1:3]
            return (f"{o.name}: {o.over} of {o.count} over tolerance ({o.criterion}); first at "
                    f"{e.where()}: expected {exp}, got {got}, {e.ulp:.4g} ULP")
    return ", ".join(f"{o.name} max {o.max_ulp_err:.4g} ULP" for o in report.outputs)


def _broke(root: Path) -> Optional[str]:
    """What ``broke.txt`` in the case says the function broke (one line), None without one.

    Raises ``vectors.UnusableInputError`` or ``OSError`` where it cannot be read."""
    if not os.path.lexists(root / BROKE_FILE):
        return None
    with open(vectors._inside(root, BROKE_FILE, BROKE_FILE), "rb") as f:
        text = f.read(2000).decode("utf-8", "replace")     # the harness writes a few lines
    lines = ["".join(c if c.isprintable() else "?" for c in line.strip())
             for line in text.splitlines()]
    return "; ".join(line for line in lines if line) or f"{BROKE_FILE} is empty"


# The keys the C harness takes in a case.txt (bng_harness.c, read_case); it refuses any other,
# and lines longer than its buffer (LINE_MAX_LEN 512, with the newline and the final NUL).
_HARNESS_KEYS = ("format", "name", "function", "dtype", "param_dtype", "batch", "channel",
                 "is_train", "core_mask")
_HARNESS_LINE_MAX = 510


def _facts(text: str) -> dict[str, str]:
    """The ``key value`` lines of a ``case.txt`` (comments and blank lines left out), read as
    the C harness reads them (lines end at a newline, a carriage return before it dropped;
    words part at spaces and tabs).

    Raises ``ValueError`` saying which line the harness would refuse: too long, not one key
    and one value, an unknown key, a repeated one."""
    facts: dict[str, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        if len(line) > _HARNESS_LINE_MAX:
            raise ValueError(f"line {number}: longer than {_HARNESS_LINE_MAX} characters")
        words = [w for w in line.removesuffix("\r").replace("\t", " ").split(" ") if w]
        if not words or words[0].startswith("#"):
            continue
        if len(words) != 2:
            raise ValueError(f"line {number}: expected `key value`, got {line.strip()[:60]!r}")
        key, value = words
        if key not in _HARNESS_KEYS or key in facts:
            raise ValueError(f"line {number}: {'repeated' if key in facts else 'unknown'} key "
                             f"{key[:60]!r}")
        facts[key] = value
    return facts


def _case_mismatch(root: Path) -> Optional[str]:
    """Where ``case.txt``, which the harness runs, disagrees with the case the manifest
    describes (its ``case_text``), in a sentence; None where they agree.

    Raises ``vectors.UnusableInputError`` or ``OSError`` where either cannot be read."""
    with open(vectors._inside(root, vectors.MANIFEST, "manifest"), "rb") as f:
        try:
            m = json.loads(f.read(1 << 20))
            c = m["dsp_case"]
            function = str(c["function"])
            case = Case(m["dtype"], function[-1], m["batch"], m["channel"], m["distribution"],
                        bool(m["is_train"]), 0xFF if c["core_mask"] is None else c["core_mask"],
                        m["param_dtype"])
            expected = _facts(case_text(case))
        except (ValueError, TypeError, KeyError, IndexError) as e:
            raise vectors.UnusableInputError(f"{root / vectors.MANIFEST}: not a DSP suite case's "
                                             f"manifest ({type(e).__name__}: {e})") from None
    if not os.path.lexists(root / CASE_FILE):
        return f"no {CASE_FILE}: the harness reads the case from it"
    with open(vectors._inside(root, CASE_FILE, CASE_FILE), "rb") as f:
        text = f.read(1 << 16).decode("utf-8", "replace")
    try:
        got = _facts(text)
    except ValueError as e:
        return (f"{CASE_FILE}: {e}, which the harness refuses: the outputs are not of this "
                "case.txt (write the suite again)")
    for key in got.keys() - expected.keys():  # (core_mask in a _p case: the harness refuses it)
        return (f"{CASE_FILE} has a {key} line, which the manifest's case has not: the outputs "
                "are not of the case the vectors describe (write the suite again)")
    for key, value in expected.items():
        if got.get(key) != value:
            said = "no such line" if key not in got else repr(got[key])[:60]
            return (f"{CASE_FILE} says {key}: {said}, the manifest's case {key} {value!r}: the "
                    "outputs are not of the case the vectors describe (write the suite again)")
    return None


def check_case(case_dir: PathLike, show: int = vectors.SHOW) -> CaseResult:
    """Compare the harness's outputs in ``case_dir`` with its golden vectors (an ERROR where
    ``case.txt``, which the harness ran, is not the case the manifest describes)."""
    root = Path(case_dir)
    try:
        broke = _broke(root)
    except vectors.UnusableInputError as e:     # a link out of the case
        return CaseResult(root.name, "ERROR", str(e))
    except OSError as e:
        return CaseResult(root.name, "ERROR", f"{BROKE_FILE}: cannot read {root / BROKE_FILE}: "
                                              f"{e.strerror or e}")
    if broke is not None:   # whatever the outputs hold, the function wrote where it must not
        return CaseResult(root.name, "BROKE", f"{broke} (the harness's {BROKE_FILE})")
    files = {name: root / file for name, file in OUTPUT_FILES.items()}
    missing = [f.name for f in files.values() if not f.exists()]
    if missing:
        return CaseResult(root.name, "MISSING", f"no {', '.join(missing)}: not run (the harness "
                                                "skipped this case, saying why, or stopped "
                                                "before it, or was not run on it)")
    try:
        for name, file in OUTPUT_FILES.items():  # read inside the case, as its vectors are
            vectors._inside(root, file, name)
        report = vectors.compare(root, files, show=show)
        mismatch = _case_mismatch(root)
    except (vectors.UnusableInputError, ArgumentValueError, OSError) as e:
        return CaseResult(root.name, "ERROR", str(e))
    if mismatch is not None:
        return CaseResult(root.name, "ERROR", mismatch)
    return CaseResult(root.name, "PASS" if report.passed else "FAIL", _summary(report), report)


def check_suite(suite_dir: PathLike, show: int = vectors.SHOW) -> list[CaseResult]:
    """:func:`check_case` for every case ``index.txt`` lists, in its order.

    Raises
    ------
    vectors.UnusableInputError
        The index is missing or unusable (a single case's problem is its ERROR result, a case
        folder that is a symbolic link out of the suite among them).
    """
    root = Path(suite_dir)
    names = read_index(root)
    try:
        inside = root.resolve()
    except RuntimeError as e:  # a symbolic link loop (Python 3.11's resolve)
        raise vectors.UnusableInputError(f"suite: {root}: {e}") from None
    results = []
    for name in names:
        case = root / name
        try:
            target = case.resolve()
        except RuntimeError:
            results.append(CaseResult(name, "ERROR", f"{case} is a symbolic link loop"))
            continue
        if inside not in target.parents:  # a symbolic link out of the suite, or to it
            where = "to the suite itself" if target == inside else f"out of the suite, to {target}"
            results.append(CaseResult(name, "ERROR", f"{case} leads {where}; a case is a "
                                                     "folder inside the suite"))
        else:
            results.append(check_case(case, show))
    return results
