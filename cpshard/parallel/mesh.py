"""Meshes: the root mesh with named axes, the axes' groups named once, and the groups the forward reduces
over. (A mesh *axis* is a dimension of the mesh; a *dim* is a tensor's.)"""

from __future__ import annotations

import os
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from cpshard.comm.collectives import sum_over_group
from cpshard.comm.record import serving

#: the root mesh's axes, outermost first
MESH_AXES = ("dp_replicate", "fsdp", "cp", "tp")
#: the axes whose ranks hold different tokens: losses, token counts and gradients sum over them
TOKEN_AXES = ("dp_replicate", "fsdp", "cp")
#: the axes whose ranks hold other batches, in the order their coordinates number the dp groups
DATA_AXES = ("dp_replicate", "fsdp")
#: the axes whose ranks take the same batch: a dp group is one ``cp x tp`` sub-mesh
SAME_BATCH_AXES = ("cp", "tp")
#: parameters are split over ``fsdp x cp``, flattened, and replicated over these (their ranks: other batches)
REPLICA_AXES = ("dp_replicate",)


def _init_default_group(device_type: str) -> None:
    """Initialize the default group from the launcher's environment (torchrun), unless one exists."""
    if dist.is_initialized():
        return
    missing = [
        name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"no process group is initialized and {', '.join(missing)} are not set: start under torchrun, "
            "use cpshard.launch, or call torch.distributed.init_process_group first"
        )
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")


def make_mesh(
    *,
    cp: int,
    dp_replicate: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    ep: int = 1,
    device_type=None,
    timeout: float | timedelta | None = None,
) -> DeviceMesh:
    """The root mesh ``dp_replicate x fsdp x cp x tp`` over every rank of the default group.

    ``timeout`` (seconds): how long a collective of the mesh's groups waits for a rank that does not
    arrive before the waiting ranks raise a :class:`~cpshard.comm.arrival.CollectiveError` naming it; None:
    torch's default (30 minutes for gloo, 10 for nccl).

    ``ep`` regroups the ranks of ``fsdp x cp x tp`` (row-major) into expert groups of ``ep``
    consecutive ranks (whole tp groups, or part of one); it is recorded with the mesh
    (:func:`expert_degree`), whose sub-meshes :mod:`cpshard.parallel.placement` builds with
    DeviceMesh's flatten and unflatten."""
    sizes = {"dp_replicate": dp_replicate, "fsdp": fsdp, "cp": cp, "tp": tp}
    for name, size in {**sizes, "ep": ep}.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh: {name}={size!r} must be a positive integer")
    if timeout is not None and not isinstance(timeout, timedelta):
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ValueError(f"make_mesh: timeout={timeout!r} must be positive seconds or a timedelta")
        timeout = timedelta(seconds=timeout)
    if (fsdp * cp * tp) % ep:
        raise ValueError(
            f"make_mesh: ep={ep} must divide fsdp * cp * tp = {fsdp} * {cp} * {tp} = {fsdp * cp * tp}"
        )
    if ep > 1 and tp > 1 and ep % tp and tp % ep:
        raise ValueError(
            f"make_mesh: ep={ep} with tp={tp}: an ep group (consecutive ranks, tp innermost) must hold whole "
            "tp groups (ep a multiple of tp) or lie inside one (ep divides tp), so that the tp ranks' shares "
            "of their tokens meet at the same experts"
        )
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    _init_default_group(device_type)
    world = dist.get_world_size()
    product = dp_replicate * fsdp * cp * tp
    if world != product:
        raise ValueError(
            f"world size {world} != dp_replicate={dp_replicate} * fsdp={fsdp} * cp={cp} * tp={tp}"
            f" (= {product}); choose sizes whose product is the number of ranks"
        )
    return _root_mesh(device_type, tuple(sizes.values()), ep, dist.group.WORLD, timeout)


#: the expert degree of each root mesh, by id (root meshes live as long as the cache below)
_EXPERT_DEGREE: dict[int, int] = {}


@cache
def _root_mesh(
    device_type: str, shape: tuple[int, ...], ep: int, world, timeout: timedelta | None
) -> DeviceMesh:
    """One mesh per shape, expert degree, default group and timeout: every mesh creates a process group
    per dimension (each with its own threads), so a training loop or test suite calling make_mesh
    again must get the same mesh back, not a new set of groups."""
    override = None if timeout is None else {axis: _backend_with(device_type, timeout) for axis in MESH_AXES}
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES, backend_override=override)
    _EXPERT_DEGREE[id(mesh)] = ep
    return mesh


def _backend_with(device_type: str, timeout: timedelta) -> tuple:
    """The backend of ``device_type``'s groups (gloo on CPU, nccl on CUDA) with ``timeout``."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return backend, options


def expert_degree(mesh: DeviceMesh) -> int:
    """The ``ep`` that :func:`make_mesh` was given for this root mesh (1 for any other mesh)."""
    return _EXPERT_DEGREE.get(id(mesh), 1)


def mesh_size(mesh: DeviceMesh, name: str) -> int:
    """The size of the mesh axis ``name``; 1 when the mesh has no such axis."""
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(name)) if name in names else 1


def cp_size(mesh: DeviceMesh) -> int:
    """The size of the mesh's ``cp`` dimension; a clear error when it has none, or is no mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"the mesh is {type(mesh).__name__} {mesh!r}, not a DeviceMesh: build it with "
            "cpshard.make_mesh(cp=N)"
        )
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        raise ValueError(
            f"the mesh has no 'cp' dimension (its dimensions: {', '.join(names) or 'unnamed'}); "
            "build it with cpshard.make_mesh(cp=N)"
        )
    return mesh.size(names.index("cp"))


def cp_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the cp axis (0 where cp is 1)."""
    return mesh.get_local_rank("cp") if cp_size(mesh) > 1 else 0


def group_over(mesh: DeviceMesh, axes: tuple[str, ...]):
    """The process group of the ranks that differ only along ``axes`` (None when that is this rank alone)."""
    names = mesh.mesh_dim_names or ()
    wide = tuple(
        a for a in names if a in axes and mesh.size(names.index(a)) > 1
    )  # in mesh order, as slicing wants
    if not wide:
        return None
    if len(wide) == 1:
        return mesh.get_group(wide[0])
    return mesh[wide]._flatten("_".join(wide)).get_group()


def summed_over(value: torch.Tensor, mesh: DeviceMesh, axes: tuple[str, ...], name: str) -> torch.Tensor:
    """The sum of ``value`` over the ranks that differ along ``axes``, on every rank; each rank's gradient
    flows to its own term (a collective that serves none of the parallelisms by itself: "other")."""
    group = group_over(mesh, axes)
    if group is None:
        return value
    with serving("other"):
        return sum_over_group(value, group, name=name)


@cache
def cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh["cp"]``, made once per mesh (each slice builds a new DeviceMesh)."""
    return mesh["cp"]


@cache
def split_cp(mesh: DeviceMesh, ring: int, ulysses: int) -> DeviceMesh:
    """The ``cp`` axis as ``(cp_ring, cp_ulysses)``: Ulysses groups of consecutive cp ranks, rings across.

    Cached: creating process groups is collective and slow, and a mesh's split never changes."""
    return mesh["cp"]._unflatten(0, (ring, ulysses), ("cp_ring", "cp_ulysses"))
