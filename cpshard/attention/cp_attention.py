"""Context-parallel attention, wrapped around the model's own attention function.

Registered in transformers' attention-function registry (and its mask registry, so the model
still builds its mask) under ``cpshard_<inner>``. Inside a cp call, q, k and v arrive split
over the sequence. Ulysses: one all-to-all each makes them whole sequences over a share of the
heads, the model's own function runs with the model's own whole-sequence mask, and one
all-to-all brings the output back. Ring (and hybrid, Ulysses inside groups first): k and v
travel the ring (:mod:`cpshard.attention.ring`) with per-block masks cut from that same mask. A prefill
also leaves each layer's k and v in the call's ``kv_sink``; a decode step attends over the split cache
(:mod:`cpshard.attention.decode`). Outside a cp call it is the inner function, untouched.
"""

from __future__ import annotations

import math
import sys
from functools import cache

import torch
from torch.utils.checkpoint import checkpoint
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpshard.attention.blocks import call_blocks, rows_without_keys
from cpshard.attention.decode import decode_attention
from cpshard.attention.ring import RingAttention
from cpshard.attention.traced_ring import traced_ring
from cpshard.call import TRACED_KEY, active_decode, current_call, split_call
from cpshard.comm.channel import TracedGroup
from cpshard.comm.redistribute import axis_size, redistribute
from cpshard.interfaces import SeenAs, register_once, register_wrapper
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import FORWARDS, eager_for, hides_scores
from cpshard.spec.masks import additive_mask
from cpshard.spec.notation import Dim, Spec
from cpshard.spec.sequence import row_blocks

PREFIX = "cpshard_"


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


@cache
def _model_eager(module_class: type):
    """The eager attention function of the modeling file that defines ``module_class`` (transformers'
    generic one for the families whose attention cpshard rewrites: their files have none)."""
    function = getattr(sys.modules[module_class.__module__], "eager_attention_forward", None)
    if function is None and module_class.__name__ in FORWARDS:
        function = eager_for(module_class)
    if function is None:
        raise ValueError(f"{module_class.__name__}: its modeling file has no eager_attention_forward to wrap")
    return function


def _inner_function(inner: str, module):
    return _model_eager(type(module)) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]


def _on_axis(spec: Spec, axis: str) -> Spec:
    """``spec`` with its ``cp`` axis called ``axis`` (hybrid runs Ulysses over a part of cp)."""
    return Spec(tuple(Dim(d.name, tuple(axis if a == "cp" else a for a in d.axes)) for d in spec.dims))


def _heads_for_sequences(module, query, key, value, kwargs: dict, layout, mesh, axis: str, path: str):
    """Ulysses' first half over ``axis``: sequence-split q, k, v become head-split whole sequences; the
    module (and any of ``kwargs`` that is one of its per-head parameters) shows this rank's heads."""
    replicas = kv_replication(query.shape[1], key.shape[1], axis_size(mesh, axis))
    if replicas > 1:
        key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
    seq_split, head_split = (_on_axis(spec, axis) for spec in layout.qkv)
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


def _mask_heads(mask, heads: int, mesh, axis: str):
    """A mask with one slice per q head cut to this rank's ``heads``, as q was; others as they are."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[1] == 1:
        return mask
    if mask.shape[1] != heads * axis_size(mesh, axis):
        raise ValueError(f"a mask of {mask.shape[1]} heads for {heads * axis_size(mesh, axis)} q heads")
    start = mesh.get_local_rank(axis) * heads
    return mask[:, start : start + heads]


def _sequences_for_heads(output, layout, mesh, axis: str, path: str):
    """Ulysses' second half: the head-split output goes back to sequence-split."""
    return redistribute(
        output, *(_on_axis(spec, axis) for spec in layout.attn_output), mesh, name=f"{path} out"
    )


#: above this many bytes, sdpa's float mask is built per block of queries, never whole (see _blocked_sdpa);
#: below, one whole float mask per call serves every layer
MASK_BLOCK_BYTES = 1 << 26


def _sdpa_rows(function, module, query, key, value, mask, kwargs):
    return function(module, query, key, value, additive_mask(mask, query.dtype), **kwargs)[0]


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
            kwargs,
            use_reentrant=False,
        )
        for part in row_blocks(query.shape[2], row_bytes, MASK_BLOCK_BYTES)
    ]
    return torch.cat(blocks, dim=1), None


def _causal(module, kwargs: dict) -> bool:
    """Whether attention without a mask is causal, as transformers' sdpa function decides it."""
    causal = kwargs.get("is_causal")
    return getattr(module, "is_causal", True) if causal is None else bool(causal)


def _ulysses_attention(inner: str, function, module, query, key, value, attention_mask, call, **kwargs):
    path = call.name_of(module)
    module, query, key, value, kwargs = _heads_for_sequences(
        module, query, key, value, kwargs, call.layout, call.mesh, "cp", path
    )
    attention_mask = _mask_heads(attention_mask, query.shape[1], call.mesh, "cp")
    boolean = isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
    if isinstance(attention_mask, torch.Tensor):
        original = attention_mask
        key, value, attention_mask = without_padding_keys(
            key, value, attention_mask, call.key_length(attention_mask)
        )
    elif not _causal(module, kwargs):  # every query sees every key: the cp padding's too, unless cut
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
        if inner == "sdpa" and boolean:
            shared = ("additive mask", original, query.dtype)  # a tensor hashes by identity
            attention_mask = call.shared(shared, lambda: additive_mask(attention_mask, query.dtype))
        output, weights = function(module, query, key, value, attention_mask, **kwargs)
    return _sequences_for_heads(output, call.layout, call.mesh, "cp", path), weights


