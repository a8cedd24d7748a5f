"""`bngrad vectors`: write golden vectors for the DSP BatchNormGrad (glue over bngrad.vectors).

Exit status: 0 written, 2 unusable arguments (said in one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import sys

from . import _cli_dsp_suite, vectors
from .cli import flag_message, path_message
from .errors import BngradError

# Python argument names in bngrad.vectors' messages -> this command's flags
FLAGS = {"batch": "--batch", "channel": "--channel", "dtype": "--dtype",
         "param_dtype": "--param-dtype", "seed": "--seed", "dist": "--dist",
         "format": "--format", "out_dir": "--out"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, help="batch size m (rows); required unless --suite")
    parser.add_argument("--channel", type=int,
                        help=f"number of channels (batch*channel <= 2**26 = "
                             f"{vectors.MAX_ELEMENTS}); required unless --suite")
    parser.add_argument("--dtype", choices=tuple(vectors.DTYPES),
                        help="x, dy, dx: fp32 (fp_batch_norm_grad) or fp16 "
                             "(hp_batch_norm_grad); required unless --suite")
    parser.add_argument("--param-dtype", choices=tuple(vectors.DTYPES), default=None,
                        help="mean, invar, scale, dbias, dscale (default: --dtype; fp16 data "
                             "may use fp32)")
    parser.add_argument("--eval", action="store_true",
                        help="is_train = 0: mean/invar are running statistics")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--dist", choices=vectors.DISTRIBUTIONS, default="normal",
                        help="data distribution; 'exact' makes every statistic and expected "
                             "output exact in the dtype (even batch only), and the default "
                             "check exact equality")
    parser.add_argument("--format", choices=vectors.FORMATS, default="bin",
                        help="raw little-endian .bin files (default) or one .npz")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--force", action="store_true",
                        help="replace golden vectors already in DIR (and remove the other "
                             "format's files bngrad wrote there); without it such a DIR is "
                             "refused")
    _cli_dsp_suite.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.suite is not None:
        return _cli_dsp_suite.run(args)
    missing = [flag for flag in ("--batch", "--channel", "--dtype")
               if getattr(args, flag[2:]) is None]
    if missing:
        print(f"bngrad vectors: error: {', '.join(missing)}: required (or --suite dsp)",
              file=sys.stderr)
        return 2
    try:
        manifest = vectors.write_vectors(
            args.out, args.batch, args.channel, args.dtype, train=not args.eval,
            seed=args.seed, dist=args.dist, param_dtype=args.param_dtype,
            file_format=args.format, overwrite=args.force)
    except vectors.ExistingVectorsError as e:
        print(f"bngrad vectors: error: {e.directory} already holds golden vectors "
              f"({', '.join(e.present)}); pass --force to replace them", file=sys.stderr)
        return 2
    except OSError as e:    # all that is written is under --out
        print(f"bngrad vectors: error: {path_message(e, '--out', args.out)}", file=sys.stderr)
        return 2
    except BngradError as e:
        print(f"bngrad vectors: error: {flag_message(e, FLAGS)}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"bngrad vectors: error: not enough memory for batch {args.batch}, channel "
              f"{args.channel}", file=sys.stderr)
        return 2
    mode = "train" if manifest["is_train"] else "eval"
    print(f"wrote {args.out}: {manifest['functions'][0]} {mode}, batch {manifest['batch']}, "
          f"channel {manifest['channel']}, {manifest['distribution']} data, seed "
          f"{manifest['seed']}")
    for name, entry in manifest["arrays"].items():
        shape = "x".join(map(str, entry["shape"]))
        print(f"  {entry['role']:8s} {name:6s} {entry['dtype']:7s} {shape:>9s}  {entry['file']}")
    for name, tol in manifest["tolerances"].items():
        rule = ("exact equality" if tol["atol"] == 0 and tol["rtol"] == 0
                else f"atol {tol['atol']:.3g} (the largest channel's), rtol {tol['rtol']:.3g}")
        print(f"  default tolerance {name}: {rule}")
    return 0
