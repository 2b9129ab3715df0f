"""Ulysses attention, wrapped around the model's own attention function.

Registered in transformers' attention-function registry (and its mask registry, so the model
still builds its mask) under ``cpshard_<inner>``. Inside a cp call, q, k and v arrive split
over the sequence; one all-to-all each makes them whole sequences over a share of the heads,
the model's own function runs with the model's own whole-sequence mask, and one all-to-all
brings the output back. Outside a cp call it is the inner function, untouched.
"""

from __future__ import annotations

import math
import sys
from functools import lru_cache

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from cpshard.context import active_call
from cpshard.redistribute import redistribute

PREFIX = "cpshard_"


def kv_replication(num_heads: int, num_kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated so that cp divides them and each rank's q heads find theirs."""
    if num_heads % cp:
        raise ValueError(
            f"Ulysses splits heads over cp: num_attention_heads={num_heads} is not divisible by cp={cp}; "
            f"cp sizes that work: {', '.join(str(c) for c in range(1, num_heads + 1) if num_heads % c == 0)}"
        )
    return cp // math.gcd(num_kv_heads, cp)


def without_padding_keys(key, value, attention_mask, length: int):
    """Drop the cp padding from the keys. Real queries never see it, but a row that sees no key at
    all (left padding) gets what the model's function gives over all keys (eager: their mean), which
    must be over the real sequence's keys only."""
    return key[:, :, :length], value[:, :, :length], attention_mask[..., :length]


class _GroupedAs:
    """The attention module as the inner function should see it: ``groups`` q heads per local kv head."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


@lru_cache(maxsize=None)
def _model_eager(module_class: type):
    """The eager attention function of the modeling file that defines ``module_class``."""
    function = getattr(sys.modules[module_class.__module__], "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"{module_class.__name__}: its modeling file has no eager_attention_forward to wrap")
    return function


def _inner_function(inner: str, module):
    return _model_eager(type(module)) if inner == "eager" else ALL_ATTENTION_FUNCTIONS[inner]


def _ulysses(inner: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        function = _inner_function(inner, module)
        call = active_call()
        if call is None:
            return function(module, query, key, value, attention_mask, **kwargs)
        (seq_split, head_split), path = call.layout.qkv, call.name_of(module)
        replicas = kv_replication(query.shape[1], key.shape[1], call.cp_size)
        if replicas > 1:
            key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
            module = _GroupedAs(module, query.shape[1] // key.shape[1])
        query, key, value = (
            redistribute(x, seq_split, head_split, call.mesh, name=f"{path} {part}")
            for part, x in (("q", query), ("k", key), ("v", value))
        )
        if isinstance(attention_mask, torch.Tensor):
            key, value, attention_mask = without_padding_keys(key, value, attention_mask, call.length)
        output, weights = function(module, query, key, value, attention_mask, **kwargs)
        output = redistribute(output, *call.layout.attn_output, call.mesh, name=f"{path} out")
        return output, weights

    attention.__doc__ = f"Ulysses around {inner!r} attention (cpshard)."
    return attention


def ulysses_name(inner: str) -> str:
    """Register Ulysses around ``inner`` (idempotent) and return the registered implementation name."""
    if inner.startswith(PREFIX):
        return inner
    if inner != "eager" and inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {inner!r} is not in transformers' registry")
    if inner not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {inner!r} has no mask function; cpshard cannot keep its mask exact")
    name = PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _ulysses(inner))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    return name
