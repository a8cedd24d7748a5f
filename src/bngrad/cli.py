"""The `bngrad` command: glue only — argument parsing and dispatch, no maths, no tolerances.

Each subcommand lives in the module that owns its feature and provides two functions:
``add_arguments(parser)`` and ``run(args) -> int`` (the exit code).

If the reader of standard output goes away (``bngrad vectors ... | head``), every subcommand
stops quietly with exit status 141, as a tool killed by SIGPIPE does, instead of a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from importlib import import_module
from pathlib import Path
from typing import Mapping, Optional, Sequence

# subcommand -> (module with add_arguments/run, one-line help)
SUBCOMMANDS = {
    "bench": ("bngrad._cli_bench", "time bngrad against PyTorch and the memory floor"),
    "vectors": ("bngrad._cli_vectors", "write golden test vectors for the DSP BatchNormGrad"),
    "compare": ("bngrad._cli_compare", "compare a device's outputs with golden vectors"),
    "dsp-kit": ("bngrad._cli_dsp_kit", "write the C99 harness and host reference for the DSP "
                "BatchNormGrad"),
    "dsp-check": ("bngrad._cli_dsp_check", "compare the harness's outputs for every case of a "
                  "vector suite"),
    "precompile": ("bngrad._precompile", "compile the kernels now (--fused: the fused forms' "
                   "too), so no first call waits"),
}
BROKEN_PIPE_EXIT = 128 + 13     # the shell's status for a process killed by SIGPIPE


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="bngrad",
                                     description="Batch-norm gradients on NumPy arrays.")
    parser.add_argument("--version", action="version", version=f"bngrad {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        import_module(module).add_arguments(command)
        command.set_defaults(_module=module)
    return parser


def flag_message(error: BaseException, flags: Mapping[str, str]) -> str:
    """``error``'s message with its leading Python argument names (``param_dtype: ...``,
    ``batch, channel: ...``) given as the command's flags (``--param-dtype: ...``)."""
    text = str(error)
    head, sep, rest = text.partition(": ")
    names = [n.strip() for n in head.split(",")]
    if sep and all(n in flags for n in names):
        return ", ".join(flags[n] for n in names) + sep + rest
    return text


def path_message(error: OSError, flag: str, path: str) -> str:
    """``error``, met writing under ``path`` (given as ``flag``), as one line that names the
    flag, the path and the reason (``--out: cannot write to a.bin/v: Not a directory (a.bin is
    not a directory)``) instead of Python's ``[Errno 20] Not a directory: 'a.bin/v'``."""
    text = f"{flag}: cannot write to {path}: {error.strerror or error}"
    culprit = error.filename
    if error.errno == errno.ENOTDIR:    # which part of the path is a file
        culprit = next((f"{p} is not a directory" for p in Path(path).parents
                        if os.path.exists(p) and not os.path.isdir(p)), culprit)
    if culprit is not None and str(culprit) != path:
        text += f" ({culprit})"
    return text


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # stdout without a file descriptor
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = int(import_module(args._module).run(args) or 0)
        sys.stdout.flush()
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_EXIT
    return code


if __name__ == "__main__":
    sys.exit(main())
