"""One decoded token's attention over a KV cache split over the cp ranks.

Every rank computes the new token's q, k and v alike (one token per row: nothing to split). The layer's
new k and v join the rank that :mod:`cpshard.attention.kv_cache` picks; each rank attends with the keys it
holds and the visible ones only (padding, the sliding window); one all-gather brings every rank's partial
output and log-sum-exp, and every rank merges them in rank order (the ring's merge), so the result is
exact and the same, bit for bit, on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import reduce

import torch

from cpshard.attention.kv_cache import ShardedKVCache, appended, held_by, still_needed, trimmed, visible
from cpshard.attention.ring import NEG_INF, Block, Scoring, block_attention, grouped, merge
from cpshard.comm.collectives import all_gather_rows


@dataclass
class DecodeStep:
    """What the attention function needs to decode one token at each layer; each layer leaves its
    new shard in ``shards``."""

    cache: ShardedKVCache
    #: ``[B, T + 1]``: the cache's mask and positions with the new token's
    mask: torch.Tensor
    positions: torch.Tensor
    #: the cache's layer number and the path of each attention module, by ``id(module)``
    layer_of: Mapping[int, int]
    names: Mapping[int, str]
    group: object
    shards: dict = field(default_factory=dict)
    #: the recurrent layers' carried states by slot path (:mod:`cpshard.recurrent.slots`), and the new ones
    states: Mapping[str, torch.Tensor] = field(default_factory=dict)
    new_states: dict = field(default_factory=dict)


def partial_attention(query, keys, values, seen, scale: float, softcap: float | None):
    """One rank's share: ``query`` ``[B, Hq, 1, D]`` over the keys it holds (``seen``: ``[B, n]``) as
    ``(output [B, Hkv, G, 1, D], lse [B, Hkv, G, 1])`` in fp32; no key at all is output 0, lse -inf."""
    qg = grouped(query.float(), keys.shape[1])
    if keys.shape[2] == 0:
        return torch.zeros_like(qg), torch.full(qg.shape[:-1], NEG_INF, device=qg.device)
    return block_attention(Block(qg, keys, values, seen[:, None, None, :], Scoring(scale, softcap)))


def merged(parts: torch.Tensor):
    """Every rank's ``[output | lse]`` (stacked on dim 0) merged in rank order: ``(output, lse)``."""
    pairs = [(part[..., :-1], part[..., -1]) for part in parts]
    return reduce(lambda a, b: merge(*a, *b), pairs)


def decode_attention(step: DecodeStep, module, query, key, value, scale: float, softcap, window):
    """The new token's attention output ``[B, 1, Hq, D]`` at ``module``'s layer, as the model's attention
    function returns it; the layer's cache grown (and for a sliding window, trimmed) into ``step.shards``."""
    cache, number = step.cache, step.layer_of[id(module)]
    layer = cache.layers[number]
    if window != layer.window:
        raise ValueError(
            f"{step.names[id(module)]}: decoding with sliding_window={window} over a cache prefilled "
            f"with {layer.window}; prefill and decode must run the same model"
        )
    layer = appended(layer, key, value, cache.rank, cache.size)
    query_positions = step.positions[:, -1]
    seen = visible(step.mask, step.positions, query_positions, window, held_by(layer.owners, cache.rank))
    output, lse = partial_attention(query, layer.keys, layer.values, seen, scale, softcap)
    parts = all_gather_rows(
        torch.cat([output, lse.unsqueeze(-1)], dim=-1), step.group, name=f"{step.names[id(module)]} decode"
    )
    output, _ = merged(parts)
    if window is not None:
        layer = trimmed(
            layer, still_needed(step.mask, step.positions, query_positions + 1, window), cache.rank
        )
    step.shards[number] = layer
    return output.reshape(query.shape).transpose(1, 2).to(query.dtype)