def _sees_no_key(call, mask) -> bool:
    """Whether some row of the whole mask sees no real key (every rank holds the whole mask: all agree)."""
    if mask is None:
        return False
    return call.shared(
        ("rows without keys", id(mask)), lambda: bool(rows_without_keys(mask, call.length).any())
    )


def _ring_attention(inner: str, module, query, key, value, attention_mask, call, **kwargs):
    """Ring (and hybrid: Ulysses inside each group of ``call.ulysses`` ranks, ring across groups)."""
    if kwargs.get("dropout"):
        raise ValueError(
            "ring attention does not apply attention dropout; set the model's attention_dropout to 0"
        )
    if attention_mask is None and not _causal(module, kwargs):
        raise ValueError(
            f"{call.name_of(module)} attends in both directions (no mask, is_causal=False), and ring "
            "attention serves causal and masked attention only; use implementation='ulysses' (or the model "
            "as a decoder: config.is_decoder=True)"
        )
    if call.layout.per_head_params:
        raise LayoutError(
            f"{call.name_of(module)}: the ring's merge has no place for the per-head parameters "
            f"{call.layout.per_head_params} (attention sinks), so ring and hybrid would ignore them; "
            "use implementation='ulysses' (cp must divide the heads)"
        )
    if hides_scores(type(module)) and _sees_no_key(call, attention_mask):
        raise ValueError(
            f"{call.name_of(module)} ({type(module).__name__}) gives a hidden score its own gradient, and "
            "some row of this batch sees no key (left padding): ring and hybrid would give that row "
            "another gradient; use implementation='ulysses'"
        )
    mesh, degree, path = call.split_mesh, call.ulysses, call.name_of(module)
    if degree > 1:
        module, query, key, value, kwargs = _heads_for_sequences(
            module, query, key, value, kwargs, call.layout, mesh, "cp_ulysses", path
        )
    scale = kwargs.get("scaling") or module.scaling
    group = mesh.get_group("cp_ring")
    if isinstance(group, TracedGroup):  # in a compiled layer: the ring runs as one opaque op
        output = traced_ring(
            query,
            key,
            value,
            attention_mask,
            scale,
            kwargs.get("softcap"),
            inner == "eager",
            group,
            f"{path} kv",
        )
    else:
        blocks = call_blocks(call, attention_mask, inner == "eager")
        output = RingAttention.apply(
            query, key, value, blocks, scale, kwargs.get("softcap"), group, f"{path} kv"
        )
    output = output.transpose(1, 2)
    if degree > 1:
        output = _sequences_for_heads(output, call.layout, mesh, "cp_ulysses", path)
    return output.contiguous(), None


def _cp_attention(inner: str):
    if inner not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"attention implementation {inner!r} has no mask function; cpshard cannot keep its mask exact"
        )

    def split(module, query, key, value, attention_mask, call, **kwargs):
        function = _inner_function(inner, module)
        if call is None:
            return function(module, query, key, value, attention_mask, **kwargs)
        if call.implementation == "ulysses":
            return _ulysses_attention(
                inner, function, module, query, key, value, attention_mask, call, **kwargs
            )
        return _ring_attention(inner, module, query, key, value, attention_mask, call, **kwargs)

    @torch._dynamo.disable  # the running call is ambient state: compiled code breaks its graph here
    def in_running_call(module, query, key, value, attention_mask, **kwargs):
        step = active_decode()
        if step is not None:
            scale, window = kwargs.get("scaling") or module.scaling, kwargs.get("sliding_window")
            return decode_attention(
                step, module, query, key, value, scale, kwargs.get("softcap"), window
            ), None
        prefill = current_call()
        if prefill is not None and prefill.kv_sink is not None:  # this rank's share of the prompt's k, v
            prefill.kv_sink[id(module)] = (key, value, kwargs.get("sliding_window"))
        return split(module, query, key, value, attention_mask, split_call(), **kwargs)

    def attention(module, query, key, value, attention_mask, **kwargs):
        traced = kwargs.pop(TRACED_KEY, None)  # put there by the cut hook before a compiled layer
        if traced is not None:
            return split(module, query, key, value, attention_mask, traced, **kwargs)
        return in_running_call(module, query, key, value, attention_mask, **kwargs)

    attention.__doc__ = f"Context-parallel attention around {inner!r} attention (cpshard)."
    return attention


def cp_attention_name(inner: str) -> str:
    """Register cpshard's attention around ``inner`` (idempotent: Ulysses, ring, hybrid or the decode step,
    as the running call says) and return the registered implementation name."""
    name = register_wrapper(ALL_ATTENTION_FUNCTIONS, PREFIX, inner, _cp_attention)
    return register_once(ALL_MASK_ATTENTION_FUNCTIONS, name, lambda: ALL_MASK_ATTENTION_FUNCTIONS[inner])
