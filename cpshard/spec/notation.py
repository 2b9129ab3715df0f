"""Specs: the placement of one tensor, written per dimension with names (einops style).

``Spec("b s@cp d")`` says: dim 0 is ``b``, dim 1 is ``s`` split over mesh axis ``cp``,
dim 2 is ``d``; every unnamed mesh axis is replicated. ``n@(fsdp,cp)`` splits one
dimension over several axes, major first. ``s@cp:head_tail`` splits in another order of the
sequence (see :mod:`cpshard.spec.sequence`): rank r holds chunks r and 2P-1-r of 2P. Specs are
immutable values; they turn into DTensor placements on a given mesh, and their errors name the
tensor, dim and axis.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache, wraps

import torch

from cpshard.spec.sequence import ORDERS

_TOKEN = re.compile(
    r"^(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:@(?P<axes>[A-Za-z_][A-Za-z0-9_]*|\([^)]*\))(?::(?P<order>[A-Za-z_]+))?)?$"
)
_AXIS = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SpecError(ValueError):
    """A spec that cannot be parsed or does not fit a tensor or a mesh."""


@dataclass(frozen=True)
class Dim:
    """One tensor dimension: its name and the mesh axes it is split over (major first)."""

    name: str
    axes: tuple[str, ...] = ()
    #: which positions each rank holds (cpshard.spec.sequence.ORDERS); only for a dimension split
    #: over one axis
    order: str = "contiguous"

    def __str__(self) -> str:
        if not self.axes:
            return self.name
        suffix = "" if self.order == "contiguous" else f":{self.order}"
        if len(self.axes) == 1:
            return f"{self.name}@{self.axes[0]}{suffix}"
        return f"{self.name}@({','.join(self.axes)}){suffix}"


def _parse_token(token: str, text: str) -> Dim:
    match = _TOKEN.match(token)
    if match is None:
        raise SpecError(f"spec {text!r}: cannot read {token!r}; write a name, name@axis or name@(a,b)")
    group = match.group("axes")
    axes = () if group is None else tuple(a.strip() for a in group.strip("()").split(","))
    if not all(_AXIS.match(a) for a in axes):
        raise SpecError(
            f"spec {text!r}: cannot read the mesh axes of {token!r}; write name@(a,b) with axis names"
        )
    order = match.group("order") or "contiguous"
    if order not in ORDERS or (order != "contiguous" and len(axes) != 1):
        raise SpecError(
            f"spec {text!r}: {token!r} asks for order {order!r}; orders are {', '.join(ORDERS)}, "
            "on a dimension split over one axis"
        )
    return Dim(match.group("name"), axes, order)


def cached_outside_compile(fn):
    """``fn``'s results kept per arguments (a pure function of hashable values on the hot path), asked
    only outside torch.compile: Dynamo traces the function itself into the graph, and would skip a
    cache with a warning to the user of "potential silent incorrectness"."""
    cached = lru_cache(maxsize=1024)(fn)

    @wraps(fn)
    def call(*args):
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    return call


@cached_outside_compile
def _parsed(text: str) -> tuple[Dim, ...]:
    """The dims of a spec's text, read once per text: specs are written once and read by every layer's
    exchanges, on the hot path."""
    return tuple(_parse_token(token, text) for token in _split_tokens(text))


def _split_tokens(text: str) -> list[str]:
    """Split on spaces, but keep ``@(a, b)`` groups whole."""
    tokens, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char.isspace() and depth == 0:
            if current:
                tokens.append(current)
            current = ""
        else:
            current += char
    if current:
        tokens.append(current)
    return tokens


@dataclass(frozen=True)
class Spec:
    """The placement of one tensor: one :class:`Dim` per tensor dimension."""

    dims: tuple[Dim, ...]

    def __init__(self, text: str | Spec | tuple[Dim, ...]):
        if isinstance(text, Spec):
            dims = text.dims
        elif isinstance(text, tuple):
            dims = text
        else:
            dims = _parsed(text)
        object.__setattr__(self, "dims", dims)
        self._check_unique()

    def _check_unique(self) -> None:
        names = [d.name for d in self.dims]
        for name in names:
            if names.count(name) > 1:
                raise SpecError(f"spec {self}: dimension name {name!r} appears twice")
        seen: dict[str, str] = {}
        for dim in self.dims:
            for axis in dim.axes:
                if axis in seen:
                    raise SpecError(
                        f"spec {self}: mesh axis {axis!r} is used by dimension {seen[axis]!r} "
                        f"and {dim.name!r}; "
                        "an axis can split one dimension only"
                    )
                seen[axis] = dim.name

    def __str__(self) -> str:
        return " ".join(str(d) for d in self.dims)

    def __repr__(self) -> str:
        return f"Spec({str(self)!r})"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec splits over."""
        return tuple(a for d in self.dims for a in d.axes)

    def dim_of(self, name: str) -> int:
        """The index of the dimension called ``name``."""
        if name not in self.names:
            raise SpecError(f"spec {self} has no dimension {name!r}")
        return self.names.index(name)

    def sharded_dim(self, axis: str) -> int | None:
        """The index of the dimension split over ``axis``, or None when it is replicated over it."""
        for index, dim in enumerate(self.dims):
            if axis in dim.axes:
                return index
        return None

    def unsharded(self, axis: str) -> Spec:
        """This spec with ``axis`` taken off every dimension (replicated over it). A dimension still split
        keeps its order; one split over nothing is whole, in its own order."""
        return Spec(tuple(_with_axes(d, tuple(a for a in d.axes if a != axis)) for d in self.dims))

    def ordered(self, axis: str, order: str) -> Spec:
        """This spec with the dimension split over ``axis`` held in ``order`` (unchanged if none is)."""
        return Spec(tuple(Dim(d.name, d.axes, order if d.axes == (axis,) else d.order) for d in self.dims))

    def sharded(self, name: str, axis: str) -> Spec:
        """This spec with dimension ``name`` also split over ``axis`` (as its minor-most axis)."""
        index = self.dim_of(name)
        return Spec(
            tuple(_with_axes(d, d.axes + (axis,)) if i == index else d for i, d in enumerate(self.dims))
        )

    def renamed(self, axis: str, to: str) -> Spec:
        """This spec with mesh axis ``axis`` called ``to`` (orders kept)."""
        return Spec(
            tuple(Dim(d.name, tuple(to if a == axis else a for a in d.axes), d.order) for d in self.dims)
        )


def _with_axes(dim: Dim, axes: tuple[str, ...]) -> Dim:
    """``dim`` split over ``axes`` instead, in the same order of positions: an order other than contiguous
    needs exactly one axis, so it is kept over one, dropped over none (the whole dimension, gathered in
    its own order), and refused over more."""
    if dim.order == "contiguous" or len(axes) == 1:
        return Dim(dim.name, axes, dim.order)
    if not axes:
        return Dim(dim.name)
    raise SpecError(
        f"dimension {dim} is held in {dim.order} order, which a split over {', '.join(axes)} cannot keep; "
        "move it to contiguous chunks first"
    )
