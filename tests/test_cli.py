"""The `bngrad` command as a whole: help text, messages in flags, a reader that goes away."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from bngrad import cli, vectors
from bngrad.cli import main
from bngrad.errors import ArgumentValueError


def test_compare_help_states_exit_codes_pass_rule_and_dtypes(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["compare", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())     # argparse wraps lines
    for needed in ("exit status:", "0 every element", "1 some element", "2 unusable input",
                   "pass rule:", "|device - expected| <= atol + rtol * |expected|",
                   "--dbias FILE device's dbias (optional), in the parameter dtype "
                   "(param_dtype)", "--show N", "NaN or infinity where a finite value is "
                   "expected always fails", "exact equality for --dist exact"):
        assert needed in text, needed


def test_ulp_with_atol_message_names_flags(tmp_path, capsys):
    out = tmp_path / "v"
    vectors.write_vectors(out, 2, 8)
    assert main(["compare", str(out), "--dx", str(out / "dx.bin"), "--ulp", "1",
                 "--rtol", "0"]) == 2
    err = capsys.readouterr().err
    assert "--ulp: give either --ulp or --atol/--rtol" in err and "ulp: give either ulp" not in err


def test_flag_message_rewrites_only_known_leading_names():
    flags = {"batch": "--batch", "channel": "--channel", "param_dtype": "--param-dtype"}
    assert cli.flag_message(ArgumentValueError("param_dtype: bad"), flags) == "--param-dtype: bad"
    assert cli.flag_message(ArgumentValueError("batch, channel: too big"), flags) == \
        "--batch, --channel: too big"
    assert cli.flag_message(ArgumentValueError("vectors: x: y"), flags) == "vectors: x: y"


@pytest.mark.parametrize("command", [
    ["vectors", "--batch", "2", "--channel", "4", "--dtype", "fp32"],
    ["vectors", "--suite", "dsp"],
    ["dsp-kit"],
], ids=["vectors", "vectors-suite", "dsp-kit"])
@pytest.mark.parametrize("below", ["sub", "a/b"])
def test_out_under_a_file_names_the_flag(tmp_path, capsys, command, below):
    """`--out file.bin/sub` said Python's `[Errno 20] Not a directory: 'file.bin/sub'`, without
    the flag."""
    (tmp_path / "file.bin").write_bytes(b"")
    out = str(tmp_path / "file.bin" / below)
    assert main([*command, "--out", out]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"bngrad {command[0]}: error: --out: cannot write to {out}: Not a "
                            f"directory ({tmp_path / 'file.bin'} is not a directory)\n")


def test_path_message_names_the_flag_the_path_and_the_reason():
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/proc/x")
    assert cli.path_message(missing, "--out", "/proc/x/y") == \
        "--out: cannot write to /proc/x/y: No such file or directory (/proc/x)"
    refused = PermissionError(errno.EACCES, "Permission denied", "ro/v")
    assert cli.path_message(refused, "--out", "ro/v") == \
        "--out: cannot write to ro/v: Permission denied"


class _ClosedPipe:
    """A stdout whose reader has gone away."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_broken_pipe_in_process_exits_quietly(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    argv = ["vectors", "--batch", "2", "--channel", "4", "--dtype", "fp32",
            "--out", str(tmp_path / "v")]
    assert main(argv) == cli.BROKEN_PIPE_EXIT == 141
    assert (tmp_path / "v" / "manifest.json").exists()       # the work was done first


@pytest.mark.parametrize("command", [
    ["vectors", "--batch", "2", "--channel", "4", "--dtype", "fp32", "--out", "v"],
    ["compare", "golden", "--dx", "golden/dx.bin"],
])
def test_broken_pipe_subprocess_has_no_traceback(tmp_path, command):
    """`bngrad vectors ... | head` used to end in a BrokenPipeError traceback."""
    vectors.write_vectors(tmp_path / "golden", 2, 4)
    read_end, write_end = os.pipe()
    os.close(read_end)                      # the reader is gone before the first write
    try:
        done = subprocess.run([sys.executable, "-m", "bngrad", *command], cwd=tmp_path,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 141, done.stderr
    assert done.stderr == ""
