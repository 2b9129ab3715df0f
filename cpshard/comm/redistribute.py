"""Moves between specs: which collective each needs, and running it.

The choice is a pure function of the two specs (:func:`plan`): a dimension split over an
axis moving to another dimension is one all-to-all; replicated to split is a local slice
with no communication; an unchanged axis is nothing at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.comm.exchange import all_to_all, all_to_all_together
from cpshard.spec.notation import Dim, Spec, SpecError, cached_outside_compile
from cpshard.spec.sequence import chunks_per_rank, positions


@dataclass(frozen=True)
class Move:
    """What one mesh axis needs to go from one spec to another."""

    axis: str
    kind: str  # "slice" or "all_to_all"
    src_dim: int | None
    dst_dim: int


def plan(src: Spec | str, dst: Spec | str) -> tuple[Move, ...]:
    """The moves, one per mesh axis whose placement differs between ``src`` and ``dst`` (worked out once per
    pair: every layer's exchanges ask again).

    Each move makes its axis the minor-most of the dimension it splits, and an all-to-all can
    only take back the minor-most axis of a dimension; moves run in the order of ``dst``'s axes.
    """
    return _moves(Spec(src), Spec(dst))


@cached_outside_compile
def _moves(src: Spec, dst: Spec) -> tuple[Move, ...]:
    if src.names != dst.names:
        raise SpecError(f"cannot move {src} to {dst}: the dimensions differ ({src.names} vs {dst.names})")
    current = [list(dim.axes) for dim in src.dims]
    moves = []
    for axis in dict.fromkeys(dst.axes + src.axes):
        before, after = src.sharded_dim(axis), dst.sharded_dim(axis)
        if before == after and before is not None and src.dims[before].order != dst.dims[after].order:
            raise SpecError(
                f"cannot move {src} to {dst}: changing the order of {src.names[before]!r} over {axis!r} is a "
                "token exchange (cpshard.comm.reorder), not a redistribution"
            )
        if before == after:
            continue
        if after is None:
            raise SpecError(
                f"cannot move {src} to {dst}: un-splitting {src.names[before]!r} over {axis!r} "
                "would gather the whole tensor on every rank, which the hot path never does"
            )
        if before is not None and current[before][-1] != axis:
            raise SpecError(
                f"cannot move {src} to {dst}: {axis!r} is not the minor-most axis of {src.names[before]!r}"
            )
        if before is not None:
            current[before].pop()
        current[after].append(axis)
        moves.append(Move(axis, "slice" if before is None else "all_to_all", before, after))
    if [tuple(axes) for axes in current] != [dim.axes for dim in dst.dims]:
        raise SpecError(
            f"cannot move {src} to {dst}: one move per axis cannot reorder the axes of a dimension"
        )
    return tuple(moves)


def redistribute(
    x: torch.Tensor, src: Spec | str, dst: Spec | str, mesh, name: str = "", donate: bool = False
) -> torch.Tensor:
    """``x``, the local part of a tensor placed as ``src`` on ``mesh``, placed as ``dst``. Differentiable.
    ``donate``: the caller reads ``x`` no more, and an all-to-all's result may take its storage
    (:func:`cpshard.comm.exchange.all_to_all`)."""

    def exchange(xs, scatter_dim, gather_dim, group):
        return (all_to_all(xs[0], scatter_dim, gather_dim, group, name=name, donate=donate),)

    return _moved((x,), Spec(src), Spec(dst), mesh, name, exchange)[0]


def redistribute_together(
    xs: tuple[torch.Tensor, ...], src: Spec | str, dst: Spec | str, mesh, name: str = ""
) -> tuple[torch.Tensor, ...]:
    """:func:`redistribute` of several tensors placed alike (Ulysses' q, k and v), each all-to-all one
    collective for all of them (:func:`cpshard.comm.exchange.all_to_all_together`)."""

    def exchange(xs, scatter_dim, gather_dim, group):
        return all_to_all_together(xs, scatter_dim, gather_dim, group, name=name)

    return _moved(tuple(xs), Spec(src), Spec(dst), mesh, name, exchange)


def _moved(xs: tuple, src: Spec, dst: Spec, mesh, name: str, exchange) -> tuple:
    """``xs`` through the moves from ``src`` to ``dst``: ``exchange(xs, scatter_dim, gather_dim, group)``
    for an all-to-all, a slice of each for a replicated dimension."""
    tensor = name or "tensor"
    for x in xs:
        if x.dim() != len(src.dims):
            raise SpecError(
                f"{tensor}: spec {src} has {len(src.dims)} dimensions, "
                f"the local tensor has shape {tuple(x.shape)}"
            )
    for move in plan(src, dst):
        if move.kind == "all_to_all":
            xs = exchange(xs, move.dst_dim, move.src_dim, mesh.get_group(move.axis))
        else:
            xs = tuple(_slice(x, dst.dims[move.dst_dim], move, mesh, tensor) for x in xs)
    return xs


def axis_size(mesh, axis: str) -> int:
    """The size of mesh dimension ``axis``, without building its sub-mesh (``mesh[axis]`` makes a new
    DeviceMesh every time: hundreds of microseconds, several times a layer)."""
    return mesh.size(mesh.mesh_dim_names.index(axis))


def _slice(x: torch.Tensor, dim: Dim, move: Move, mesh, tensor: str) -> torch.Tensor:
    """This rank's part of a replicated dimension: a view for contiguous chunks, a gather of
    positions otherwise."""
    ways, size = axis_size(mesh, move.axis), x.shape[move.dst_dim]
    pieces = ways * chunks_per_rank(dim.order, size, ways)
    if size % pieces:
        raise SpecError(
            f"{tensor}: dimension {move.dst_dim} ({dim.name}) has local size {size}, "
            f"which does not split into {pieces} equal chunks "
            f"over mesh axis {move.axis!r} (size {ways})"
        )
    rank = mesh.get_local_rank(move.axis)
    if dim.order == "contiguous":
        return x.narrow(move.dst_dim, rank * (size // ways), size // ways)
    return x.index_select(move.dst_dim, positions(dim.order, size, ways, rank).to(x.device))
