"""Where each parameter lives under :func:`cpshard.parallelize`: its mesh and its placements.

Every parameter is split FSDP2-style on dim 0 over ``fsdp x cp`` flattened (``fsdp_cp``: the
ranks of a cp group share one sharding, so each token's gradient is counted once) and
replicated over ``dp_replicate`` (HSDP). Inside that, the layout's plan may split it further:

- ``colwise`` (tensor parallel, q/k/v/gate/up): dim 0 over ``tp``; the FSDP split then acts on
  this rank's tp block, which DTensor writes ``_StridedShard(0, split_factor=tp)``, as FSDP2 does;
- ``rowwise`` (o/down): dim 1 over ``tp``, dim 0 over ``fsdp_cp``;
- ``per_head`` (Qwen3's and Gemma3's q/k norms): placed as ``shard``, replicated over ``tp``; each
  tp rank applies it to its own heads, so :func:`cpshard.parallel.fsdp.gather_params` sums its gradient;
- a LoRA adapter on a ``colwise`` or ``rowwise`` layer: its parts as :mod:`cpshard.parallel.adapters`
  styles them (the wrapped layer as the layer, one adapter matrix split with it, the other ``per_head``);
- ``expert`` (MoE experts): dim 0 over ``ep``, the ranks of ``fsdp x cp`` regrouped as
  ``(efsdp, ep)`` with ep innermost, and the FSDP split over ``efsdp`` on this rank's experts.

Gathering over the FSDP axis alone (``fsdp_cp`` or ``efsdp``) then gives each rank the tp or
ep block its forward computes with.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from cpshard.layouts.layout import Layout
from cpshard.parallel.adapters import style_in_plan
from cpshard.parallel.mesh import expert_degree, mesh_size


@cache
def _regroup(mesh: DeviceMesh, sizes: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """The root mesh's ranks (row-major) regrouped as ``sizes`` named ``names``: DeviceMesh's own
    flatten and unflatten. Cached: creating process groups is collective and slow."""
    if len(sizes) == 1:
        return mesh._flatten(names[0])
    return mesh._flatten("_".join(names))._unflatten(0, sizes, names)


def _mesh_of(mesh: DeviceMesh, dims: dict[str, int], shard_axis: str) -> DeviceMesh:
    """The regrouped mesh without its trivial dims (the FSDP axis is kept even at size 1)."""
    kept = {name: size for name, size in dims.items() if size > 1 or name == shard_axis}
    return _regroup(mesh, tuple(kept.values()), tuple(kept))


def param_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``(dp_replicate,) fsdp_cp (, tp)``: the mesh of every parameter but experts."""
    sizes = {name: mesh_size(mesh, name) for name in ("dp_replicate", "fsdp", "cp", "tp")}
    dims = {"dp_replicate": sizes["dp_replicate"], "fsdp_cp": sizes["fsdp"] * sizes["cp"], "tp": sizes["tp"]}
    return _mesh_of(mesh, dims, "fsdp_cp")


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``(dp_replicate,) efsdp, ep``: the ranks of ``fsdp x cp x tp`` in groups of ``ep`` consecutive
    ranks."""
    ep = expert_degree(mesh)
    rest = mesh_size(mesh, "fsdp") * mesh_size(mesh, "cp") * mesh_size(mesh, "tp") // ep
    return _mesh_of(mesh, {"dp_replicate": mesh_size(mesh, "dp_replicate"), "efsdp": rest, "ep": ep}, "efsdp")


@dataclass(frozen=True)
class Placed:
    """One parameter's mesh and placements, and the mesh axis its FSDP shards are gathered over."""

    mesh: DeviceMesh
    placements: tuple
    gather_axis: int

    @property
    def inner_split(self) -> int:
        """How many ways dim 0 is split besides the FSDP axis (tp for colwise, ep for experts): the split
        factor of the FSDP axis's strided shard."""
        shard = self.placements[self.gather_axis]
        return shard.split_factor if isinstance(shard, _StridedShard) else 1


def style_of(name: str, layout: Layout | None) -> str:
    """The layout's style for the parameter ``name`` (a ``params_of`` key), "shard" when it names none."""
    if layout is None:
        return "shard"
    match = re.match(rf"^{re.escape(layout.decoder_layers)}\.\d+\.(.+)\.[^.]+$", name)
    if match is None:
        return "shard"
    module = match.group(1)
    if module in layout.experts:
        return "expert"
    return style_in_plan(module, layout.tensor_parallel) or "shard"


def placed(style: str, mesh: DeviceMesh) -> Placed:
    """Where a parameter of ``style`` lives on the root ``mesh`` (styles without their axis act as
    "shard")."""
    if style == "expert" and expert_degree(mesh) > 1:
        target = expert_mesh(mesh)
        names, ep = target.mesh_dim_names, expert_degree(mesh)
        inner = {"efsdp": _StridedShard(0, split_factor=ep), "ep": Shard(0)}
        return Placed(target, tuple(inner.get(n, Replicate()) for n in names), names.index("efsdp"))
    target = param_mesh(mesh)
    names, tp = target.mesh_dim_names, mesh_size(mesh, "tp")
    by_style = {
        "colwise": {"fsdp_cp": _StridedShard(0, split_factor=tp), "tp": Shard(0)},
        "rowwise": {"fsdp_cp": Shard(0), "tp": Shard(1)},
    }
    inner = by_style.get(style, {"fsdp_cp": Shard(0)}) if tp > 1 else {"fsdp_cp": Shard(0)}
    return Placed(target, tuple(inner.get(n, Replicate()) for n in names), names.index("fsdp_cp"))


def placement_problem(name: str, shape: tuple, style: str, where: Placed) -> str | None:
    """Why a parameter of ``shape`` cannot be laid out so, or None: tp and ep splits must be even."""
    names = where.mesh.mesh_dim_names
    fsdp = where.mesh.size(where.gather_axis)
    if style == "rowwise" and "tp" in names:
        tp = where.mesh.size(names.index("tp"))
        if len(shape) < 2:
            return (
                f"{name} is a bias of a row-wise layer (shape {shape}); "
                "cpshard's tensor parallelism takes none"
            )
        if shape[1] % tp:
            return f"{name} has {shape[1]} columns, which tp={tp} does not divide"
    if where.inner_split > 1:
        rows, split = shape[0], where.inner_split
        if rows % split or (rows // split) % fsdp:
            return (
                f"{name} has {rows} rows on dim 0; split {split} ways ({style}) and then {fsdp} ways over "
                f"{names[where.gather_axis]} they must divide evenly: choose sizes that divide {rows}"
            )
    return None
