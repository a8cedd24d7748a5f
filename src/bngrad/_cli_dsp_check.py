"""`bngrad dsp-check`: compare the C harness's outputs for every case of a vector suite
(glue over bngrad.dsp_suite), one line per case.

Exit status: 0 every case passes, 1 some case fails, broke a buffer or has no outputs, 2
unusable input (no index, or a case whose outputs or vectors cannot be read: its line says
ERROR).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from . import dsp_suite, vectors

EPILOG = """\
Each case directory must hold the harness's dx.out.bin, dbias.out.bin and dscale.out.bin
(bng_harness from `bngrad dsp-kit` writes them). A case passes when `bngrad compare` with the
case's default tolerances passes for all three outputs. A case where the harness left
broke.txt (the function wrote past the end of an output or into an input) is BROKE, whatever
its outputs hold. A case without outputs is MISSING: the harness skipped it (and said why) or
stopped before it (a crash), or was not run on it.

exit status:
  0  every case passes
  1  some case FAILs (an element beyond tolerance), BROKE a buffer or is MISSING (no outputs)
  2  unusable input: no index.txt, or a case is in ERROR (wrong-size output, altered vectors)
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    parser.add_argument("suite", metavar="SUITE",
                        help="directory written by `bngrad vectors --suite dsp --out SUITE`")
    parser.add_argument("--report", action="store_true",
                        help="after a failing case's line, its full `bngrad compare` report")
    parser.add_argument("--show", type=int, default=vectors.SHOW, metavar="N",
                        help=f"with --report, the first N failing elements per output "
                             f"(default {vectors.SHOW})")


def run(args: argparse.Namespace) -> int:
    if args.show < 0:
        print(f"bngrad dsp-check: error: --show: expected an int >= 0, got {args.show}",
              file=sys.stderr)
        return 2
    try:
        results = dsp_suite.check_suite(args.suite, show=args.show)
    except vectors.UnusableInputError as e:
        print(f"bngrad dsp-check: unusable input: {e}", file=sys.stderr)
        return 2
    for result in results:
        print(result.line())
        if args.report and result.report is not None and not result.passed:
            print("\n".join("    " + line for line in result.report.format().splitlines()))
    counts = Counter(r.status for r in results)
    verdicts = ("PASS", "FAIL", "BROKE", "MISSING", "ERROR")
    print(f"{len(results)} cases: " + ", ".join(f"{counts[s]} {s}" for s in verdicts
                                                 if counts[s]))
    if counts["ERROR"]:
        return 2
    return 0 if counts["PASS"] == len(results) else 1
