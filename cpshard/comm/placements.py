"""Specs on a mesh: whether a tensor's shape fits a spec there, and the spec's DTensor placements.

A :class:`~cpshard.spec.notation.Spec` is a bare value, as JAX's ``PartitionSpec`` is; what it means on
a particular mesh (and torch.distributed's placement types) lives here, beside the moves between specs.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from cpshard.spec.notation import Spec, SpecError
from cpshard.spec.sequence import chunks_per_rank


def _mesh_axes(spec: Spec, mesh, tensor: str) -> tuple[str, ...]:
    """The mesh's axis names, once every axis of this spec is checked against them."""
    names = tuple(mesh.mesh_dim_names or ())
    for index, dim in enumerate(spec.dims):
        for axis in dim.axes:
            if axis not in names:
                raise SpecError(
                    f"{tensor}: dimension {index} ({dim.name}) is split over mesh axis {axis!r}, "
                    f"which the mesh does not have (its axes: {', '.join(names) or 'none'})"
                )
        if list(dim.axes) != sorted(dim.axes, key=names.index):
            # DTensor nests the shards of one dimension in mesh order: another order has no placements
            raise SpecError(
                f"{tensor}: dimension {index} ({dim.name}) is split over {dim} "
                "with its axes major first, "
                f"but the mesh orders them {', '.join(a for a in names if a in dim.axes)}; "
                "list them in mesh order"
            )
    return names


def check_fits(spec: Spec, shape, mesh, tensor: str = "tensor") -> None:
    """Raise a :class:`SpecError` naming ``tensor``, dim and axis where ``shape`` or ``mesh`` do not fit
    ``spec``."""
    if len(shape) != len(spec.dims):
        raise SpecError(
            f"{tensor}: spec {spec} has {len(spec.dims)} dimensions, the tensor has shape {tuple(shape)}"
        )
    names = _mesh_axes(spec, mesh, tensor)
    for index, dim in enumerate(spec.dims):
        ways = 1
        for axis in dim.axes:
            ways *= mesh.size(names.index(axis))
        per_rank = chunks_per_rank(dim.order, shape[index], ways)
        ways *= per_rank
        if shape[index] % ways:
            chunks = "" if dim.order == "contiguous" else f", {dim.order}: {per_rank} chunks a rank"
            raise SpecError(
                f"{tensor}: dimension {index} ({dim.name}) has size {shape[index]}, which mesh axes "
                f"{'x'.join(dim.axes)} (size {ways}{chunks}) do not divide evenly"
            )


def dtensor_placements(spec: Spec, mesh, tensor: str = "tensor") -> tuple:
    """The DTensor placements of ``spec`` on ``mesh`` (one per mesh dimension)."""
    names = _mesh_axes(spec, mesh, tensor)
    for index, dim in enumerate(spec.dims):
        if dim.order != "contiguous":
            raise SpecError(
                f"{tensor}: dimension {index} ({dim}) is held in {dim.order} order, which no DTensor "
                "placement expresses; move it to contiguous chunks first"
            )
    result = []
    for axis in names:
        index = spec.sharded_dim(axis)
        result.append(Replicate() if index is None else Shard(index))
    return tuple(result)
