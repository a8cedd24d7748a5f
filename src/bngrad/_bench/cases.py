"""Benchmark cases and suites: a shape, a dtype, a memory layout and an operation per case."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import _dtypes
from ..errors import ArgumentValueError

#: Memory layouts of (grad_out, input), named independently of the number of dimensions.
LAYOUTS: Dict[str, str] = {
    "contiguous": "both C-contiguous (NCHW, NCDHW, (N, C))",
    "channels_last": "both channels-last (NHWC, NDHWC)",
    "mixed": "grad_out channels-last, input C-contiguous",
    "mixed_r": "grad_out C-contiguous, input channels-last",
    "sliced": "input a cropped, non-contiguous view of a larger array",
}
LAYOUT_ALIASES = {"nchw": "contiguous", "ncdhw": "contiguous", "ncl": "contiguous",
                  "nc": "contiguous", "cf": "contiguous", "channels_first": "contiguous",
                  "nhwc": "channels_last", "ndhwc": "channels_last", "nlc": "channels_last",
                  "cl": "channels_last", "channels-last": "channels_last",
                  "mixed-r": "mixed_r"}


#: What a case times: batch norm's backward, or a fused pair's forward + backward.
OPS: Dict[str, str] = {
    "backward": "batch norm's backward (training, three gradients)",
    "relu": "BN -> ReLU, forward + backward (bngrad.fused, 1-bit mask)",
    "add-relu": "BN -> add -> ReLU, forward + backward (bngrad.fused, side input, 1-bit mask)",
}
#: ``--op`` values -> the case operations they select
OP_GROUPS: Dict[str, Tuple[str, ...]] = {"backward": ("backward",), "fused": ("relu", "add-relu")}


@dataclass(frozen=True)
class Case:
    """One benchmark case: a logical shape (channels on axis 1), a dtype, a layout and the
    operation timed (one of :data:`OPS`)."""

    shape: Tuple[int, ...]
    dtype: str
    layout: str
    op: str = "backward"

    @property
    def fused(self) -> bool:
        return self.op != "backward"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes_per_array(self) -> int:
        return self.numel * _dtypes.spec(self.dtype).numpy.itemsize

    @property
    def layout_name(self) -> str:
        """The layout as people write it for this many dimensions (NCHW, NDHWC, ...)."""
        spatial = {2: "", 3: "L", 4: "HW", 5: "DHW"}.get(len(self.shape), "S")
        first, last = "NC" + spatial, "N" + spatial + "C"
        return {"contiguous": first, "channels_last": last,
                "mixed": f"dy {last}, x {first}", "mixed_r": f"dy {first}, x {last}",
                "sliced": f"{first} sliced"}[self.layout]

    @property
    def shape_text(self) -> str:
        return "x".join(str(n) for n in self.shape)

    @property
    def label(self) -> str:
        op = f" {self.op}" if self.fused else ""
        return f"{self.shape_text} {self.dtype} {self.layout_name}{op}"


def _cases(shapes: Iterable[Tuple[int, ...]], dtypes: Iterable[str], layouts: Iterable[str]
           ) -> List[Case]:
    return [Case(tuple(s), d, lay) for s in shapes for d in dtypes for lay in layouts]


# ResNet-50's batch-norm inputs (C, H, W) at 224x224, each distinct shape once.
RESNET50_SHAPES = [(64, 112, 112), (64, 56, 56), (128, 56, 56), (256, 56, 56), (128, 28, 28),
                   (256, 28, 28), (512, 28, 28), (256, 14, 14), (512, 14, 14), (1024, 14, 14),
                   (512, 7, 7), (2048, 7, 7)]
_RESNET_ISSUE = [(32, 64, 112, 112), (32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14),
                 (32, 2048, 7, 7)]
CF_CL = ("contiguous", "channels_last")


def _suite_default() -> List[Case]:
    return (
        _cases(_RESNET_ISSUE, ["float32"], CF_CL)
        + _cases([(4096, 1024), (65536, 64), (256, 4096)], ["float32"], ["contiguous"])
        + _cases([(64, 2, 224, 224), (64, 3, 224, 224)], ["float32"], ["channels_last"])
        + _cases([(8, 32, 32, 64, 64)], ["float32"], CF_CL)
        + _cases([(32, 256, 56, 56)], ["bfloat16", "float16"], CF_CL)
        + _cases([(4096, 1024)], ["bfloat16", "float16"], ["contiguous"])
        + _cases([(64, 3, 224, 224)], ["bfloat16", "float16"], ["channels_last"])
        + _cases([(8, 32, 32, 64, 64)], ["bfloat16"], CF_CL)
        + _cases([(32, 256, 56, 56)], ["float32"], ["mixed", "mixed_r", "sliced"])
        + _cases([(32, 256, 56, 56)], ["bfloat16"], ["mixed"])
        + _cases([(4096, 1024)], ["float32"], ["sliced"])
        + _cases([(32, 256, 28, 28)], ["float64"], CF_CL)
    )


def _suite_quick() -> List[Case]:
    return (
        _cases([(32, 64, 56, 56)], ["float32"], CF_CL)
        + _cases([(4096, 1024)], ["float32"], ["contiguous"])
        + _cases([(64, 3, 112, 112)], ["float32"], ["channels_last"])
        + _cases([(32, 64, 56, 56)], ["bfloat16"], ["channels_last"])
        + _cases([(16, 64, 56, 56)], ["float32"], ["mixed", "sliced"])
    )


# Small layers, where a call's fixed cost and its arithmetic in cache decide rather than memory:
# small batches of ResNet maps (issue 12's three and two more) and a multilayer perceptron's.
SMALL_SHAPES = [(16, 128, 14, 14), (16, 512, 4, 4), (64, 64, 8, 8), (4, 256, 7, 7),
                (8, 64, 28, 28)]


def _suite_small() -> List[Case]:
    return (_cases(SMALL_SHAPES, ["float32"], CF_CL)
            + _cases([(64, 512), (256, 1024), (1024, 128)], ["float32"], ["contiguous"]))


def _suite_resnet50() -> List[Case]:
    return _cases([(32,) + s for s in RESNET50_SHAPES], ["float32", "bfloat16"], CF_CL)


#: suite name -> (cases, default repeat count, one-line description)
SUITES: Dict[str, Tuple[Callable[[], List[Case]], int, str]] = {
    "quick": (_suite_quick, 5, "a handful of mid-sized cases, under a minute"),
    "default": (_suite_default, 7, "ResNet-50, 2-D, small-C, 3-D, half dtypes, mixed and "
                                   "sliced layouts"),
    "small": (_suite_small, 7, "small layers (float32, 0.1-1.6 MiB), where a call's fixed cost "
                               "and its arithmetic decide"),
    "resnet50": (_suite_resnet50, 5, "every ResNet-50 batch-norm shape at batch 32, NCHW and "
                                     "channels-last, float32 and bfloat16"),
}


def _dtype_name(key: str) -> Optional[str]:
    spec = _dtypes.by_alias(key)
    return None if spec is None else spec.name


def _layout_name(key: str) -> Optional[str]:
    key = LAYOUT_ALIASES.get(key, key)
    return key if key in LAYOUTS else None


def _parse_names(values: Optional[Sequence[str]], argument: str, what: str,
                 known: Sequence[str], aliases: Iterable[str],
                 resolve: Callable[[str], Optional[str]]) -> Optional[set]:
    """The canonical names among ``values`` (each may be comma-separated), None for no filter."""
    if not values:
        return None
    names = set()
    for value in values:
        for item in value.split(","):
            key = item.strip().lower()
            if not key:
                continue
            name = resolve(key)
            if name is None:
                raise ArgumentValueError(
                    f"{argument}: unknown {what} {item.strip()!r}; expected one of "
                    f"{', '.join(known)} (or an alias such as "
                    f"{', '.join(sorted(aliases)[:4])})")
            names.add(name)
    return names


def select_cases(suite: str, dtypes: Optional[Sequence[str]] = None,
                 layouts: Optional[Sequence[str]] = None, op: str = "backward") -> List[Case]:
    """The cases of ``suite`` whose dtype and layout are among those given (None: all).

    ``dtypes`` and ``layouts`` are lists of names, each may be comma-separated; aliases such as
    ``bf16``, ``fp32``, ``nchw`` or ``nhwc`` are accepted. ``op``: "backward" (batch norm's
    backward) or "fused" (each shape twice, BN -> ReLU and BN -> add -> ReLU, forward +
    backward). Raises ArgumentValueError for an unknown suite, op or name, or when the
    filters leave no case.
    """
    if suite not in SUITES:
        raise ArgumentValueError(f"suite: unknown suite {suite!r}; expected one of "
                                 f"{', '.join(SUITES)}")
    if op not in OP_GROUPS:
        raise ArgumentValueError(f"op: unknown operation {op!r}; expected one of "
                                 f"{', '.join(OP_GROUPS)}")
    cases = [Case(c.shape, c.dtype, c.layout, name) for c in SUITES[suite][0]()
             for name in OP_GROUPS[op]]
    keep_dtypes = _parse_names(dtypes, "dtypes", "dtype", _dtypes.NAMES,
                               [a for s in _dtypes.DTYPES for a in s.aliases], _dtype_name)
    keep_layouts = _parse_names(layouts, "layouts", "layout", list(LAYOUTS), LAYOUT_ALIASES,
                                _layout_name)
    selected = [c for c in cases
                if (keep_dtypes is None or c.dtype in keep_dtypes)
                and (keep_layouts is None or c.layout in keep_layouts)]
    if not selected:
        have_d = sorted({c.dtype for c in cases})
        have_l = sorted({c.layout for c in cases})
        raise ArgumentValueError(
            f"no case of suite {suite!r} matches the filters; that suite has dtypes "
            f"{', '.join(have_d)} and layouts {', '.join(have_l)}")
    return selected
