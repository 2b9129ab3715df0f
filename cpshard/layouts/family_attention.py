"""Attention of the families that compute it in their own code (Bloom, GPT-Neo, MPT, XGLM), rewritten to
call it through transformers' attention registry, as its newer models do, so that cp's attention serves it
(Falcon's own code calls the registry since transformers 5.25, its ALiBi folded into the mask).

Each forward is the family's own: its projections, output projection and dropout, read from the pinned
transformers, and each rewrite is checked against the code it was written for before it goes in
(:data:`WRITTEN_AGAINST`, :mod:`cpshard.layouts.fingerprint`): another release's code is refused, not run
through a rewrite made for this one. What the family adds to the scores becomes part of one additive mask,
built from the model's own whole-sequence inputs, so it holds for any cut of the queries: ALiBi (Bloom, MPT)
per head and key, GPT-Neo's local window per query and key. The scores are then the same sum
one process computes, in another order (equal to rounding); where a family hides scores otherwise than by
adding the mask (MPT's ``masked_fill``, XGLM's clamp), its eager function does the same, so that even a
row that sees no key gets the family's gradient. Cost: a mask with ALiBi is ``[batch, heads, L, L]``
floats per layer (Ulysses keeps its share of the heads), where the families' own code builds the same
``[batch * heads, L, L]`` scores; ring and hybrid take masks of allowed and hidden positions only, so they
refuse ALiBi and GPT-Neo's window with a clear error.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward, repeat_kv

from cpshard.layouts.fingerprint import check_written_for
from cpshard.spec.masks import additive_mask

#: layer inputs with one value per key of the whole sequence (ALiBi): the cut leaves them whole
PER_KEY_INPUTS = ("alibi", "position_bias")


def _hidden_value(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).min


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model's mask as additive floats (0 where allowed, the dtype's minimum where hidden, as
    transformers builds them)."""
    return additive_mask(mask, dtype, _hidden_value(dtype))


def _whole(mask: torch.Tensor | None, family: str) -> torch.Tensor:
    if mask is None:
        raise ValueError(
            f"{family} attention with a position bias needs the model's mask of the whole sequence, and got "
            "none: use the eager attention implementation"
        )
    return mask


def _eager_then(hide):
    """transformers' eager attention with ``hide(scores, mask)`` applied to the masked scores, as a family's
    own code treats its hidden positions (their gradient, in a row that sees no key, differs from a sum's)."""

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = (repeat_kv(x, module.num_key_value_groups) for x in (key, value))
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling + attention_mask
        weights = nn.functional.softmax(hide(scores, attention_mask).float(), dim=-1).to(value.dtype)
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    return eager


def _filled(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MPT's ``masked_fill``: a hidden score (the dtype's minimum in the mask) is that minimum, gradient 0."""
    return scores.masked_fill(mask == _hidden_value(mask.dtype), _hidden_value(scores.dtype))


def _clamped(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """XGLM's ``torch.max(scores, minimum)`` (a hidden score ties the minimum: half its gradient)."""
    return torch.max(scores, torch.full((), _hidden_value(scores.dtype), device=scores.device))


#: the families whose own code treats hidden scores otherwise than by adding the mask
_HIDING = {"MptAttention": _filled, "XGLMAttention": _clamped}
#: the eager attention of those, and of GPT-Neo (float32 scores, its weights cast to the values' dtype)
_EAGER = {name: _eager_then(hide) for name, hide in _HIDING.items()} | {
    "GPTNeoSelfAttention": _eager_then(lambda scores, mask: scores)
}


def eager_for(module_class: type):
    """The eager attention function for a rewritten family's class (its own masking, else transformers')."""
    return _EAGER.get(module_class.__name__, eager_attention_forward)


def hides_scores(module_class: type) -> bool:
    """Whether the family gives a hidden score its own value and gradient (MPT's fill, XGLM's clamp): in a
    row that sees no key that gradient differs from the ring's, which adds the mask."""
    return module_class.__name__ in _HIDING


