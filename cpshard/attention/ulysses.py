"""Ulysses: sequence-split q, k and v become whole sequences over a share of the heads (one all-to-all
for the three), the model's own attention function runs on them under the model's own whole-sequence mask, and
one all-to-all brings the output back. The head checks, the exchanges (also Ulysses' half of hybrid, over
a part of cp), the per-head masks and parameters, and the function over checkpointed blocks of queries
(``make_cp_forward(attention_block_bytes=...)``, or sdpa where its float mask would be large); the
dispatch and the ring's glue stay in :mod:`cpshard.attention.cp_attention`.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from cpshard.comm.record import expect
from cpshard.comm.redistribute import axis_size, redistribute, redistribute_together
from cpshard.interfaces import SeenAs
from cpshard.precision import autocast_inputs
from cpshard.spec.masks import additive_mask


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
    query, key, value = redistribute_together((query, key, value), seq_split, head_split, mesh, f"{path} qkv")
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


def sequences_for_heads(output, layout, mesh, axis: str, path: str, donate: bool = False):
    """Ulysses' second half: the head-split output goes back to sequence-split, contiguous as
    transformers' attention functions give it (Afmoe's and Dory's ``view`` of it fails on the all-to-all's
    strides at cp 4); into the output's own storage where ``donate`` says nothing else holds it."""
    specs = (spec.renamed("cp", axis) for spec in layout.attn_output)
    return redistribute(output, *specs, mesh, name=f"{path} out", donate=donate).contiguous()


#: above this many bytes, sdpa's float mask is built per block of queries, never whole (see attend_in_blocks);
#: below, one whole float mask per call serves every layer
MASK_BLOCK_BYTES = 1 << 26


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


def _attend_rows(function, module, query, key, value, mask, kwargs: dict, part: slice, sdpa: bool):
    """``function`` on the queries ``part`` of the whole sequence (their rows of the mask and of what comes
    per query), each row as the function computes it whole; sdpa's boolean mask becomes floats here, one
    block at a time (see :func:`_sdpa_mask`)."""
    if mask is not None:
        mask = mask[..., part, :] if mask.shape[-2] > 1 else mask  # one row broadcast over the queries: all
        mask = _sdpa_mask(mask, query.dtype, kwargs) if sdpa and mask.dtype == torch.bool else mask
    return function(module, query, key, value, mask, **_rows(kwargs, part))[0]


def _as_now(module):
    """``module`` with the parameters and buffers it holds itself (what an attention function may read:
    a temperature, a sink) as they are now: a block's recompute runs in the backward, after
    ``functional_call`` has put the module's own parameters back, and must read the call's."""
    names = [name for name, _ in module.named_parameters(recurse=False)]
    names += [name for name, _ in module.named_buffers(recurse=False)]
    return SeenAs(module, **{name: getattr(module, name) for name in names}) if names else module


def attend_in_blocks(sdpa: bool, function, module, query, key, value, mask, rows: int, **kwargs):
    """``function`` over blocks of ``rows`` queries of the whole sequence, each under activation
    checkpointing: autograd keeps q, k and v and nothing of a block (no scores, no float mask, not the
    function's output), and the backward recomputes one block at a time, at the price of one more
    forward of the attention. Exact: the softmax is per query row."""
    module = _as_now(module)
    parts = [slice(start, min(start + rows, query.shape[2])) for start in range(0, query.shape[2], rows)]
    queries = query.split(rows, dim=2)  # one split: q's gradient is made once, not once a block
    blocks = [
        checkpoint(
            _attend_rows, function, module, q, key, value, mask, kwargs, part, sdpa, use_reentrant=False
        )
        for part, q in zip(parts, queries)
    ]
    return (blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)), None  # cat copies even one


