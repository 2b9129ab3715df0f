"""``parallelize``: FSDP2's parameter layout over ``fsdp x cp`` (HSDP across ``dp_replicate``), run explicitly.

Parameters become DTensors laid out as ``fully_shard`` lays them out: dim 0 split over the ranks of
``fsdp x cp`` flattened (the ranks of a cp group hold the same sequences, so they share one
sharding), replicated over ``dp_replicate``. ``fully_shard``'s own module hooks are not installed:
they all-gather the module's own parameters and so ignore those that ``torch.func.functional_call``
passes (and its lazy initialisation breaks on them). Instead ``cp_forward`` gathers the shards itself,
one recorded all-gather per dtype, whose backward reduce-scatters the gradients back to the shards.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from cpshard.collectives import all_gather_shards

#: parameters are split over these, flattened: each token's gradient is counted once, on its own rank
SHARD_DIMS = ("fsdp", "cp")
#: and replicated over these (HSDP), whose ranks hold other batches: gradients sum over them
REPLICA_DIMS = ("dp_replicate",)
_SHARD_AXIS = "fsdp_cp"


def _size(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(name)) if name in names else 1


def check_mesh(mesh: DeviceMesh) -> None:
    """A root mesh of :func:`cpshard.make_mesh` whose parallelisms :func:`parallelize` can serve."""
    names = mesh.mesh_dim_names or ()
    missing = [name for name in (*REPLICA_DIMS, *SHARD_DIMS) if name not in names]
    if missing:
        raise ValueError(
            f"parallelize needs the root mesh of cpshard.make_mesh; this mesh has dimensions "
            f"{', '.join(names) or 'unnamed'} and lacks {', '.join(missing)}"
        )
    for name, what in (("tp", "tensor parallelism"), ("ep", "expert parallelism")):
        if _size(mesh, name) > 1:
            raise NotImplementedError(
                f"parallelize: {what} ({name}={_size(mesh, name)}) is not available yet; build the mesh with {name}=1"
            )


@lru_cache(maxsize=None)
def param_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``fsdp x cp`` flattened into one axis, ``fsdp_cp``; behind ``dp_replicate`` when that is wider than 1.

    Cached: creating process groups is collective and slow, and a mesh's layout never changes."""
    replicas = _size(mesh, "dp_replicate")
    if replicas == 1:
        return mesh[SHARD_DIMS]._flatten(_SHARD_AXIS)
    flat = mesh[(*REPLICA_DIMS, *SHARD_DIMS)]._flatten("_".join((*REPLICA_DIMS, *SHARD_DIMS)))
    return flat._unflatten(0, (replicas, flat.size() // replicas), (*REPLICA_DIMS, _SHARD_AXIS))


def param_placements(mesh: DeviceMesh) -> tuple:
    """Shard(0) over ``fsdp_cp``, replicated over ``dp_replicate`` where the parameter mesh has it."""
    return tuple(Shard(0) if name == _SHARD_AXIS else Replicate() for name in param_mesh(mesh).mesh_dim_names)


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard every parameter of ``model`` over ``mesh`` as FSDP2 (HSDP) would; in place, and returned.

    Each rank keeps its own chunk of the weights it holds (no communication), so every rank must
    hold the same weights, as for ``fully_shard``. Tied weights stay tied. Afterwards run the model
    through ``cp_forward`` (its own forward would mix DTensor weights with plain inputs)."""
    check_mesh(mesh)
    target, placements = param_mesh(mesh), param_placements(mesh)
    sharded: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            path = f"{module_name}.{name}" if module_name else name
            if isinstance(param, DTensor):
                raise ValueError(
                    f"parallelize: {path} is a DTensor already; parallelize a model once, before any other sharding"
                )
            if param.dim() == 0:
                raise ValueError(f"parallelize: {path} is a scalar; FSDP shards dim 0 and it has none")
            if id(param) not in sharded:
                value = distribute_tensor(param.detach(), target, placements, src_data_rank=None)
                sharded[id(param)] = nn.Parameter(value, requires_grad=param.requires_grad)
            setattr(module, name, sharded[id(param)])
    return model


def _shard_axis(name: str, param: DTensor) -> int:
    """The one mesh axis a parameter is split over, on dim 0; a clear error for any other layout."""
    shards = [i for i, p in enumerate(param.placements) if p != Replicate()]
    if len(shards) != 1 or param.placements[shards[0]] != Shard(0):
        raise ValueError(
            f"parameter {name!r} has placements {tuple(param.placements)}; cpshard gathers parameters split "
            "on dim 0 over one mesh axis and replicated over the others, as cpshard.parallelize lays them out"
        )
    return shards[0]


def full_tensors(params: dict[str, DTensor], name: str = "parameters") -> dict[str, torch.Tensor]:
    """Whole local tensors of dim-0 sharded DTensors: one all-gather per (mesh, axis, dtype), differentiable
    (the gradients come back reduce-scattered over that axis)."""
    buckets: dict[tuple, list[str]] = {}
    for key, param in params.items():
        buckets.setdefault((param.device_mesh, _shard_axis(key, param), param.dtype), []).append(key)
    whole: dict[str, torch.Tensor] = {}
    for (mesh, axis, _), keys in buckets.items():
        shards = [params[key].to_local() for key in keys]
        rows = [params[key].shape[0] for key in keys]
        whole.update(zip(keys, all_gather_shards(shards, rows, mesh.get_group(axis), name)))
    return {key: whole[key] for key in params}


def gather_params(params: dict, mesh: DeviceMesh) -> dict:
    """``params`` with every DTensor made whole for the functional call; plain tensors as they are.

    DTensors must be laid out as :func:`parallelize` lays them out for ``mesh``, so that the
    gather's reduce-scatter sums their gradients over exactly the ranks of ``fsdp x cp``."""
    sharded = {name: value for name, value in params.items() if isinstance(value, DTensor)}
    if not sharded:
        return params
    check_mesh(mesh)
    target, placements = param_mesh(mesh), param_placements(mesh)
    for name, value in sharded.items():
        if value.device_mesh != target or tuple(value.placements) != placements:
            raise ValueError(
                f"parameter {name!r} is laid out over mesh dims {value.device_mesh.mesh_dim_names} of sizes "
                f"{tuple(value.device_mesh.shape)} with placements {tuple(value.placements)}; on this mesh cp_forward takes "
                f"plain tensors or the layout cpshard.parallelize(model, mesh) gives: dims {target.mesh_dim_names} of "
                f"sizes {tuple(target.shape)} with placements {placements}"
            )
    return {**params, **full_tensors(sharded)}
