"""Fingerprints of the transformers code that cpshard rewrites, so that a release that changed it is a clear
refusal at setup, never a ``TypeError`` deep in a run or, worse, a wrong number.

Where cpshard replaces a piece of a model (a family's attention forward, a recurrent layer's kernel), it was
written against that piece and the code around it (the layer that calls it, the model that builds its mask).
Each such piece is named here by its place in the family's modeling module and fingerprinted as transformers
shipped it: the syntax tree of its code, comments and docstrings aside (a class: each function it defines,
as the class holds it now). A fingerprint that differs means the code differs, and cpshard refuses rather
than trust a rewrite made for other code. Cost: parsing a few functions' source once per prepared model.

Every fingerprint lives in one file, ``written_against.json`` beside this module, by the cpshard module that
relies on the pieces: a new transformers release is checked against one table (``tests/test_fingerprint.py``,
which ``.ci/drift`` runs on the newest releases, names every piece it changed), and a module reads its own
with :func:`written_against`.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import textwrap
from collections.abc import Mapping
from importlib import resources

import transformers

from cpshard.layouts.errors import LayoutError

#: the transformers release cpshard's rewrites were written for and its registered layouts tested on: the
#: fingerprints in :data:`TABLES` were taken from it, and on another release the layout
#: probe checks the registered layouts too (:mod:`cpshard.runtime.probe`)
WRITTEN_FOR = "5.25.0"
#: the file of every table of fingerprints, by the cpshard module that reads it
TABLES = "written_against.json"
#: a piece's fingerprint when its source cannot be read, or it is not there
_ABSENT = "absent"


def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return tree


def _code(function) -> str:
    """The syntax tree of ``function``'s source, comments, docstrings and positions aside."""
    return ast.dump(_without_docstrings(ast.parse(textwrap.dedent(inspect.getsource(function)))))


def _wrapped(piece):
    """The function a kernels module wraps (``@use_kernel_forward_from_hub`` on a function makes it a module
    whose forward calls it: transformers' ``causal_conv1d_forward``), else ``piece``."""
    forward = getattr(type(piece), "forward", None)
    if not inspect.isfunction(forward) or "func" not in forward.__code__.co_freevars:
        return piece
    return forward.__closure__[forward.__code__.co_freevars.index("func")].cell_contents


def _functions(piece) -> list:
    """The functions that make ``piece``: itself (or the function a kernels module wraps), or each function
    a class defines, static, class and property methods included (as it holds them now, so a method
    replaced on the class counts)."""
    if not inspect.isclass(piece):
        return [_wrapped(piece)]
    found = []
    for _, value in sorted(vars(piece).items()):
        if isinstance(value, property):
            found += [part for part in (value.fget, value.fset, value.fdel) if part is not None]
        else:
            found.append(getattr(value, "__func__", value))  # staticmethod, classmethod
    unwrapped = [inspect.unwrap(value) for value in found]
    return [value for value in unwrapped if inspect.isfunction(value)]


def _resolve(module, dotted: str):
    piece = module
    for part in dotted.split("."):
        piece = getattr(piece, part)
    return piece


def fingerprint(module_name: str, dotted: str) -> str:
    """The fingerprint of the piece ``dotted`` (``"BloomModel.forward"``, ``"BloomAttention"``) of the module
    ``module_name`` as installed now, or ``"absent"`` where it is not there or its source cannot be read."""
    try:
        functions = _functions(_resolve(importlib.import_module(module_name), dotted))
        code = "\n".join(_code(function) for function in functions)
    except (AttributeError, ImportError, OSError, TypeError, SyntaxError):
        return _ABSENT
    return hashlib.sha256(code.encode()).hexdigest()[:16]


def changed(module_name: str, expected: Mapping[str, str]) -> list[str]:
    """The pieces of ``module_name`` whose code is not the code their fingerprints in ``expected`` were
    taken from."""
    return [dotted for dotted, want in expected.items() if fingerprint(module_name, dotted) != want]


def check_written_for(what: str, module_name: str, expected: Mapping[str, str]) -> None:
    """Raise a :class:`LayoutError` naming ``what`` cpshard rewrites, the installed transformers and the
    way out, where any piece of ``expected`` differs from the code it was written for."""
    differing = changed(module_name, expected)
    if differing:
        raise LayoutError(
            f"{what}: cpshard rewrites this code of {module_name} as transformers {WRITTEN_FOR} has it, and "
            f"the installed transformers {transformers.__version__} has other code in "
            f"{', '.join(differing)}, so cp could not vouch for its results: install transformers=="
            f"{WRITTEN_FOR} (the tested set: constraints.txt in cpshard's repository), or run this model "
            "without cp"
        )


@functools.cache
def _tables() -> dict:
    """The file, read once per process (every table's module reads its own at import); never modified:
    :func:`written_against` hands out copies."""
    return json.loads(resources.files(__package__).joinpath(TABLES).read_text())


def _entry(entry: dict) -> tuple[str, dict[str, str]]:
    return entry["module"], dict(entry["fingerprints"])


def written_against(cpshard_module: str):
    """The table of ``cpshard_module`` (its ``__name__``): ``(transformers module, {piece: fingerprint})``,
    or such pairs by the class it rewrites where it rewrites several families. A fresh copy each call."""
    table = _tables()[cpshard_module]
    if "module" in table:
        return _entry(table)
    return {name: _entry(entry) for name, entry in table.items()}


def every_table() -> dict[str, tuple[str, dict[str, str]]]:
    """Every table's pairs, each named by its cpshard module (and the class it rewrites, where several)."""
    entries = {}
    for cpshard_module in _tables():
        table = written_against(cpshard_module)
        if isinstance(table, tuple):
            entries[cpshard_module] = table
        else:
            entries.update({f"{cpshard_module}:{name}": pair for name, pair in table.items()})
    return entries
