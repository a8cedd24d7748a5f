"""`bngrad vectors --suite dsp`: write the standard DSP vector suite (glue over
bngrad.dsp_suite); the other `bngrad vectors` flags describe one case and are refused with it.
"""

from __future__ import annotations

import argparse
import sys

from . import dsp_suite, vectors
from .cli import path_message
from .errors import BngradError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suite", choices=dsp_suite.SUITES, default=None,
                        help="write the standard suite instead of one case: one directory per "
                             "case under --out (vectors, manifest.json, case.txt for the C "
                             "harness of `bngrad dsp-kit`) and index.txt; --force replaces a "
                             "suite already there. Not with --batch, --channel, --dtype, "
                             "--param-dtype, --eval, --seed, --dist or --format")


def run(args: argparse.Namespace) -> int:
    single = {"--batch": args.batch is not None, "--channel": args.channel is not None,
              "--dtype": args.dtype is not None, "--param-dtype": args.param_dtype is not None,
              "--eval": args.eval, "--seed": args.seed != 0,
              "--dist": args.dist != vectors.DISTRIBUTIONS[0],
              "--format": args.format != vectors.FORMATS[0]}
    given = [flag for flag, present in single.items() if present]
    if given:
        print(f"bngrad vectors: error: {', '.join(given)}: not used with --suite (the suite's "
              "cases fix them)", file=sys.stderr)
        return 2
    try:
        cases = dsp_suite.write_suite(args.out, args.suite, overwrite=args.force)
    except vectors.ExistingVectorsError as e:
        print(f"bngrad vectors: error: {e.directory} already holds a vector suite; pass "
              "--force to replace it", file=sys.stderr)
        return 2
    except OSError as e:    # all that is written is under --out
        print(f"bngrad vectors: error: {path_message(e, '--out', args.out)}", file=sys.stderr)
        return 2
    except BngradError as e:
        print(f"bngrad vectors: error: {str(e).replace('out_dir:', '--out:', 1)}",
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}: the {args.suite} suite, {len(cases)} cases (listed in "
          f"{args.out}/{dsp_suite.INDEX}; each case's manifest.json says what it exercises)")
    return 0
