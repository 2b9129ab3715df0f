"""One decoded token's attention over a KV cache split over the cp ranks.

Every rank computes the new token's q, k and v alike (one token per row: nothing to split). The layer's
new k and v join the rank that :mod:`cpshard.attention.kv_cache` picks; each rank attends with the keys it
holds and the visible ones only (padding, the sliding window); one all-gather brings every rank's partial
output and log-sum-exp, and every rank merges them in rank order (the ring's merge), so the result is
exact and the same, bit for bit, on every rank. A module's sink logit per query (Inkling2's ``sinks``: one
more score with a zero value) joins the merged result once, on every rank alike, never once per rank.

A module that attends more than once per forward (Inkling2-Loop's looped layers, once per pass) has a cache
layer per pass: its first in its own layer's place, each later one after every layer's own, in the order the
forward attends (as the model's own cache appends a copy of the looped layers per later pass). The prefill
(:func:`sink_keys`) and the decode step (:func:`layer_number`) count them alike.
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

    @property
    def own_layers(self) -> int:
        """How many cache layers are the model's layers' own (the rest: later passes of looped layers)."""
        return max(self.layer_of.values(), default=-1) + 1


def sink_keys(sink: dict, module, captured: tuple) -> None:
    """Leave a prefill's ``captured`` keys and values of ``module`` in ``sink``: by ``id(module)`` the first
    time it attends in the forward, by ``(id(module), n)`` the ``n``-th time after (in the order they
    come)."""
    key, again = id(module), 0
    while key in sink:
        again += 1
        key = (id(module), again)
    sink[key] = captured


def layer_number(step: DecodeStep, module) -> int:
    """The cache layer that ``module`` attends over now: its layer's own the first time in this step, the
    next layer after the model's layers' own each later time (as :func:`sink_keys` placed them)."""
    number = step.layer_of[id(module)]
    if number in step.shards:
        number = step.own_layers + sum(taken >= step.own_layers for taken in step.shards)
        if number >= len(step.cache.layers):
            raise ValueError(
                f"{step.names[id(module)]} attended again in one decode step beyond the prefill's "
                f"{len(step.cache.layers)} cache layers; prefill and decode must run the same model"
            )
    return number


def partial_attention(query, keys, values, seen, scale: float, softcap: float | None, bias=None):
    """One rank's share: ``query`` ``[B, Hq, 1, D]`` over the keys it holds (``seen``: ``[B, n]``; ``bias``:
    ``[B, Hq, 1, n]`` added to their scores, or None) as ``(output [B, Hkv, G, 1, D], lse [B, Hkv, G, 1])`` in
    fp32; no key at all is output 0, lse -inf."""
    kv_heads = keys.shape[1]
    qg = grouped(query.float(), kv_heads)
    if keys.shape[2] == 0:
        return torch.zeros_like(qg), torch.full(qg.shape[:-1], NEG_INF, device=qg.device)
    bias = None if bias is None else grouped(bias.float(), kv_heads)
    return block_attention(Block(qg, keys, values, seen[:, None, None, :], Scoring(scale, softcap), bias))


def merged(parts: torch.Tensor):
    """Every rank's ``[output | lse]`` (stacked on dim 0) merged in rank order: ``(output, lse)``."""
    pairs = [(part[..., :-1], part[..., -1]) for part in parts]
    return reduce(lambda a, b: merge(*a, *b), pairs)


def with_sinks(output: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The merged ``output`` ``[B, Hkv, G, 1, D]`` (its log-sum-exp ``lse``) with one more score per query of
    zero value, ``sinks`` ``[B, Hq, 1, 1]`` (None: as it is), as the model's eager attention appends it to
    the scores: merged once after every rank's part, so it counts once."""
    if sinks is None:
        return output
    if sinks.dim() != 4 or sinks.shape[-2:] != (1, 1):
        raise ValueError(
            f"sinks of shape {tuple(sinks.shape)} in a decode step; cp's decode merges one sink logit per "
            "head and query, [B, H, 1, 1], no other"
        )
    logit = grouped(sinks.float(), lse.shape[1])[..., 0]
    return merge(output, lse, torch.zeros_like(output), logit)[0]


def decode_attention(
    step: DecodeStep, module, query, key, value, scale: float, softcap, window, bias=None, sinks=None
):
    """The new token's attention output ``[B, 1, Hq, D]`` at ``module``'s layer, as the model's attention
    function returns it; the layer's cache grown (and for a sliding window, trimmed) into ``step.shards``.
    ``bias``: what the model adds to the new token's scores over every index, ``[B, Hq, 1, T + 1]``
    (Inkling's relative position bias, as its attention hands it to the attention function), or None;
    ``sinks``: a sink logit per head and query ``[B, Hq, 1, 1]`` (Inkling2's), or None."""
    cache, number = step.cache, layer_number(step, module)
    layer = cache.layers[number]
    if window != layer.window:
        raise ValueError(
            f"{step.names[id(module)]}: decoding with sliding_window={window} over a cache prefilled "
            f"with {layer.window}; prefill and decode must run the same model"
        )
    layer = appended(layer, key, value, cache.rank, cache.size)
    query_positions, held = step.positions[:, -1], held_by(layer.owners, cache.rank)
    seen = visible(step.mask, step.positions, query_positions, window, held)
    if bias is not None:  # over every index: the columns of the keys this rank holds
        if bias.shape[-1] != layer.owners.numel():
            raise ValueError(
                f"{step.names[id(module)]}: a score bias over {bias.shape[-1]} keys, the cache holds "
                f"{layer.owners.numel()} indices with the new token"
            )
        bias = bias[..., held]
    output, lse = partial_attention(query, layer.keys, layer.values, seen, scale, softcap, bias)
    parts = all_gather_rows(
        torch.cat([output, lse.unsqueeze(-1)], dim=-1), step.group, name=f"{step.names[id(module)]} decode"
    )
    output = with_sinks(*merged(parts), sinks)
    if window is not None:
        layer = trimmed(
            layer, still_needed(step.mask, step.positions, query_positions + 1, window), cache.rank
        )
    step.shards[number] = layer
    return output.reshape(query.shape).transpose(1, 2).to(query.dtype)