def _attend(module, config, query, key, value, mask, scaling: float, dropout: float):
    """The function the model's implementation names (eager: :func:`eager_for`) over ``[B, H, S, D]`` q, k, v
    and ``mask``: the output ``[B, S, H * D]`` and the attention weights where it gives them (eager)."""
    name = config._attn_implementation
    function = eager_for(type(module)) if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
    output, weights = function(
        module, query, key, value, mask, scaling=scaling, dropout=dropout if module.training else 0.0
    )
    return output.reshape(*output.shape[:2], -1), weights


def _per_key(alibi: torch.Tensor, batch: int, heads: int, mask: torch.Tensor) -> torch.Tensor:
    """``[B * H, 1, L]`` ALiBi as ``[B, H, 1, keys]`` for ``mask``'s keys (a compiled cp layer's mask holds
    the real keys only, the cp padding cut)."""
    return alibi.view(batch, heads, 1, -1)[..., : mask.shape[-1]]


def _bloom(module, config, hidden_states, residual, alibi, attention_mask, layer_past=None, **kwargs):
    query, key, value = module._reshape(module.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    mask = _additive(_whole(attention_mask, "Bloom"), query.dtype)
    bias = _per_key(alibi, query.shape[0], module.num_heads, mask) * module.beta
    output, weights = _attend(
        module, config, query, key, value, mask + bias, module.inv_norm_factor, module.attention_dropout.p
    )
    output = nn.functional.dropout(module.dense(output), module.hidden_dropout, module.training)
    return residual + output, weights


def _gpt_neo(module, config, hidden_states, attention_mask=None, layer_past=None, **kwargs):
    query, key, value = (
        module._split_heads(projection(hidden_states), module.num_heads, module.head_dim)
        for projection in (module.q_proj, module.k_proj, module.v_proj)
    )
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_id)
    query, key = query.float(), key.float()  # GPT-Neo's scores are float32 whatever the model's dtype
    mask = _additive(_whole(attention_mask, "GPT-Neo"), query.dtype).float()
    queries, keys = mask.shape[-2:]  # a compiled cp layer's mask holds the real keys only: fewer than queries
    start = max(keys - queries, 0)
    window = module.bias[:, :, start : start + queries, :keys].to(mask.device)
    mask = _additive(window, mask.dtype) + mask
    output, weights = _attend(module, config, query, key, value, mask, 1.0, module.attn_dropout.p)
    return module.resid_dropout(module.out_proj(output)), weights


