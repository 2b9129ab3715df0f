"""The package's dependencies point one way, downwards: a module imports only from its own folder
and from folders below it. Read from the source (every import statement, at any depth), so an
upward import hidden inside a function is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import cpshard

PACKAGE = Path(cpshard.__file__).parent

#: each folder's (or top-level module's) level; a module may import from its own unit and lower levels
LEVELS = {
    "spec": 0,
    "streams": 0,
    "layouts": 1,
    "comm": 2,
    "call": 3,
    "precision": 3,
    "interfaces": 3,
    "attention": 4,
    "recurrent": 4,
    "loss": 4,
    "parallel": 4,
    "runtime": 5,
    "optim": 5,
    "generation": 6,
    "debug": 6,
    "tools": 7,
    "integrations": 7,
    "bench": 8,
    "cli": 9,
    "__init__": 9,
    "__main__": 10,
}


def unit_of(module: str) -> str:
    """``cpshard.comm.record`` -> ``comm``; ``cpshard`` itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_units(path: Path) -> set[str]:
    units = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "cpshard":
            if node.module == "cpshard":
                units.update(alias.name for alias in node.names)
            else:
                units.add(unit_of(node.module))
        elif isinstance(node, ast.Import):
            units.update(unit_of(alias.name) for alias in node.names if alias.name.split(".")[0] == "cpshard")
    return units


def upward_imports() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        unit = relative.parts[0].removesuffix(".py")
        for other in imported_units(path):
            if other != unit and LEVELS[other] >= LEVELS[unit]:
                found.append(
                    f"{relative} ({unit}, level {LEVELS[unit]}) imports {other} (level {LEVELS[other]})"
                )
    return found


def test_every_unit_has_a_level():
    units = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.rglob("*.py")}
    assert units <= set(LEVELS), f"give these a level in LEVELS: {sorted(units - set(LEVELS))}"


def test_no_upward_imports():
    assert upward_imports() == []


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, by its full dotted name, at any depth."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_specs_are_bare_values():
    """``spec/`` knows no mesh and no process group: what a spec means on a mesh lives in ``comm/``."""
    distributed = {
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in sorted((PACKAGE / "spec").rglob("*.py"))
        for name in imports_of(path)
        if name.startswith("torch.distributed")
    }
    assert distributed == set()


def test_the_check_sees_an_upward_import(tmp_path):
    """The walk finds imports nested in functions (the check can fail)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from cpshard.cli import main\n")
    assert imported_units(module) == {"cli"}
    assert imports_of(module) == {"cpshard.cli"}
