"""Every rank runs the same cp forward on the same weights: checked on a cp forward's first call.

cp computes each rank's tokens with that rank's weights and sums the gradients, and every rank runs the
collectives its own options choose. Weights that differ across ranks (a model built without one seed on
every rank) would give a loss and gradients of no one model, without a word; options that differ (Ulysses
on one rank, ring on another) would have the ranks wait in different collectives. The batch is checked on
every call (:func:`cpshard.runtime.batch.check_batch`); what a cp forward was made with, the model's
parameters (names, shapes, dtypes, placements), its config (a ``rope_theta`` differing across ranks shapes no
parameter) and the weights it first runs on are checked on its first call (and on each call until its
layout's probe has passed), by one all-gather of seven numbers over the whole mesh, before any other
collective of the call (the weights' digest from bit patterns summed as integers: no order of summation or
thread count changes it), and a second only to name what differs: a digest per parameter, or each rank's
options or config as text. Later calls run on what an update made of these weights, the
same on every rank.
"""

from __future__ import annotations

import hashlib
import json
import zlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from cpshard.comm.collectives import all_gather_rows
from cpshard.comm.consensus import differing_ranks, gather_checked, gather_texts, items_text, what_differs
from cpshard.comm.record import serving
from cpshard.parallel.mesh import group_over
from cpshard.runtime.batch import failed_elsewhere

#: elements summed at a time: a sum widens its input into a copy first, so the copy stays small
_CHUNK = 1 << 22
#: the integer type of each element width, whose bit patterns the digest sums
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MODULUS = (1 << 63) - 1
#: the agreement row's mark of a rank whose own checks failed (a crc32 is never negative)
_FAILED = -1


