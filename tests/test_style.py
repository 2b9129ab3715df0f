"""The habits the repository keeps: ruff's lint rules and formatting (pyproject.toml: 110 columns,
import order), over the package, the tests, the examples and the benchmarks; examples that use public names
only, and an API reference whose every name exists."""

import ast
import importlib
import re
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


def _cpshard_imports(path: Path) -> list[str]:
    """The dotted names of cpshard that ``path`` imports (``from cpshard.x import y``: ``cpshard.x.y``)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cpshard":
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.split(".")[0] == "cpshard"]
    return names


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*.py")), ids=lambda path: path.name)
def test_examples_import_public_names_only(example):
    """An example is what a user copies: it uses the package's exports and what docs/API.md promises."""
    import cpshard

    promised = (ROOT / "docs" / "API.md").read_text()
    for name in _cpshard_imports(example):
        module, _, attribute = name.rpartition(".")
        exported = module == "cpshard" and attribute in cpshard.__all__
        documented = name in promised or module in promised and f"`{attribute}" in promised
        public = name == "cpshard" or exported or documented
        assert public, f"{example.name} imports {name}, which is neither exported nor in docs/API.md"


def _resolves(dotted: str) -> bool:
    """Whether ``dotted`` (``cpshard.debug.trace_comms``) names a module or an attribute of one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        try:
            for part in parts[split:]:
                found = getattr(found, part)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("doc", ["README.md", "docs/API.md", "docs/measurements.md"])
def test_every_name_the_docs_write_exists(doc):
    """The API reference and the README are kept true: each dotted cpshard name they write resolves."""
    names = set(re.findall(r"`(cpshard(?:\.\w+)+)", (ROOT / doc).read_text()))
    assert [name for name in sorted(names) if not _resolves(name)] == []
