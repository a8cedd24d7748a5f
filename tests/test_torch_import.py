"""Without PyTorch installed, ``import bngrad`` works and ``import bngrad.torch`` says how to
install it (simulated in a subprocess that cannot import torch)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_BLOCK_TORCH = textwrap.dedent("""
    import sys

    class BlockTorch:
        # A meta-path finder that makes 'torch' (and its submodules) impossible to import.
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, BlockTorch())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_core_imports_without_torch():
    result = _run("""
        import bngrad
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_bngrad_torch_without_torch_says_how_to_install():
    result = _run("""
        try:
            import bngrad.torch
        except ImportError as exc:
            print(type(exc).__name__, exc)
        else:
            print("imported")
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ImportError "), result.stdout
    assert "pip install '.[torch]'" in result.stdout
