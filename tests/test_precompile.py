"""`bngrad precompile` leaves nothing for a first call to compile."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bngrad import cli
from bngrad._precompile import precompile
from bngrad.errors import ArgumentValueError

# Calls of another shape than precompile's own, over every layout and mode, writable and
# read-only: they must find every kernel compiled already.
_SECOND_PROCESS = textwrap.dedent("""
    import numpy as np, bngrad
    rng = np.random.default_rng(1)
    def calls(x, dy, read_only):
        x.flags.writeable = dy.flags.writeable = not read_only
        C = x.shape[1]
        w = np.full(C, 2.0, x.dtype)
        rm, rv = np.zeros(C, x.dtype), np.ones(C, x.dtype)
        y, m, s = bngrad.batch_norm_forward(x, w, None, rm, rv, True)
        bngrad.batch_norm_forward(x, w, None, rm, rv, False)
        bngrad.batch_norm_backward(dy, x, w, None, None, m, s)
        bngrad.batch_norm_backward(dy, x, w, rm, rv, train=False)
        bngrad.batch_norm_moments(x)
    for shape in [(32, 16, 7, 7), (4096, 3), (3, 5, 300), (16, 300), (2, 64, 17, 17)]:
        for read_only in (False, True):
            x = rng.standard_normal(shape).astype(np.float32)
            calls(x, rng.standard_normal(shape).astype(np.float32), read_only)
    nhwc = np.moveaxis(rng.standard_normal((8, 8, 8, 16)).astype(np.float32), -1, 1)
    calls(nhwc, nhwc.copy(), False)
    calls(nhwc, np.ascontiguousarray(nhwc), False)
""")


def _cache_files(cache: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in cache.rglob("*.nb*")}


def test_precompiled_cache_serves_a_new_process(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "bngrad", "precompile", "--dtype", "float32"],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    assert "float32" in done.stdout and "done in" in done.stdout
    before = _cache_files(tmp_path)
    assert before
    second = subprocess.run([sys.executable, "-c", _SECOND_PROCESS], env=env,
                            capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stderr
    after = _cache_files(tmp_path)
    compiled_again = sorted(p.name for p in after if before.get(p) != after[p])
    assert compiled_again == []


def test_precompile_names_a_bad_dtype(capsys):
    with pytest.raises(ArgumentValueError, match="dtypes: .*'int8'"):
        precompile(["int8"])
    with pytest.raises(SystemExit):
        cli.main(["precompile", "--dtype", "int8"])
    assert "invalid choice" in capsys.readouterr().err
