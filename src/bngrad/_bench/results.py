"""What a run measured: per-case and per-suite results, their summary, and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import numpy as np

from .. import _dtypes
from .. import fused
from .cases import CF_CL, LAYOUTS, OPS, Case
from .contenders import TORCH_COMPILE, contenders
from .measure import Timing


@dataclass
class Options:
    """How to run: thread count, repeats, caps. Defaults suit an interactive run."""

    threads: int
    repeat: int = 7
    reference_cap: int = 1 << 22
    reference_repeat: int = 3
    scaling: bool = False
    memory: bool = True
    min_sample_s: float = 0.01
    gap_s: float = 0.002
    seed: int = 0
    #: also time torch.compile of PyTorch's ops (contenders.TORCH_COMPILE); compiles per case
    torch_compile: bool = False


@dataclass
class CaseResult:
    """Everything measured for one case; ratios are derived from the medians."""

    case: Case
    timings: Dict[str, Timing] = field(default_factory=dict)
    skipped: Dict[str, str] = field(default_factory=dict)
    extra_memory: Dict[str, Dict[str, Optional[int]]] = field(default_factory=dict)
    max_rel_diff_vs_torch: Optional[float] = None
    deterministic_across_threads: Optional[bool] = None
    cores_busy: Optional[float] = None
    threads: int = 1
    max_rel_diff_vs_torch_compile: Optional[float] = None

    def median(self, name: str) -> Optional[float]:
        t = self.timings.get(name)
        return None if t is None else t.median

    def _ratio(self, num: str, den: str) -> Optional[float]:
        a, b = self.median(num), self.median(den)
        return None if a is None or b is None or b == 0 else a / b

    @property
    def speedup_vs_torch(self) -> Optional[float]:
        return self._ratio("torch", "bngrad")

    @property
    def speedup_vs_torch_compile(self) -> Optional[float]:
        """torch.compile's time / bngrad's (None without Options.torch_compile)."""
        return self._ratio(TORCH_COMPILE, "bngrad")

    @property
    def baseline(self) -> str:
        """What bngrad's time is divided by: the floor (backward), or bngrad's plain batch norm
        forward + backward (the fused ops)."""
        return "plain" if self.case.fused else "floor"

    @property
    def ratio_to_floor(self) -> Optional[float]:
        """bngrad's time / the :attr:`baseline`'s."""
        return self._ratio("bngrad", self.baseline)

    def kept_bytes(self, name: str) -> Optional[int]:
        """Fused ops: bytes a training step keeps for the backward per pair: bngrad x + the
        1-bit mask, PyTorch's sequence x + y (the ReLU's output). None for the backward."""
        if not self.case.fused or name not in ("bngrad", "torch"):
            return None
        x = self.case.bytes_per_array
        return x + (fused.mask_bytes(self.case.numel, "bits") if name == "bngrad" else x)

    @property
    def out_ratio_to_floor_in_place(self) -> Optional[float]:
        """bngrad's time into ``out=`` / the in-place floor's (the backward only)."""
        return self._ratio("bngrad_out", "floor_in_place")

    @property
    def scaling(self) -> Optional[float]:
        """bngrad's speedup on ``threads`` threads over one thread."""
        return self._ratio("bngrad@1", "bngrad")

    @property
    def floor_scaling(self) -> Optional[float]:
        return self._ratio("floor@1", "floor")

    @property
    def fresh_memory_share(self) -> Optional[float]:
        """Share of the floor's time that fresh output memory costs: 1 - in-place / fresh."""
        ratio = self._ratio("floor_in_place", "floor")
        return None if not ratio else 1 - ratio

    def gbps(self, name: str = "bngrad") -> Optional[float]:
        """Traffic of three arrays (read x, dy; write dx) per second, in GB/s (the backward
        only; None for the fused ops)."""
        t = self.median(name)
        return None if not t or self.case.fused else 3 * self.case.bytes_per_array / t / 1e9

    def to_json(self) -> dict:
        c = self.case
        return {
            "shape": list(c.shape), "dtype": c.dtype, "layout": c.layout, "op": c.op,
            "layout_name": c.layout_name, "bytes_per_array": c.bytes_per_array,
            "baseline": self.baseline,
            "kept_for_backward_bytes": {n: self.kept_bytes(n) for n in ("bngrad", "torch")
                                        if self.kept_bytes(n) is not None},
            "threads": self.threads,
            "timings": {k: v.to_json() for k, v in self.timings.items()},
            "skipped": self.skipped,
            "speedup_vs_torch": self.speedup_vs_torch,
            "speedup_vs_torch_compile": self.speedup_vs_torch_compile,
            "ratio_to_floor": self.ratio_to_floor,
            "out_ratio_to_floor_in_place": self.out_ratio_to_floor_in_place,
            "gbps": self.gbps(), "floor_gbps": self.gbps("floor"),
            "scaling_1_to_n": self.scaling, "floor_scaling_1_to_n": self.floor_scaling,
            "cores_busy": self.cores_busy,
            "extra_memory": self.extra_memory,
            "max_rel_diff_vs_torch": self.max_rel_diff_vs_torch,
            "max_rel_diff_vs_torch_compile": self.max_rel_diff_vs_torch_compile,
            "deterministic_across_threads": self.deterministic_across_threads,
        }


