"""The habits the repository keeps: ruff's lint rules and formatting (pyproject.toml: 110 columns,
import order), over the package, the tests, the examples and the benchmarks."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["cpshard", "tests", "examples", "benchmarks"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *CHECKED], cwd=ROOT, capture_output=True, text=True
    )


@pytest.mark.parametrize("args", [("check", "--no-cache"), ("format", "--check", "--no-cache")], ids=str)
def test_ruff_is_clean(args):
    result = _ruff(*args)
    assert result.returncode == 0, f"ruff {' '.join(args)}:\n{result.stdout}{result.stderr}"
