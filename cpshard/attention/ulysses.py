"""Ulysses: sequence-split q, k and v become whole sequences over a share of the heads (one all-to-all
each), the model's own attention function runs on them under the model's own whole-sequence mask, and
one all-to-all brings the output back. The head checks, the exchanges (also Ulysses' half of hybrid, over
a part of cp), the per-head masks and parameters, and sdpa over blocks of queries where its float mask
would be large; the dispatch and the ring's glue stay in :mod:`cpshard.attention.cp_attention`.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from cpshard.comm.record import expect
from cpshard.comm.redistribute import axis_size, redistribute
from cpshard.interfaces import SeenAs
from cpshard.spec.masks import additive_mask
from cpshard.spec.sequence import row_blocks


def check_heads_split(num_heads: int, cp: int) -> None:
    """Raise a ValueError saying which cp sizes work when Ulysses cannot split ``num_heads`` over ``cp``."""
    if num_heads % cp:
        raise ValueError(
            f"Ulysses splits heads over cp: num_attention_heads={num_heads} is not divisible by cp={cp}; "
            "cp sizes that work: "
            f"{', '.join(str(c) for c in range(1, num_heads + 1) if num_heads % c == 0)}; "
            "implementation='ring' or 'hybrid' serve any cp"
        )


def kv_replication(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated so that cp divides them and each rank's q heads find theirs."""
    check_heads_split(num_heads, cp)
    return cp // math.gcd(num_kv_heads, cp)


def without_padding_keys(key, value, attention_mask, length: int):
    """Drop the cp padding from the keys. Real queries never see it, but a row that sees no key at
    all (left padding) gets what the model's function gives over all keys (eager: their mean), which
    must be over the real sequence's keys only."""
    return key[:, :, :length], value[:, :, :length], attention_mask[..., :length]


def _local_heads(module, names: tuple[str, ...], heads: int, rank: int) -> dict:
    """The module's per-head parameters ``names``, cut to the ``heads`` heads of ``rank``."""
    return {name: getattr(module, name)[rank * heads : (rank + 1) * heads] for name in names}


def heads_for_sequences(module, query, key, value, kwargs: dict, layout, mesh, axis: str, path: str):
    """Ulysses' first half over ``axis``: sequence-split q, k, v become head-split whole sequences; the
    module (and any of ``kwargs`` that is one of its per-head parameters) shows this rank's heads."""
    replicas = kv_replication(query.shape[1], key.shape[1], axis_size(mesh, axis))
    if replicas > 1:
        key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
    seq_split, head_split = (spec.renamed("cp", axis) for spec in layout.qkv)
    query, key, value = (
        redistribute(x, seq_split, head_split, mesh, name=f"{path} {part}")
        for part, x in (("q", query), ("k", key), ("v", value))
    )
    if replicas > 1 or layout.per_head_params:
        names = tuple(n for n in layout.per_head_params if isinstance(getattr(module, n, None), torch.Tensor))
        per_head = _local_heads(module, names, query.shape[1], mesh.get_local_rank(axis))
        full = {id(getattr(module, name)): name for name in per_head}
        kwargs = {k: per_head[full[id(v)]] if id(v) in full else v for k, v in kwargs.items()}
        module = SeenAs(module, num_key_value_groups=query.shape[1] // key.shape[1], **per_head)
    return module, query, key, value, kwargs


#: what a module may pass per head and query of the rank beside q: the score bias per key
#: (``position_bias``, ``[b, h, s@cp, keys]``: Inkling's relative bias, its rows at the rank's positions)
#: and a sink logit per query (``sinks``, ``[b, h, s@cp, 1]``: Inkling2's)
PER_QUERY = ("position_bias", "sinks")


def bias_for_heads(query, kwargs: dict, layout, mesh, path: str) -> dict:
    """``kwargs`` with what a module passes per head and query (:data:`PER_QUERY`) moved as ``query``
    (``[b, h, s@cp, d]``) is: whole queries for this rank's heads, one all-to-all each way (declared for
    :func:`cpshard.debug.trace_comms` beside q, k, v and the output). Sinks of one entry per head (a
    parameter, not per query) are the layout's per-head parameters instead."""
    moved = {}
    for name in PER_QUERY:
        value = kwargs.get(name)
        if not isinstance(value, torch.Tensor) or name == "sinks" and value.dim() != 4:
            continue
        if value.dim() != 4 or value.shape[1:3] != query.shape[1:3]:
            raise ValueError(
                f"{path}: a {name} of shape {tuple(value.shape)} for queries {tuple(query.shape)}; cp moves "
                "one row per head and query of the rank (its keys the whole sequence's), no other"
            )
        moved[name] = redistribute(value, *layout.qkv, mesh, name=f"{path} {name}")
        for phase in ("forward", "backward") if value.requires_grad else ("forward",):
            expect(path, "all_to_all", phase, 1, value.numel() * value.element_size())
    return {**kwargs, **moved}


def _mask_heads(mask, heads: int, mesh, axis: str):
    """A mask with one slice per q head cut to this rank's ``heads``, as q was; others as they are."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] == 1:
        return mask
    if mask.shape[1] != heads * axis_size(mesh, axis):
        raise ValueError(f"a mask of {mask.shape[1]} heads for {heads * axis_size(mesh, axis)} q heads")
    start = mesh.get_local_rank(axis) * heads
    return mask[:, start : start + heads]


def sequences_for_heads(output, layout, mesh, axis: str, path: str):
    """Ulysses' second half: the head-split output goes back to sequence-split, contiguous as
    transformers' attention functions give it (Afmoe's and Dory's ``view`` of it fails on the all-to-all's
    strides at cp 4)."""
    specs = (spec.renamed("cp", axis) for spec in layout.attn_output)
    return redistribute(output, *specs, mesh, name=f"{path} out").contiguous()


#: above this many bytes, sdpa's float mask is built per block of queries, never whole (see _blocked_sdpa);
#: below, one whole float mask per call serves every layer
MASK_BLOCK_BYTES = 1 << 26


def _sdpa_rows(function, module, query, key, value, mask, kwargs):
    return function(module, query, key, value, _sdpa_mask(mask, query.dtype, kwargs), **kwargs)[0]


def _sdpa_mask(mask: torch.Tensor, dtype: torch.dtype, kwargs: dict) -> torch.Tensor:
    """The mask sdpa gets: additive floats (-inf where hidden), but boolean beside a score bias, which
    transformers' sdpa folds in with the dtype's minimum where hidden, as one process does (a row that
    sees no key then attends to every key alike, not to none)."""
    return mask if kwargs.get("position_bias") is not None else additive_mask(mask, dtype)


def _rows(kwargs: dict, part: slice) -> dict:
    """``kwargs`` for a block of query rows: what comes per query (:data:`PER_QUERY`) cut to them."""
    rows = {name: kwargs[name][:, :, part] for name in PER_QUERY if _per_query(kwargs.get(name))}
    return {**kwargs, **rows}


def _per_query(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 4


def _blocked_sdpa(function, module, query, key, value, mask, **kwargs):
    """sdpa over blocks of queries, each under activation checkpointing: the float form of the boolean
    ``B x L x L`` mask (4 bytes an entry, which sdpa would keep for the backward in every layer) exists
    one block of rows at a time, in the forward and again in the backward, at the price of computing
    each block's attention twice. Each query's row is computed as sdpa computes it whole."""
    row_bytes = mask.shape[0] * mask.shape[-1] * query.element_size()
    blocks = [
        checkpoint(
            _sdpa_rows,
            function,
            module,
            query[:, :, part],
            key,
            value,
            mask[..., part, :],
            _rows(kwargs, part),
            use_reentrant=False,
        )
        for part in row_blocks(query.shape[2], row_bytes, MASK_BLOCK_BYTES)
    ]
    return torch.cat(blocks, dim=1), None


def causal(module, kwargs: dict) -> bool:
    """Whether attention without a mask is causal, as transformers' sdpa function decides it."""
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else bool(causal)