def block_rows(inner: str, query, key, mask, budget: int) -> int:
    """How many queries a block holds so that its scores (every head of every row of the batch, over
    every key) take at most ``budget`` bytes (at least one query), counted in fp32 at the least: eager
    softmaxes half-precision scores in fp32. sdpa without a mask holds no scores (its kernel works in
    tiles) and aligns a causal block of fewer queries than keys at the first key, not the last: one block."""
    if inner == "sdpa" and mask is None:
        return query.shape[2]
    per_query = query.shape[0] * query.shape[1] * key.shape[2] * max(query.element_size(), 4)
    return max(1, budget // per_query)


#: the inner functions whose blocks of queries cpshard computes as they compute the whole
BLOCKED = ("sdpa", "eager")


def check_blocked(inner: str, mask, path: str, function=None) -> None:
    """Raise unless blocks of queries serve ``inner`` under ``mask``: sdpa and eager, a mask that is a
    tensor (its rows are the block's) or none, and a ``function`` that hides later keys where the mask
    says, not by its scores' shape (XLM's and OpenAI GPT's eager: a block's queries taken for the last)."""
    if inner not in BLOCKED or not (mask is None or isinstance(mask, torch.Tensor)):
        raise ValueError(
            f"{path}: attention_block_bytes runs {' and '.join(BLOCKED)} attention a block of queries at a "
            f"time; this model uses {inner!r} attention with a mask of type {type(mask).__name__}: make the "
            "cp forward without attention_block_bytes, or set the model's attention to sdpa"
        )
    if getattr(function, "causal_by_shape", False):
        raise ValueError(
            f"{path}: attention_block_bytes runs attention a block of queries at a time, and this model's "
            "attention hides later keys by the shape of its scores (its queries the last of its keys), which "
            "a block of queries does not keep: make the cp forward without attention_block_bytes"
        )


def causal(module, kwargs: dict) -> bool:
    """Whether attention without a mask is causal, as transformers' sdpa function decides it."""
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else bool(causal)


def ulysses_attention(inner: str, function, module, query, key, value, attention_mask, call, **kwargs):
    """Ulysses around ``function`` (the model's attention ``inner``): q, k, v from sequence-split to
    head-split whole sequences, the function under the model's whole-sequence mask (cut to this rank's
    heads, the cp padding's keys dropped), and the output back to sequence-split. The function runs whole,
    or in checkpointed blocks of queries (:func:`attend_in_blocks`) where the call asks for them
    (``attention_block_bytes``) or sdpa's float mask would be large."""
    path = call.name_of(module)
    if inner == "sdpa":  # under autocast sdpa casts q, k and v at its entry: the exchange then moves bf16
        query, key, value = autocast_inputs(query, key, value)
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
    rows = None
    budget = getattr(call, "attention_block_bytes", None)  # a compiled layer's TracedCall has none
    if budget is not None:
        check_blocked(inner, attention_mask, path, function)
        rows = block_rows(inner, query, key, attention_mask, budget)
    elif inner == "sdpa" and boolean and attention_mask.numel() * query.element_size() > MASK_BLOCK_BYTES:
        row_bytes = attention_mask.shape[0] * attention_mask.shape[-1] * query.element_size()
        rows = max(1, MASK_BLOCK_BYTES // row_bytes)  # sdpa's float mask, never whole
    if rows is not None:
        output, weights = attend_in_blocks(
            inner == "sdpa", function, module, query, key, value, attention_mask, rows, **kwargs
        )
    else:
        if inner == "sdpa" and boolean and kwargs.get("position_bias") is None:  # see _sdpa_mask
            mask, dtype = attention_mask, query.dtype
            shared = ("additive mask", original, dtype)  # a tensor hashes by identity
            attention_mask = call.shared(shared, lambda: additive_mask(mask, dtype))
        output, weights = function(module, query, key, value, attention_mask, **kwargs)
    del query, key, value  # the exchanged copies go before the output's exchange, unless autograd keeps them
    # the blocks' output (their cat, or one block's checkpointed output) is saved by no backward: it donates
    donate = rows is not None
    return sequences_for_heads(output, call.layout, call.mesh, "cp", path, donate), weights
