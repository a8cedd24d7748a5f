"""`bngrad dsp-kit`: write the portable C99 verification kit (glue over bngrad.dsp_suite).

Exit status: 0 written, 2 unusable arguments (said in one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import sys

from . import dsp_suite, vectors
from .cli import path_message
from .errors import BngradError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="replace the kit's files already in DIR (no other file is touched)")


def run(args: argparse.Namespace) -> int:
    try:
        files = dsp_suite.write_kit(args.out, overwrite=args.force)
    except vectors.ExistingVectorsError as e:
        print(f"bngrad dsp-kit: error: {e.directory} already holds {', '.join(e.present)}; "
              "pass --force to replace them", file=sys.stderr)
        return 2
    except OSError as e:    # all that is written is under --out
        print(f"bngrad dsp-kit: error: {path_message(e, '--out', args.out)}", file=sys.stderr)
        return 2
    except BngradError as e:
        print(f"bngrad dsp-kit: error: {str(e).replace('out_dir:', '--out:', 1)}",
              file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {' '.join(files)}")
    print(f"next: make -C {args.out} run SUITE=/absolute/path/of/suite (written by `bngrad "
          "vectors --suite dsp --out suite`), then `bngrad dsp-check suite`")
    return 0
