"""Context-parallel attention, wrapped around the model's own attention function.

Registered in transformers' attention-function registry (and its mask registry, so the model
still builds its mask) under ``cpshard_<inner>``. Inside a cp call, q, k and v arrive split
over the sequence, and this module dispatches. Ulysses (:mod:`cpshard.attention.ulysses`): one
all-to-all for the three makes them whole sequences over a share of the heads, the model's own function runs
with the model's own whole-sequence mask, and one all-to-all brings the output back. Ring (and hybrid,
Ulysses inside groups first): k and v travel the ring (:mod:`cpshard.attention.ring`) with per-block
masks cut from that same mask; its glue is here. A prefill also leaves each layer's k and v in the
call's ``kv_sink`` (once per pass, for a module that attends in several: Inkling2-Loop's looped layers); a
decode step attends over the split cache (:mod:`cpshard.attention.decode`).
Outside a cp call it is the inner function, untouched.
"""

from __future__ import annotations

import sys
from functools import cache

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpshard.attention.blocks import call_blocks, rows_without_keys
from cpshard.attention.decode import decode_attention, sink_keys
from cpshard.attention.ring import Ring, RingAttention
from cpshard.attention.sparse import attend_selected, selects_keys
from cpshard.attention.traced_ring import traced_ring
from cpshard.attention.ulysses import causal, heads_for_sequences, sequences_for_heads, ulysses_attention
from cpshard.call import TRACED_KEY, active_decode, current_call, split_call
from cpshard.comm.channel import TracedGroup
from cpshard.interfaces import register_once, register_wrapper
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import FORWARDS
from cpshard.layouts.family_eager import eager_for, hides_scores
from cpshard.layouts.layout import PER_POSITION_ATTENTION
from cpshard.precision import autocast_inputs

PREFIX = "cpshard_"


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
    if attention_mask is None and not causal(module, kwargs):
        raise ValueError(
            f"{call.name_of(module)} attends in both directions (no mask, is_causal=False), and ring "
            "attention serves causal and masked attention only; use implementation='ulysses' (or the model "
            "as a decoder: config.is_decoder=True)"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            f"{call.name_of(module)} adds a bias per query and key (position_bias) to its scores, which the "
            "ring's blocks of allowed and hidden keys do not carry; use implementation='ulysses'"
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
    # under autocast the ring computes in the type the attention function would cast q, k and v to (before
    # hybrid's exchange, which then moves that type's bytes)
    query, key, value = autocast_inputs(query, key, value)
    if degree > 1:
        module, query, key, value, kwargs = heads_for_sequences(
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
        ring = Ring(blocks, scale, kwargs.get("softcap"), group, f"{path} kv")
        output = RingAttention.apply(query, key, value, ring)
    output = output.transpose(1, 2)
    if degree > 1:
        output = sequences_for_heads(output, call.layout, mesh, "cp_ulysses", path)
    return output.contiguous(), None


def _cp_attention(inner: str):
    if inner not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"attention implementation {inner!r} has no mask function; cpshard cannot keep its mask exact"
        )

    def split(module, query, key, value, attention_mask, call, **kwargs):
        function = _inner_function(inner, module)
        if selects_keys(module, call):  # DeepSeek's sparse attention, cp or not: see cpshard.attention.sparse
            return attend_selected(function, module, query, key, value, attention_mask, **kwargs)
        if call is None:
            return function(module, query, key, value, attention_mask, **kwargs)
        if call.implementation == "ulysses":
            return ulysses_attention(
                inner, function, module, query, key, value, attention_mask, call, **kwargs
            )
        return _ring_attention(inner, module, query, key, value, attention_mask, call, **kwargs)

    @torch._dynamo.disable  # the running call is ambient state: compiled code breaks its graph here
    def in_running_call(module, query, key, value, attention_mask, **kwargs):
        step = active_decode()
        if step is not None:
            scale, window = kwargs.get("scaling") or module.scaling, kwargs.get("sliding_window")
            bias, sinks = kwargs.get("position_bias"), kwargs.get("sinks")
            return decode_attention(
                step, module, query, key, value, scale, kwargs.get("softcap"), window, bias, sinks
            ), None
        prefill = current_call()
        if prefill is not None and prefill.kv_sink is not None:  # this rank's share of the prompt's k, v
            sink_keys(prefill.kv_sink, module, (key, value, kwargs.get("sliding_window")))
        return split(module, query, key, value, attention_mask, split_call(), **kwargs)

    def attention(module, query, key, value, attention_mask, **kwargs):
        if type(module).__name__ in PER_POSITION_ATTENTION:  # across a position's own copies: as it is
            return _inner_function(inner, module)(module, query, key, value, attention_mask, **kwargs)
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