def geomean(values: Iterable[Optional[float]]) -> Optional[float]:
    """Geometric mean of the positive values (None and zeros left out); None when there are none."""
    positive = [v for v in values if v is not None and v > 0]
    return float(np.exp(np.mean(np.log(positive)))) if positive else None


@dataclass
class SuiteResult:
    """A whole run: per-case results, the machine, the options, optional start-up figures."""

    suite: str
    options: Options
    machine: dict
    cases: List[CaseResult]
    startup: Optional[dict] = None

    def summary(self) -> dict:
        """Geometric means and the aggregates the performance targets are stated in."""
        cs = self.cases
        speedups = [(c.speedup_vs_torch, c) for c in cs if c.speedup_vs_torch is not None]
        slowest = min(speedups, key=lambda p: p[0]) if speedups else None
        vs_compiled = [(c.speedup_vs_torch_compile, c) for c in cs
                       if c.speedup_vs_torch_compile is not None]
        slowest_compiled = min(vs_compiled, key=lambda p: p[0]) if vs_compiled else None
        large = [c for c in cs if c.case.dtype == "float32" and c.case.layout in CF_CL
                 and not c.case.fused and c.case.bytes_per_array >= 64 << 20]
        big = [c.ratio_to_floor for c in large if c.ratio_to_floor is not None]
        # the same cases into out=, against the in-place floor, per layout
        into_out = {layout: [c.out_ratio_to_floor_in_place for c in large
                             if c.case.layout == layout
                             and c.out_ratio_to_floor_in_place is not None]
                    for layout in CF_CL}
        per_byte = {}
        for dtype in _dtypes.NAMES:
            rates = [c.gbps() for c in cs if c.case.dtype == dtype and c.gbps()]
            if rates:
                per_byte[dtype] = geomean(rates)
        rss_extras = [c.extra_memory.get("bngrad", {}).get("rss_extra") for c in cs]
        extras = [e for e in rss_extras if e is not None]
        diffs = [(c.max_rel_diff_vs_torch, c) for c in cs if c.max_rel_diff_vs_torch is not None]
        largest_diff = max(diffs, key=lambda p: p[0]) if diffs else None
        compiled_diffs = [(c.max_rel_diff_vs_torch_compile, c) for c in cs
                          if c.max_rel_diff_vs_torch_compile is not None]
        largest_compiled = max(compiled_diffs, key=lambda p: p[0]) if compiled_diffs else None
        det = [c.deterministic_across_threads for c in cs
               if c.deterministic_across_threads is not None]
        return {
            "geomean_speedup_vs_torch": geomean(s for s, _ in speedups),
            "min_speedup_vs_torch": slowest[0] if slowest else None,
            "min_speedup_case": slowest[1].case.label if slowest else None,
            "geomean_speedup_vs_torch_compile": geomean(s for s, _ in vs_compiled),
            "min_speedup_vs_torch_compile": slowest_compiled[0] if slowest_compiled else None,
            "min_speedup_vs_torch_compile_case": (slowest_compiled[1].case.label
                                                  if slowest_compiled else None),
            "geomean_ratio_to_floor": geomean(c.ratio_to_floor for c in cs),
            "median_ratio_to_floor_fp32_ge_64mib": float(np.median(big)) if big else None,
            "fp32_ge_64mib_cases": len(big),
            "median_out_ratio_to_floor_in_place_fp32_ge_64mib": {
                layout: float(np.median(r)) for layout, r in into_out.items() if r},
            "geomean_gbps_by_dtype": per_byte,
            "geomean_scaling_1_to_n": geomean(c.scaling for c in cs),
            "max_bngrad_extra_bytes": max(extras) if extras else None,
            "max_rel_diff_vs_torch": largest_diff[0] if largest_diff else None,
            "max_rel_diff_case": largest_diff[1].case.label if largest_diff else None,
            "max_rel_diff_vs_torch_compile": largest_compiled[0] if largest_compiled else None,
            "max_rel_diff_vs_torch_compile_case": (largest_compiled[1].case.label
                                                   if largest_compiled else None),
            "deterministic_across_threads": all(det) if det else None,
        }

    def median_fresh_memory_share(self) -> Optional[float]:
        """Median of the cases' :attr:`CaseResult.fresh_memory_share` (the upper middle one of
        an even count); None when no case has both floors."""
        shares = sorted(c.fresh_memory_share for c in self.cases
                        if c.fresh_memory_share is not None)
        return shares[len(shares) // 2] if shares else None

    def to_json(self) -> dict:
        opts = self.options
        return {
            "suite": self.suite, "machine": self.machine,
            "options": {"threads": opts.threads, "repeat": opts.repeat,
                        "reference_cap": opts.reference_cap, "scaling": opts.scaling,
                        "memory": opts.memory, "min_sample_s": opts.min_sample_s,
                        "gap_s": opts.gap_s,
                        "seed": opts.seed, "torch_compile": opts.torch_compile},
            "contenders": {k: v[1] for op in dict.fromkeys(c.case.op for c in self.cases)
                           for k, v in contenders(op, opts.torch_compile).items()},
            "summary": self.summary(),
            "cases": [c.to_json() for c in self.cases],
            "startup": self.startup,
        }

    @classmethod
    def from_json(cls, data: Any) -> SuiteResult:
        """Rebuild a result from :meth:`to_json`'s output (to re-render a saved run).

        Every field the rendering uses is checked: a missing one, or one of the wrong type or
        value (a hand-edited file), raises ValueError naming it."""
        run = _Fields(data, "saved run")
        o = run.fields("options")
        opts = Options(threads=o.integer("threads"), repeat=o.integer("repeat"),
                       reference_cap=o.integer("reference_cap", low=0), scaling=o.flag("scaling"),
                       memory=o.flag("memory"), min_sample_s=o.number("min_sample_s"),
                       gap_s=o.number("gap_s", default=0.0), seed=o.integer("seed", low=None),
                       torch_compile=o.flag("torch_compile", default=False))  # older: no key
        m = run.fields("machine")
        m.text("cpu_model")
        m.text("date")
        m.integer("cores")
        m.number("other_processes_cores", default=None)
        cases = [_case_from_json(c) for c in run.items("cases")]
        startup = run.get("startup", (dict, type(None)), default=None)
        if startup is not None:
            _check_startup(_Fields(startup, "startup"))
        return cls(run.text("suite"), opts, dict(m.data), cases, startup)

    @classmethod
    def read_json(cls, path: str) -> SuiteResult:
        with open(path) as f:
            try:
                data = json.load(f)
            except RecursionError:
                raise ValueError("JSON nested too deeply") from None
        return cls.from_json(data)

    def write_json(self, path: str) -> None:
        """Write :meth:`to_json` as strict JSON (a NaN or infinity becomes null)."""
        with open(path, "w") as f:
            json.dump(_finite(self.to_json()), f, indent=1, allow_nan=False)
            f.write("\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _case_from_json(c: _Fields) -> CaseResult:
    shape = tuple(c.items("shape", int))
    if len(shape) < 2 or min(shape) < 1 or math.prod(shape) > 1 << 53:
        raise ValueError(f"{c.where}: 'shape' must be at least 2 positive sizes (of at most "
                         f"2**53 elements in all), got {shape}")
    case = Case(shape, c.choice("dtype", _dtypes.NAMES), c.choice("layout", LAYOUTS),
                c.choice("op", OPS, default="backward"))
    timings = {}
    for name, t in c.fields("timings").data.items():
        t = _Fields(t, f"{c.where} timing {name!r}")
        samples = [_finite_number(s, t.where, "samples_ms") / 1e3
                   for s in t.items("samples_ms", float)]
        if not samples or min(samples) < 0:
            raise ValueError(f"{t.where}: 'samples_ms' must be non-negative numbers, "
                             f"at least one")
        timings[str(name)] = Timing(samples, t.integer("number"))
    skipped = c.fields("skipped")
    memory = c.fields("extra_memory")
    for name in memory.data:
        per = memory.fields(name)
        for key in per.data:
            per.integer(key, low=0, default=None)
    return CaseResult(
        case, timings, {str(k): skipped.text(k) for k in skipped.data}, dict(memory.data),
        c.number("max_rel_diff_vs_torch", default=None),
        c.get("deterministic_across_threads", (bool, type(None))),
        c.number("cores_busy", default=None), c.integer("threads"),
        c.number("max_rel_diff_vs_torch_compile", default=None))


def _check_startup(s: _Fields) -> None:
    calls = [str(k) for k in s.items("calls", str)]
    if not calls:
        raise ValueError(f"{s.where}: 'calls' is empty")
    for phase in ("cold", "warm"):
        p = s.fields(phase)
        p.number("import_s")
        first = p.fields("first_call_s")
        for key in first.data:
            first.number(key)
        if calls[0] not in first.data:
            raise ValueError(f"{first.where}: no time for the first call {calls[0]!r}")


_REQUIRED = object()


class _Fields:
    """A JSON object being read: each accessor checks one field's type (and range), raising
    ValueError that names the field and says what was expected and what was found."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
        self.data, self.where = data, where

    def get(self, key: str, types: Any, default: Any = _REQUIRED) -> Any:
        if key not in self.data:
            if default is _REQUIRED:
                raise ValueError(f"{self.where}: missing {key!r}")
            return default
        value = self.data[key]
        # JSON's true/false load as bool, a subclass of int: a flag is not a number
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            kinds = [t for t in types if not (t is int and float in types)]  # "a number"
            raise ValueError(f"{self.where}: {key!r} must be "
                             f"{' or '.join(_KINDS[t] for t in kinds)}, got {value!r}")
        return value

    def fields(self, key: str) -> _Fields:
        return _Fields(self.get(key, (dict,)), f"{self.where} {key!r}")

    def items(self, key: str, kind: Any = dict) -> List[Any]:
        values = self.get(key, (list,))
        types = (int, float) if kind is float else (kind,)
        for i, v in enumerate(values):
            if not isinstance(v, types) or isinstance(v, bool):
                raise ValueError(f"{self.where}: {key!r}[{i}] must be {_KINDS[kind]}, "
                                 f"got {v!r}")
        return [_Fields(v, f"{self.where} {key}[{i}]") for i, v in enumerate(values)
                ] if kind is dict else values

    def text(self, key: str) -> str:
        return self.get(key, (str,))

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(key, (bool,), default)

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self.get(key, (int, float) + ((type(None),) if default is None else ()), default)
        return None if value is None else _finite_number(value, self.where, key)

    def integer(self, key: str, low: Optional[int] = 1, default: Any = _REQUIRED) -> Any:
        value = self.get(key, (int,) + ((type(None),) if default is None else ()), default)
        if value is not None and low is not None and value < low:
            raise ValueError(f"{self.where}: {key!r} must be at least {low}, got {value!r}")
        return value

    def choice(self, key: str, allowed: Iterable[str], default: Any = _REQUIRED) -> str:
        value = self.get(key, (str,), default)
        if value not in allowed:
            raise ValueError(f"{self.where}: {key!r} must be one of {', '.join(allowed)}, "
                             f"got {value!r}")
        return value


def _finite_number(value: Any, where: str, key: str) -> float:
    """``value`` (a JSON number) as a finite float; JSON's integers may be too large for one,
    and Python's JSON reader takes NaN and Infinity."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        text = repr(value) if len(repr(value)) <= 20 else f"a number of {len(str(value))} digits"
        raise ValueError(f"{where}: {key!r} must be a finite number, got {text}")
    return number


_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true or false",
          int: "an integer", float: "a number", type(None): "null"}
