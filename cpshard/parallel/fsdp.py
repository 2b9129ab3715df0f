"""``parallelize``: FSDP2's parameter layout over ``fsdp x cp`` (HSDP across ``dp_replicate``), the
layout's tensor-parallel plan over ``tp`` and its experts over ``ep``, run explicitly.

Where each parameter lives is :mod:`cpshard.parallel.placement`'s job. ``fully_shard``'s own module hooks
are not installed: they all-gather the module's own parameters and so ignore those that
``torch.func.functional_call`` passes (and its lazy initialisation breaks on them). Instead
``cp_forward`` gathers the FSDP shards itself, one recorded all-gather per (mesh, dtype), whose
backward reduce-scatters the gradients back to the shards; tp and ep blocks stay where they are.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from cpshard.comm.collectives import all_gather_shards, sum_grads_over_group
from cpshard.comm.record import serving
from cpshard.layouts.layout import Layout
from cpshard.layouts.registry import resolve_layout
from cpshard.parallel.experts import check_expert_parallel
from cpshard.parallel.mesh import MESH_AXES, expert_degree, mesh_size
from cpshard.parallel.placement import Placed, placed, placement_problem, style_of
from cpshard.parallel.tensor import check_tensor_parallel


def check_mesh(mesh: DeviceMesh) -> None:
    """A root mesh of :func:`cpshard.make_mesh`, which :func:`parallelize` can serve."""
    names = mesh.mesh_dim_names or ()
    missing = [name for name in MESH_AXES if name not in names]
    if missing:
        raise ValueError(
            f"parallelize needs the root mesh of cpshard.make_mesh; this mesh has dimensions "
            f"{', '.join(names) or 'unnamed'} and lacks {', '.join(missing)}"
        )


def placements_of(params: dict, layout: Layout | None, mesh: DeviceMesh) -> dict[str, Placed]:
    """Where :func:`parallelize` puts each of ``params`` (no layout: all FSDP alone); a clear error for
    what cannot be laid out so."""
    styles = {name: style_of(name, layout) for name in params}
    where = {name: placed(style, mesh) for name, style in styles.items()}
    problems = [
        placement_problem(name, tuple(p.shape), styles[name], where[name]) for name, p in params.items()
    ]
    problems = [p for p in problems if p]
    if problems:
        raise ValueError(f"parallelize cannot lay out these parameters on this mesh: {'; '.join(problems)}")
    return where


def parallelize(model: nn.Module, mesh: DeviceMesh, layout: Layout | str = "auto") -> nn.Module:
    """Shard every parameter of ``model`` over ``mesh`` as the layout says; in place, and returned.

    Each rank keeps its own piece of the weights it holds (no communication), so every rank must
    hold the same weights, as for ``fully_shard``. Tied weights stay tied. Afterwards run the model
    through ``cp_forward`` (its own forward would mix DTensor weights with plain inputs)."""
    check_mesh(mesh)
    if max(mesh_size(mesh, "tp"), expert_degree(mesh)) > 1:  # only then does the layout's plan matter
        layout = resolve_layout(model, layout)
        check_tensor_parallel(model, layout, mesh_size(mesh, "tp"))
        check_expert_parallel(model, layout, expert_degree(mesh), mesh_size(mesh, "tp"))
    else:
        layout = None
    named = dict(model.named_parameters())
    for name, param in named.items():
        if isinstance(param, DTensor):
            raise ValueError(
                f"parallelize: {name} is a DTensor already; "
                "parallelize a model once, before any other sharding"
            )
        if param.dim() == 0:
            raise ValueError(f"parallelize: {name} is a scalar; FSDP shards dim 0 and it has none")
    where = placements_of(named, layout, mesh)
    sharded: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if id(param) not in sharded:
                path = f"{module_name}.{name}" if module_name else name
                value = distribute_tensor(
                    param.detach(), where[path].mesh, where[path].placements, src_data_rank=None
                )
                sharded[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            setattr(module, name, sharded[id(param)])
    return model


def block_shape(param: DTensor) -> torch.Size:
    """The shape of what gathering ``param``'s FSDP shards gives: the whole of it, but for what the
    other axes split (dim 0 over tp for column-wise layers or over ep for experts, dim 1 over tp for
    row-wise)."""
    shape, fsdp = list(param.shape), gather_axis(param)
    for i, placement in enumerate(param.placements):
        if i != fsdp and isinstance(placement, Shard):
            shape[placement.dim] //= param.device_mesh.size(i)
    return torch.Size(shape)


def gather_axis(param: DTensor, name: str = "") -> int:
    """The one mesh axis a parameter's FSDP shards are spread over, on dim 0; a clear error for any
    other layout."""
    on_dim0 = [
        i for i, p in enumerate(param.placements) if getattr(p, "dim", None) == 0
    ]  # Shard(0), _StridedShard(0)
    if not on_dim0:
        raise ValueError(
            f"parameter {name or 'of shape ' + str(tuple(param.shape))!r} "
            f"has placements {tuple(param.placements)}; cpshard gathers parameters split "
            "on dim 0 over one mesh axis, as cpshard.parallelize lays them out"
        )
    return on_dim0[0]


@serving("fsdp")
def full_tensors(params: dict[str, DTensor], name: str = "parameters") -> dict[str, torch.Tensor]:
    """Each DTensor gathered over its first dim-0 axis (the FSDP one): whole, or this rank's tp/ep block.
    One all-gather per (mesh, axis, dtype), differentiable (the gradients come back reduce-scattered)."""
    buckets: dict[tuple, list[str]] = {}
    for key, param in params.items():
        buckets.setdefault((param.device_mesh, gather_axis(param, key), param.dtype), []).append(key)
    whole: dict[str, torch.Tensor] = {}
    for (mesh, axis, _), keys in buckets.items():
        shards = [params[key].to_local() for key in keys]
        rows = [block_shape(params[key])[0] for key in keys]
        whole.update(zip(keys, all_gather_shards(shards, rows, mesh.get_group(axis), name, reached=True)))
    return {key: whole[key] for key in params}


def gather_params(params: dict, mesh: DeviceMesh, layout: Layout) -> dict:
    """``params`` with every DTensor gathered for the functional call (the tp/ep block this rank
    computes with); plain tensors as they are.

    DTensors must be laid out as :func:`parallelize` lays them out for ``mesh``, so that the
    gather's reduce-scatter sums their gradients over exactly the ranks that hold other tokens."""
    sharded = {name: value for name, value in params.items() if isinstance(value, DTensor)}
    if not sharded:
        return params
    check_mesh(mesh)
    where = placements_of(sharded, layout, mesh)
    for name, value in sharded.items():
        target = where[name]
        if value.device_mesh != target.mesh or tuple(value.placements) != target.placements:
            raise ValueError(
                f"parameter {name!r} is laid out over mesh dims {value.device_mesh.mesh_dim_names} of sizes "
                f"{tuple(value.device_mesh.shape)} with placements {tuple(value.placements)}; "
                f"on this mesh cp_forward (layout {layout.name!r}) takes plain tensors or the layout "
                "cpshard.parallelize(model, mesh) gives: dims "
                f"{target.mesh.mesh_dim_names} of sizes {tuple(target.mesh.shape)} with placements "
                f"{target.placements} (a model parallelized with a layout= of its own takes the same layout= "
                "in make_cp_forward)"
            )
    whole = full_tensors(sharded)
    if (
        mesh_size(mesh, "tp") > 1
    ):  # weights applied to this tp rank's heads alone: their gradients sum over tp
        tp_group = mesh.get_group("tp")
        with serving("tp"):
            for name in (n for n in whole if style_of(n, layout) == "per_head"):
                whole[name] = sum_grads_over_group(whole[name], tp_group, f"tp {name}")
    return {**params, **whole}
