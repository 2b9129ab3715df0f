"""Per-token tensors placed like the logits: ``[B, L, ...]`` DTensors split on the sequence over ``cp``.

Each rank holds contiguous chunks as DTensor's ``Shard(1)`` cuts them (ceil(L / cp) tokens each, the last
ranks fewer), so that labels, weights or advantages line up with ``CPOutput.logits`` and
``CPOutput.token_logprobs`` position for position, and DTensor arithmetic between them needs no communication.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from cpshard.parallel.mesh import cp_mesh, cp_rank, cp_size
from cpshard.spec.sequence import chunk_positions


def sequence_sharded(local: torch.Tensor, length: int, cp: DeviceMesh) -> DTensor:
    """This rank's chunk ``[B, <= ceil(L / cp), ...]`` of a ``[B, L, ...]`` tensor as the global DTensor on
    ``cp``, the mesh's cp axis."""
    shape = torch.Size((local.shape[0], length, *local.shape[2:]))
    stride = torch.empty(shape, device="meta").stride()  # the whole tensor's, contiguous
    return DTensor.from_local(local, cp, [Shard(1)], run_check=False, shape=shape, stride=stride)


def shard_like_logits(tensor: torch.Tensor, mesh) -> DTensor:
    """``tensor`` ``[B, L, ...]``, whole and the same on every rank of the cp group, as a DTensor placed like
    ``CPOutput.logits``: each rank keeps its own chunk of the sequence (no communication)."""
    if tensor.dim() < 2:
        raise ValueError(
            f"shard_like_logits takes a per-token tensor [B, L, ...]; got shape {list(tensor.shape)}"
        )
    cp = cp_size(mesh)
    held = chunk_positions(tensor.shape[1], cp, cp_rank(mesh))
    return sequence_sharded(tensor.index_select(1, held.to(tensor.device)), tensor.shape[1], cp_mesh(mesh))
