"""The KV cache of generation under cp: split over the cp ranks by sequence, never whole on one rank.

Per layer, each rank holds the keys and values of some token indices (columns of the batch) in ascending
order, and every rank knows which rank holds each index (``owners``: one integer per index, the same on
every rank), so all ranks take the same placement decisions without communicating:

- after the prefill a rank holds the tokens of its own sequence shard (cp's padding dropped);
- a sliding-window layer keeps only the indices some later query may still see (as transformers'
  ``DynamicSlidingWindowLayer`` keeps its last ``window - 1``), spread evenly over the ranks once, after
  the prefill;
- each decoded token goes to the rank that holds the fewest of the layer's tokens (the lowest on a tie),
  and a sliding-window layer then drops what has left every row's window.

So a rank holds at most ``ceil(n / cp)`` of a layer's ``n`` tokens, plus what its prefill shard held
beyond that (contiguous order: nothing; head-tail: at most one token). A sliding window of a
right-padded batch can drop several tokens in one step (its rows' windows end apart), and then the
balance is within the tokens dropped at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from cpshard.comm.reorder import reorder


@dataclass(frozen=True)
class LayerShard:
    """One layer's cache on this rank."""

    #: ``[B, Hkv, n, D]``: this rank's ``n`` tokens, in ascending index
    keys: torch.Tensor
    values: torch.Tensor
    #: ``[T]``: the rank that holds each index, -1 where none does (cp padding, left the window)
    owners: torch.Tensor
    #: the sliding window (a query sees keys less than ``window`` positions back), None for full attention
    window: int | None


@dataclass(frozen=True)
class ShardedKVCache:
    """Every layer's :class:`LayerShard` and what all ranks know alike: each index's mask and position."""

    layers: tuple[LayerShard, ...]
    #: ``[B, T]``: 1 for a real token, 0 for padding
    attention_mask: torch.Tensor
    #: ``[B, T]``: rotary positions, each row's real tokens counted from 0
    position_ids: torch.Tensor
    rank: int
    size: int
    #: a hybrid model's recurrent states by slot path, whole and the same on every rank: each delta rule's
    #: ``[B, H, dk, dv]`` state and each convolution's last ``kernel - 1`` inputs (fixed sizes, not split)
    recurrent: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.attention_mask.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values on this rank."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.keys, layer.values))

    def extended(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention_mask, position_ids)`` with one more index: a real token at each row's next position
        (the count of its real tokens so far, as transformers' generate continues a left-padded row)."""
        mask = torch.nn.functional.pad(self.attention_mask, (0, 1), value=1)
        positions = torch.cat([self.position_ids, self.attention_mask.sum(1, keepdim=True)], dim=1)
        return mask, positions


def held_by(owners: torch.Tensor, rank: int) -> torch.Tensor:
    """The indices ``rank`` holds, ascending."""
    return (owners == rank).nonzero().flatten()


def least_filled(owners: torch.Tensor, size: int) -> int:
    """The rank holding the fewest indices (the lowest of those on a tie): where the next token goes."""
    return int(torch.bincount(owners[owners >= 0], minlength=size).argmin())


def visible(mask, positions, query_positions, window: int | None, indices: torch.Tensor) -> torch.Tensor:
    """``[B, n]``: which of the keys at ``indices`` each row's query (at ``query_positions``) may see:
    real tokens, and within the window (position above the query's minus the window, as transformers'
    sliding-window mask; counted in positions, so that a right-padded row's window skips its padding)."""
    seen = mask[:, indices].bool()
    if window is not None:
        seen = seen & (positions[:, indices] > query_positions[:, None] - window)
    return seen


def still_needed(mask, positions, next_positions, window: int | None) -> torch.Tensor:
    """``[T]``, on the CPU beside the cache's owners: the indices a query of some row at ``next_positions`` or
    later may still see."""
    every = torch.arange(mask.shape[1])
    return visible(mask, positions, next_positions, window, every).any(0).cpu()


def appended(layer: LayerShard, key: torch.Tensor, value: torch.Tensor, rank: int, size: int) -> LayerShard:
    """``layer`` with one more index, held by the least filled rank (``key``, ``value``:
    ``[B, Hkv, 1, D]``)."""
    owner = least_filled(layer.owners, size)
    owners = torch.cat([layer.owners, layer.owners.new_tensor([owner])])
    if owner != rank:
        return replace(layer, owners=owners)
    keys, values = (torch.cat([old, new], dim=2) for old, new in ((layer.keys, key), (layer.values, value)))
    return LayerShard(keys, values, owners, layer.window)


def trimmed(layer: LayerShard, needed: torch.Tensor, rank: int) -> LayerShard:
    """``layer`` without the indices no query needs any more (``needed``: ``[T]``)."""
    if bool(needed[layer.owners >= 0].all()):
        return layer
    local = needed[held_by(layer.owners, rank)]
    owners = layer.owners.masked_fill(~needed, -1)
    return LayerShard(layer.keys[:, :, local], layer.values[:, :, local], owners, layer.window)


def _spread(layer: LayerShard, group, name: str) -> LayerShard:
    """A layer's indices moved so that each rank holds an even share, consecutive indices together (one
    all-to-all with uneven splits; nothing moves when the shares are even already)."""
    size = dist.get_world_size(group)
    src = [held_by(layer.owners, r) for r in range(size)]
    dst = list(torch.tensor_split(layer.owners.ge(0).nonzero().flatten(), size))
    if max(len(s) for s in src) - min(len(s) for s in src) <= 1:
        return layer
    owners = layer.owners.clone()
    for r, indices in enumerate(dst):
        owners[indices] = r
    moved = reorder(torch.stack([layer.keys, layer.values]), 3, src, dst, group, name)
    return LayerShard(moved[0], moved[1], owners, layer.window)


def prefill_cache(captured: list, held: list[torch.Tensor], mask, positions, group, names: list[str]):
    """The cache a prefill leaves: ``captured[l]`` is layer ``l``'s ``(keys, values, window)`` on this rank,
    at the positions ``held[rank]`` (every rank's, ascending; those past the prompt are cp padding)."""
    size, rank, length = dist.get_world_size(group), dist.get_rank(group), mask.shape[1]
    owners = torch.full((length,), -1, dtype=torch.long)
    for r, indices in enumerate(held):
        owners[indices[indices < length]] = r
    real = held[rank] < length
    layers = []
    for (keys, values, window), name in zip(captured, names, strict=True):
        layer = LayerShard(keys[:, :, real], values[:, :, real], owners, window)
        if window is not None:
            layer = trimmed(layer, still_needed(mask, positions, mask.sum(1), window), rank)
            layer = _spread(layer, group, f"{name} window")
        layers.append(layer)
    return ShardedKVCache(tuple(layers), mask, positions, rank, size)