def ulysses_attention(inner: str, function, module, query, key, value, attention_mask, call, **kwargs):
    """Ulysses around ``function`` (the model's attention ``inner``): q, k, v from sequence-split to
    head-split whole sequences, the function under the model's whole-sequence mask (cut to this rank's
    heads, the cp padding's keys dropped; a large boolean mask under sdpa a block of queries at a time),
    and the output back to sequence-split."""
    path = call.name_of(module)
    kwargs = bias_for_heads(query, kwargs, call.layout, call.mesh, path)
    module, query, key, value, kwargs = heads_for_sequences(
        module, query, key, value, kwargs, call.layout, call.mesh, "cp", path
    )
    attention_mask = _mask_heads(attention_mask, query.shape[1], call.mesh, "cp")
    boolean = isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
    if isinstance(attention_mask, torch.Tensor):
        original, length = attention_mask, call.key_length(attention_mask)
        key, value, attention_mask = without_padding_keys(key, value, attention_mask, length)
        if kwargs.get("position_bias") is not None:
            kwargs = {**kwargs, "position_bias": kwargs["position_bias"][..., :length]}
    elif not causal(module, kwargs):  # every query sees every key: the cp padding's too, unless cut
        length = getattr(call, "length", None)
        if length is None:
            raise ValueError(
                f"{path} attends in both directions without a mask; compile=True serves causal and masked "
                "attention only: make_cp_forward without compile"
            )
        key, value = key[:, :, :length], value[:, :, :length]
    if inner == "sdpa" and boolean and attention_mask.numel() * query.element_size() > MASK_BLOCK_BYTES:
        output, weights = _blocked_sdpa(function, module, query, key, value, attention_mask, **kwargs)
    else:
        if inner == "sdpa" and boolean and kwargs.get("position_bias") is None:  # see _sdpa_mask
            shared = ("additive mask", original, query.dtype)  # a tensor hashes by identity
            attention_mask = call.shared(shared, lambda: additive_mask(attention_mask, query.dtype))
        output, weights = function(module, query, key, value, attention_mask, **kwargs)
    return sequences_for_heads(output, call.layout, call.mesh, "cp", path), weights
