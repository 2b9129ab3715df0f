"""``typeof``: a tensor's dtype, global shape and placement in one JAX-style string.

``f32[2, 4096@cp, 64]``: dim 1 is split over mesh axis ``cp``; ``4096@(fsdp,cp)`` is split over
two axes, major first (the order DTensor applies them); ``Partial(sum)@tp`` after the brackets is
a sum still pending over ``tp`` (several pending axes read ``Partial(sum)@(fsdp,tp)``). A plain
tensor has no ``@``. A pytree gives one aligned line per leaf, named by its path.
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict

import optree
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Partial

from cpshard.debug.table import table

_DTYPE = re.compile(r"^(bfloat|float|uint|int|complex)(\d+)(.*)$")
_SHORT = {"bfloat": "bf", "float": "f", "uint": "u", "int": "i", "complex": "c"}


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype as JAX writes it: ``f32``, ``bf16``, ``i64``, ``f8_e4m3fn``; others by torch's name."""
    name = str(dtype).removeprefix("torch.")
    match = _DTYPE.match(name)
    return f"{_SHORT[match[1]]}{match[2]}{match[3]}" if match else name


def mesh_axis_names(mesh) -> tuple[str, ...]:
    """The mesh's dimension names, or their indices where it has none."""
    return tuple(mesh.mesh_dim_names or (str(i) for i in range(mesh.ndim)))


def _at(axes: list[str]) -> str:
    return f"@{axes[0]}" if len(axes) == 1 else f"@({','.join(axes)})"


def _shard_order(spec: DTensorSpec) -> dict[int, list[int]]:
    """Tensor dim -> the mesh dims splitting it, major first (DTensor may apply them out of mesh order)."""
    order = getattr(spec, "shard_order", None)
    if order is None and hasattr(DTensorSpec, "_maybe_convert_StridedShard_to_shard_order"):
        order = DTensorSpec._maybe_convert_StridedShard_to_shard_order(spec.placements, spec.mesh)
    if order is not None:
        return {entry.tensor_dim: list(entry.mesh_dims) for entry in order}
    split: dict[int, list[int]] = {}
    for mesh_dim, placement in enumerate(spec.placements):  # torch without shard orders: mesh order
        if isinstance(getattr(placement, "dim", None), int):
            split.setdefault(placement.dim, []).append(mesh_dim)
    return split


def placement_dims(x: DTensor) -> tuple[list[list[str]], dict[str, list[str]]]:
    """Per tensor dim the mesh axes splitting it (major first); per pending reduction (``Partial(sum)``)
    the axes it is pending over."""
    names = mesh_axis_names(x.device_mesh)
    split = [[] for _ in range(x.dim())]
    for dim, mesh_dims in _shard_order(x._spec).items():
        split[dim] = [names[m] for m in mesh_dims]
    splitting = {name for axes in split for name in axes}
    pending: dict[str, list[str]] = {}
    for name, placement in zip(names, x.placements):
        if isinstance(placement, Partial):
            pending.setdefault(f"Partial({placement.reduce_op})", []).append(name)
        elif name not in splitting and not placement.is_replicate():  # a placement this view does not know
            pending.setdefault(type(placement).__name__, []).append(name)
    return split, pending


def tensor_type(x: torch.Tensor) -> str:
    """The one-line type of a tensor or DTensor."""
    if not isinstance(x, DTensor):
        return f"{dtype_name(x.dtype)}[{', '.join(str(n) for n in x.shape)}]"
    split, pending = placement_dims(x)
    dims = ", ".join(f"{n}{_at(axes) if axes else ''}" for n, axes in zip(x.shape, split))
    partial = "".join(f" {label}{_at(axes)}" for label, axes in pending.items())
    return f"{dtype_name(x.dtype)}[{dims}]{partial}"


def _leaf_type(leaf) -> str:
    if leaf is None:
        return "None"
    return tensor_type(leaf) if isinstance(leaf, torch.Tensor) else type(leaf).__name__


def _path(keys: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys).lstrip(".") or "(root)"


def typeof(x) -> str:
    """``f32[2, 4096@cp, 64]`` for a tensor; for a pytree (dicts, lists, tuples, a dataclass such as
    ``CPOutput``), an aligned table of each leaf's path and type."""
    if isinstance(x, torch.Tensor):
        return tensor_type(x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = OrderedDict(
            (field.name, getattr(x, field.name)) for field in dataclasses.fields(x)
        )  # field order
    paths, leaves, _ = optree.tree_flatten_with_path(x, none_is_leaf=True)
    if paths == [()]:  # a lone leaf that is no tensor
        return _leaf_type(x)
    return table([(_path(path), _leaf_type(leaf)) for path, leaf in zip(paths, leaves)])