def parameter_digest(tensor) -> list[int]:
    """Three integers that differ when a plain tensor's values differ: the sums of its elements' bit
    patterns over all of it, over its first half and over every 7th element (integer sums, so exact in any
    order, on any device and thread count); zeros for a DTensor, whose local shards differ across ranks by
    design."""
    if isinstance(tensor, DTensor):
        return [0, 0, 0]
    bits = tensor.detach().reshape(-1).view(_BITS[tensor.element_size()])
    parts = (bits, bits[: bits.numel() // 2], bits[::7])
    return [
        sum(int(block.sum(dtype=torch.int64)) for block in part.split(_CHUNK)) % _MODULUS for part in parts
    ]


def placement(tensor) -> tuple | None:
    """How a parameter is placed, alike on every rank that passes the same kind of params: a DTensor's mesh
    axes and placements over them; None for a plain tensor."""
    if not isinstance(tensor, DTensor):
        return None
    return tensor.device_mesh.mesh_dim_names, tuple(str(p) for p in tensor.placements)


def _hashed(text: str) -> int:
    """A 56-bit hash of ``text`` (an int64 row's entry, never negative)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")


def config_text(config) -> str:
    """The config's fields that differ from its class's defaults, one per line (:func:`items_text`), as
    ``save_pretrained`` would write them: what the model is beside its parameters (a ``rope_theta`` or a
    window differing across ranks changes the model without changing a parameter's shape); a field JSON
    cannot write (a custom config's object) by its repr."""
    try:
        return items_text(json.loads(config.to_json_string(use_diff=True)))
    except (TypeError, ValueError):
        return items_text(config.to_diff_dict())


def _each(ranks: list[int], values: torch.Tensor) -> str:
    """``values`` (one per rank of ``ranks``) as "rank 0: 21, rank 1: 30"."""
    return ", ".join(f"rank {rank}: {value}" for rank, value in zip(ranks, values.tolist()))


def _row(parts: dict[str, list[int]]) -> tuple[torch.Tensor, dict[str, slice]]:
    """The agreement row, ``parts``' integers one after another, and each part's columns in it."""
    columns, start = {}, 0
    for name, values in parts.items():
        columns[name] = slice(start, start + len(values))
        start += len(values)
    return torch.tensor([value for values in parts.values() for value in values]), columns


def check_agreement(
    description: str,
    aliases: list[tuple[str, ...]],
    params: dict,
    mesh,
    failed: Exception | None = None,
    config: str = "",
) -> None:
    """Raise on every rank unless every rank of ``mesh`` made its cp forward as ``description`` says (its
    layout and options, one per line: :func:`~cpshard.comm.consensus.items_text`), of a model of the same
    parameters (names, shapes, dtypes, DTensor placements), and holds the same values of them in ``params``
    (each under one of its ``aliases``: :func:`cpshard.runtime.plan.parameter_aliases`), built from the same
    ``config``
    (:func:`config_text`; empty: not checked). ``failed``: this rank's own checks of
    the model and ``params`` raised it; the all-gather carries the failure, so that every rank raises (this
    one its own error) and none waits in the next collective for it. One all-gather of a row of the same
    length on every rank, whatever its model; a second only to name what differs: a digest per parameter,
    or each rank's description or config (the items that differ)."""
    group = group_over(mesh, tuple(mesh.mesh_dim_names or ()))
    if group is None:
        if failed is not None:
            raise failed
        return
    names = [next(name for name in names if name in params) for names in aliases] if failed is None else []
    digests = [value for name in names for value in parameter_digest(params[name])]
    kinds = [(alias, tuple(params[name].shape), params[name].dtype) for alias, name in zip(aliases, names)]
    structure = _hashed(repr(kinds))
    placed = [placement(params[name]) for name in names]
    placements = [sum(where is not None for where in placed), _hashed(repr(placed))]
    row, columns = _row(
        {
            "made": [zlib.crc32(description.encode())],
            "built": [len(aliases), structure],
            "configured": [_hashed(config)],
            "placed": placements,
            "values": [_hashed(repr(digests))],
        }
    )
    with serving("other"):
        every, failing = gather_checked(row, group, "cp forward agreement", failed, _FAILED)
    if failing:
        raise failed_elsewhere(failing)
    ranks = dist.get_process_group_ranks(group)
    seen = {part: every[:, where] for part, where in columns.items()}
    made_otherwise = differing_ranks(seen["made"], ranks)
    if made_otherwise:
        with serving("other"):
            texts = gather_texts(description, group, "cp forward options")
        made = what_differs(texts, ranks, made_otherwise[0])
        raise ValueError(
            f"the cp forward differs across the mesh: ranks {made_otherwise} made it with another layout or "
            f"other options than rank {ranks[0]} ({made}); every rank makes the same cp forward (each "
            "rank's options choose the collectives it waits in)"
        )
    built_otherwise = differing_ranks(seen["built"], ranks)
    if built_otherwise:
        raise ValueError(
            f"the model differs across the mesh: ranks {built_otherwise} built a model whose parameters "
            f"differ in name, shape or dtype from rank {ranks[0]}'s (parameters: "
            f"{_each(ranks, seen['built'][:, 0])}); every rank builds the same model from the same config, "
            "in the same dtype"
        )
    configured_otherwise = differing_ranks(seen["configured"], ranks)
    if configured_otherwise:
        with serving("other"):
            texts = gather_texts(config, group, "model configs")
        raise ValueError(
            f"the model's config differs across the mesh: ranks {configured_otherwise} built the model from "
            f"another config than rank {ranks[0]}'s ({what_differs(texts, ranks, configured_otherwise[0])}); "
            "every rank builds the same model from the same config"
        )
    placed_otherwise = differing_ranks(seen["placed"], ranks)
    if placed_otherwise:
        raise ValueError(
            f"the params are placed otherwise across the mesh: ranks {placed_otherwise} pass parameters "
            f"placed otherwise than rank {ranks[0]}'s (DTensors among them: "
            f"{_each(ranks, seen['placed'][:, 0])}); every rank passes the same kind of params: plain ones "
            "on every rank, or "
            "cpshard.params_of(cpshard.parallelize(model, mesh)) on every rank"
        )
    if differing_ranks(seen["values"], ranks):
        with serving("other"):
            weights = all_gather_rows(torch.tensor(digests, dtype=torch.int64), group, "cp forward weights")
        weights = weights.reshape(len(ranks), len(names), -1)
        holders = {i: found for i in range(len(names)) if (found := differing_ranks(weights[:, i], ranks))}
        raise ValueError(
            f"the parameters differ across the mesh: ranks {sorted(set().union(*holders.values()))} hold "
            f"other values than rank {ranks[0]} for {len(holders)} of them (e.g. "
            f"{[names[i] for i in list(holders)[:3]]}). cp computes each rank's tokens with its own weights "
            "and sums the gradients, so every rank holds the same ones: build the model after "
            "torch.manual_seed with one seed on every rank, load the same checkpoint, or broadcast rank 0's"
        )