def _mpt(module, config, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    batch, length = hidden_states.shape[:2]
    mixed = module.Wqkv(hidden_states)
    if module.clip_qkv:
        mixed = mixed.clamp(min=-module.clip_qkv, max=module.clip_qkv)
    query, key, value = (
        x.reshape(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
        for x in mixed.chunk(3, dim=2)
    )
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    hidden = _whole(attention_mask, "MPT")  # True where hidden, as MPT reads it
    keys = hidden.shape[-1]
    # MPT adds its float32 bias to the scores (so they are float32): a bf16 bias would round it (to 2 at 500)
    bias = position_bias[:, :, max(0, position_bias.shape[-1] - keys) :].unsqueeze(0).float()
    mask = torch.where(hidden, _hidden_value(bias.dtype), bias)
    output, weights = _attend(
        module, config, query, key, value, mask, module.softmax_scale, module.attn_dropout_p
    )
    return module.out_proj(output), weights


def _xglm(module, config, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    if key_value_states is not None:
        raise ValueError("XGLM's cross-attention is not a decoder's self-attention: cp does not serve it")
    batch, length = hidden_states.shape[:2]
    query = (module.q_proj(hidden_states) * module.scaling).view(batch, length, -1, module.head_dim)
    key, value = (
        p(hidden_states).view(batch, length, -1, module.head_dim) for p in (module.k_proj, module.v_proj)
    )
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    if cache is not None:
        key, value = cache.update(key, value, module.layer_idx, kwargs=kwargs)
    mask = _additive(_whole(attention_mask, "XGLM"), query.dtype)
    output, weights = _attend(module, config, query, key, value, mask, 1.0, module.dropout)
    return module.out_proj(output), weights


#: each family's attention class, by name, and its forward through the registry
FORWARDS = {
    "BloomAttention": _bloom,
    "GPTNeoSelfAttention": _gpt_neo,
    "MptAttention": _mpt,
    "XGLMAttention": _xglm,
}
#: what each rewrite was written against: its family's modeling module, and there the attention class, the
#: layer that calls it (the arguments it is given), the model's forward (its mask and ALiBi) and the ALiBi
#: builder, each with the fingerprint of its code in transformers 5.24.0 and 5.25.0 (the same in both)
WRITTEN_AGAINST = {
    "BloomAttention": (
        "transformers.models.bloom.modeling_bloom",
        {
            "BloomAttention": "50a670d32f73a7f6",
            "BloomBlock": "2198e125f35f79a0",
            "BloomModel.forward": "203780fe8c5965aa",
            "build_alibi_tensor": "732279cc0182f227",
        },
    ),
    "GPTNeoSelfAttention": (
        "transformers.models.gpt_neo.modeling_gpt_neo",
        {
            "GPTNeoSelfAttention": "9b94331c78b7ed95",
            "GPTNeoAttention": "bec0024856d6c39d",
            "GPTNeoBlock": "009430d42b6afab4",
            "GPTNeoModel.forward": "06adc5a9f6acc2e4",
        },
    ),
    "MptAttention": (
        "transformers.models.mpt.modeling_mpt",
        {
            "MptAttention": "b4879d34d2ff30b9",
            "MptBlock": "b72fa418ea13fc47",
            "MptModel.forward": "e3bdc3b62247fe4f",
            "build_mpt_alibi_tensor": "5673cafed323e6d9",
        },
    ),
    "XGLMAttention": (
        "transformers.models.xglm.modeling_xglm",
        {
            "XGLMAttention": "a85ae1f06007e574",
            "XGLMDecoderLayer": "b33411c7ca9cb5ea",
            "XGLMModel.forward": "aac31ef6192f82c1",
        },
    ),
}


def rewritten(module: nn.Module) -> bool:
    """Whether ``module``'s class is one whose attention this module rewrites."""
    return type(module).__name__ in FORWARDS


def score_bias(module: nn.Module, config) -> str | None:
    """What ``module`` adds to its scores beyond a mask of allowed and hidden keys (a rewritten family's, or
    Falcon's ALiBi in its mask), None for anything else: cp generation's decode merges scores over a split
    cache without it."""
    name = type(module).__name__
    if name in ("BloomAttention", "MptAttention") or (name == "FalconAttention" and config.alibi):
        return "ALiBi"
    if name == "GPTNeoSelfAttention" and module.attention_type == "local":
        return "a local window"
    if name == "InklingAttention":
        return "a relative position bias per query"
    return None


def check_unchanged(model: nn.Module) -> None:
    """A :class:`~cpshard.layouts.errors.LayoutError` where ``model`` holds a family whose code in the
    installed transformers is not the code its rewrite was written for (before anything runs it)."""
    for family in dict.fromkeys(type(module) for module in model.modules() if rewritten(module)):
        module_name, pieces = WRITTEN_AGAINST[family.__name__]
        check_written_for(f"{family.__name__} (its attention, rewritten by cpshard)", module_name, pieces)


def rewrite(module: nn.Module, config) -> None:
    """``module`` (one of :data:`FORWARDS`' classes, checked by :func:`check_unchanged`) attends through the
    registry from now on (again, after a ``copy.deepcopy``: the forward is set anew each time)."""
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        raise ValueError(
            f"{type(module).__name__}: slow_but_exact with pretraining_tp > 1 splits the output projection "
            "as no registry function does; set config.slow_but_exact=False"
        )
    module.num_key_value_groups = 1  # every rewritten family has a k/v head per q head
    module.forward = partial(FORWARDS[type(module).__name__], module, config)
