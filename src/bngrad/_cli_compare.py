"""`bngrad compare`: judge a device's outputs against golden vectors (glue over bngrad.vectors).

Exit status: 0 all outputs within tolerance, 1 some are not, 2 the input is unusable.
"""

from __future__ import annotations

import argparse
import sys

from . import vectors
from .errors import BngradError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory written by `bngrad vectors`")
    parser.add_argument("--dx", required=True, metavar="FILE",
                        help="device's dx: raw little-endian, in the manifest's dtype")
    parser.add_argument("--dbias", metavar="FILE", help="device's dbias (optional)")
    parser.add_argument("--dscale", metavar="FILE", help="device's dscale (optional)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: manifest's)")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: manifest's)")
    parser.add_argument("--ulp", type=float,
                        help="judge by units in the last place instead of --atol/--rtol")


def run(args: argparse.Namespace) -> int:
    outputs = {name: getattr(args, name) for name in vectors.OUTPUTS
               if getattr(args, name) is not None}
    try:
        golden = vectors.load_vectors(args.dir)
        report = vectors.compare(golden, outputs, atol=args.atol, rtol=args.rtol, ulp=args.ulp)
    except (BngradError, OSError) as e:
        print(f"bngrad compare: unusable input: {e}", file=sys.stderr)
        return 2
    mode = "train" if golden.is_train else "eval"
    print(f"{args.dir}: {golden.dtype} {mode}, batch {golden.batch}, channel {golden.channel}, "
          f"{golden.distribution} data, seed {golden.seed}")
    print(report.format())
    return 0 if report.passed else 1
