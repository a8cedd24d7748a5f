"""`bngrad compare`: judge a device's outputs against golden vectors (glue over bngrad.vectors).

Exit status: 0 all outputs within tolerance, 1 some are not, 2 the input is unusable.
"""

from __future__ import annotations

import argparse
import sys

from . import vectors
from .errors import BngradError

EPILOG = """\
pass rule:
  An element passes when it equals the expected value (NaN for NaN, the same
  infinity; +0 and -0 are equal) or, both finite, when
      |device - expected| <= atol + rtol * |expected|     (default)
      ULP distance(device, expected) <= U                  (with --ulp U)
  A NaN or infinity where a finite value is expected always fails. The ULP
  distance counts the representable values between the two (ordered bit
  patterns; docs/dsp.md has it in C). Default atol/rtol per output come from
  the manifest: exact equality for --dist exact vectors, otherwise a bound
  scaled by the size of each channel's terms (the manifest's atol is the
  largest channel's), and dx also fails where a channel's mean error exceeds
  half its atol (a term missing from the formula shifts the whole channel).
  Given --atol/--rtol apply to every element as given. Tolerances must be
  finite and >= 0.

files:
  Raw little-endian IEEE 754, no header. --dx in the data dtype (manifest
  "dtype", batch x channel values, row-major [batch][channel]); --dbias and
  --dscale in the parameter dtype (manifest "param_dtype", channel values).

exit status:
  0  every element of every output given is within tolerance
  1  some element is not, or a dx channel is shifted (the report names the
     worst element, the first --show and the first shifted channel)
  2  unusable input: a missing or wrong-size file, an unreadable or altered
     vectors directory, a bad tolerance, --ulp with --atol/--rtol
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("dir", metavar="DIR", help="directory written by `bngrad vectors`")
    parser.add_argument("--dx", required=True, metavar="FILE",
                        help="device's dx: raw little-endian, in the data dtype (manifest's "
                             "dtype)")
    parser.add_argument("--dbias", metavar="FILE",
                        help="device's dbias (optional), in the parameter dtype (param_dtype)")
    parser.add_argument("--dscale", metavar="FILE",
                        help="device's dscale (optional), in the parameter dtype (param_dtype)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: manifest's)")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: manifest's)")
    parser.add_argument("--ulp", type=float,
                        help="judge by the ULP distance instead of --atol/--rtol")
    parser.add_argument("--show", type=int, default=vectors.SHOW, metavar="N",
                        help=f"list the first N failing elements per output (default "
                             f"{vectors.SHOW}; the worst one is always shown)")


def _unusable(message: str) -> int:
    print(f"bngrad compare: unusable input: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    outputs = {name: getattr(args, name) for name in vectors.OUTPUTS
               if getattr(args, name) is not None}
    try:   # checked here so that the messages name the flags
        for flag in ("atol", "rtol", "ulp"):
            if getattr(args, flag) is not None:
                vectors._tolerance(f"--{flag}", getattr(args, flag))
    except BngradError as e:
        return _unusable(str(e))
    if args.ulp is not None and (args.atol is not None or args.rtol is not None):
        return _unusable("--ulp: give either --ulp or --atol/--rtol, not both")
    if args.show < 0:
        return _unusable(f"--show: expected an int >= 0, got {args.show}")
    try:
        golden = vectors.load_vectors(args.dir)
        report = vectors.compare(golden, outputs, atol=args.atol, rtol=args.rtol, ulp=args.ulp,
                                 show=args.show)
    except (BngradError, OSError) as e:
        return _unusable(str(e))
    except MemoryError:
        return _unusable(f"not enough memory to compare with {args.dir}")
    mode = "train" if golden.is_train else "eval"
    print(f"{args.dir}: {golden.dtype} {mode}, batch {golden.batch}, channel {golden.channel}, "
          f"{golden.distribution} data, seed {golden.seed}")
    print(report.format())
    return 0 if report.passed else 1
