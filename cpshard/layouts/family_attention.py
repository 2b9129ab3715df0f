"""Attention of the families that compute it in their own code (Bloom, GPT-Neo, MPT, XGLM; and the classics
whose own code is plain attention: OpenAI GPT, GPT-NeoX-Japanese, MegatronBERT, RemBERT, RoFormer, TrOCR,
BigBird's ``original_full``, XLM as a causal LM), rewritten to call it through transformers' attention
registry, as its newer models do, so that cp's attention serves it (Falcon's own code calls the registry
since transformers 5.25, its ALiBi folded into the mask). What cpshard does not rewrite, it names
(:data:`NOT_REWRITTEN`).

Each forward is the family's own: its projections, output projection and dropout, read from the pinned
transformers, and each rewrite is checked against the code it was written for before it goes in
(:data:`WRITTEN_AGAINST`, :mod:`cpshard.layouts.fingerprint`): another release's code is refused, not run
through a rewrite made for this one. What the family adds to the scores becomes part of one additive mask,
built from the model's own whole-sequence inputs, so it holds for any cut of the queries: ALiBi (Bloom, MPT)
per head and key, GPT-Neo's local window per query and key. The scores are then the same sum
one process computes, in another order (equal to rounding); where a family hides scores otherwise than by
adding the mask (MPT's ``masked_fill``, XGLM's clamp), its eager function does the same
(:mod:`cpshard.layouts.family_eager`), so that even a row that sees no key gets the family's gradient. Cost:
a mask with ALiBi is ``[batch, heads, L, L]`` floats per layer (Ulysses keeps its share of the heads), where
the families' own code builds the same ``[batch * heads, L, L]`` scores; ring and hybrid take masks of
allowed and hidden positions only, so they refuse ALiBi and GPT-Neo's window with a clear error.
"""

from __future__ import annotations

import math
import sys
from functools import partial

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpshard.layouts.family_eager import OPENAI_LATER, eager_for, hidden_value
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.spec.masks import additive_mask

#: layer inputs with one value per key of the whole sequence (ALiBi): the cut leaves them whole
PER_KEY_INPUTS = ("alibi", "position_bias")


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The model's mask as additive floats (0 where allowed, the dtype's minimum where hidden, as
    transformers builds them)."""
    return additive_mask(mask, dtype, hidden_value(dtype))


def _whole(mask: torch.Tensor | None, family: str) -> torch.Tensor:
    if mask is None:
        raise ValueError(
            f"{family} attention with a position bias needs the model's mask of the whole sequence, and got "
            "none: use the eager attention implementation"
        )
    return mask


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
    mask = torch.where(hidden, hidden_value(bias.dtype), bias)
    output, weights = _attend(
        module, config, query, key, value, mask, module.softmax_scale, module.attn_dropout_p
    )
    return module.out_proj(output), weights


def _self_attention_only(module: nn.Module, other_states) -> None:
    """Refuse cross-attention (keys from other states, an encoder's): cp splits a decoder's own sequence."""
    if other_states is not None:
        raise ValueError(
            f"{type(module).__name__}: cross-attention is not a decoder's self-attention; cp cannot serve it"
        )


def _cached(cache, key, value, layer: int, kwargs: dict):
    """``key`` and ``value`` after layer ``layer``'s past in ``cache`` (an encoder-decoder cache: its
    self-attention part), or as they are without one."""
    if cache is None:
        return key, value
    return getattr(cache, "self_attention_cache", cache).update(key, value, layer, kwargs=kwargs)


def _xglm(module, config, hidden_states, key_value_states=None, cache=None, attention_mask=None, **kwargs):
    """XGLM's attention, and TrOCR's and MVP's (the same code, hidden scores without XGLM's clamp)."""
    _self_attention_only(module, key_value_states)
    batch, length = hidden_states.shape[:2]
    query = (module.q_proj(hidden_states) * module.scaling).view(batch, length, -1, module.head_dim)
    key, value = (
        p(hidden_states).view(batch, length, -1, module.head_dim) for p in (module.k_proj, module.v_proj)
    )
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    key, value = _cached(cache, key, value, module.layer_idx, kwargs)
    mask = _additive(_whole(attention_mask, type(module).__name__.removesuffix("Attention")), query.dtype)
    output, weights = _attend(module, config, query, key, value, mask, 1.0, module.dropout)
    return module.out_proj(output), weights


def _mvp(module, config, hidden_states, attn_prompt=None, **kwargs):
    """MVP's attention: BART's, as XGLM's; its prompts (``use_prompt``) are keys and values put before the
    sequence's in every layer, where cp's attention sees the sequence's alone."""
    if attn_prompt is not None:
        raise ValueError(
            "MVP's prompts (config.use_prompt) put keys before the sequence's inside attention, which cp's "
            "attention does not see: set use_prompt=False, or run this model without cp"
        )
    return _xglm(module, config, hidden_states, **kwargs)


def _own(module: nn.Module, name: str):
    """``name`` from the modeling module that defines ``module``'s class (imported already, with it)."""
    return getattr(sys.modules[type(module).__module__], name)


def _openai(module, config, x, attention_mask=None, output_attentions=False):
    query, key, value = (
        module.split_heads(part) for part in module.c_attn(x).split(module.split_size, dim=2)
    )
    mask = attention_mask  # OpenAI GPT's padding mask, [B, 1, 1, keys]: the later keys' -1e4 goes in first
    if mask is not None:
        later = torch.ones(mask.shape[-1], mask.shape[-1], device=mask.device).tril().bool()
        mask = additive_mask(later, mask.dtype, OPENAI_LATER) + mask
    scaling = value.shape[-1] ** -0.5 if module.scale else 1.0
    output, weights = _attend(module, config, query, key, value, mask, scaling, module.attn_dropout.p)
    return [module.resid_dropout(module.c_proj(output))] + ([weights] if output_attentions else [])


def _gpt_neox_japanese(
    module, config, hidden_states, attention_mask, position_embeddings, layer_past=None, **kwargs
):
    qkv = module.query_key_value(hidden_states)
    qkv = qkv.view(*qkv.shape[:-1], module.num_attention_heads, 3 * module.head_size).permute(0, 2, 1, 3)
    query, key, value = qkv.split(module.head_size, dim=-1)
    cos, sin = position_embeddings
    rotated = _own(module, "apply_rotary_pos_emb")(
        query[..., : module.rotary_ndims], key[..., : module.rotary_ndims], cos, sin
    )
    query, key = (
        torch.cat((r, x[..., module.rotary_ndims :]), dim=-1) for r, x in zip(rotated, (query, key))
    )
    if layer_past is not None:
        key, value = layer_past.update(key, value, module.layer_idx)
    output, weights = _attend(
        module, config, query, key, value, attention_mask, 1 / module.norm_factor, module.attention_dropout.p
    )
    return module.dense(output), weights, module.dense_bias


def _bert(
    module, config, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None, **kwargs
):
    """BERT's self-attention of its own (MegatronBERT, RemBERT, BigBird's ``original_full``; RoFormer with
    its rotary, on v too where ``rotary_value``), as a decoder."""
    _self_attention_only(module, encoder_hidden_states)
    shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)
    query, key, value = (
        p(hidden_states).view(shape).transpose(1, 2) for p in (module.query, module.key, module.value)
    )
    rotary = kwargs.get("sinusoidal_pos")
    if rotary is not None:
        rotated = module.apply_rotary_position_embeddings(
            rotary, query, key, value if module.rotary_value else None
        )
        query, key, value = (*rotated, value)[:3]
    key, value = _cached(cache, key, value, module.layer_idx, kwargs)
    scaling = module.attention_head_size**-0.5
    return _attend(module, config, query, key, value, attention_mask, scaling, module.dropout.p)


#: why cp does not serve XLM with ``config.causal=False``
_BIDIRECTIONAL = (
    "XLM with config.causal=False attends in both directions (a masked LM, XLM's MLM objective), not a "
    "causal LM; cp serves XLM as a causal LM: config.causal=True"
)


def _xlm(module, config, input, mask, kv=None, cache=None, output_attentions=False, **kwargs):
    """XLM's attention as a causal LM's: its model's causal mask (``[B, L, L]``) is the triangle of the
    sequence's shape alone, so the registry gets none and attends causally (eager: XLM's causal fill in
    :mod:`cpshard.layouts.family_eager`), over the whole sequence under cp whatever slice the model built its
    mask for; a mask of keys (``[B, L]``, not causal) is refused."""
    _self_attention_only(module, kv)
    if mask.dim() != 3:
        raise ValueError(_BIDIRECTIONAL)
    batch, length = input.shape[:2]
    query, key, value = (
        p(input).view(batch, length, module.n_heads, module.head_dim).transpose(1, 2)
        for p in (module.q_lin, module.k_lin, module.v_lin)
    )
    key, value = _cached(cache, key, value, module.layer_id, kwargs)
    query = query / math.sqrt(module.head_dim)
    output, weights = _attend(module, config, query, key, value, None, 1.0, module.dropout)
    return (module.out_lin(output),) + ((weights,) if output_attentions else ())


#: each family's attention class, by name, and its forward through the registry
FORWARDS = {
    "BloomAttention": _bloom,
    "GPTNeoSelfAttention": _gpt_neo,
    "MptAttention": _mpt,
    "XGLMAttention": _xglm,
    "Attention": _openai,
    "GPTNeoXJapaneseAttention": _gpt_neox_japanese,
    "MegatronBertSelfAttention": _bert,
    "RemBertSelfAttention": _bert,
    "RoFormerSelfAttention": _bert,
    "TrOCRAttention": _xglm,
    "BigBirdSelfAttention": _bert,
    "MvpAttention": _mvp,
    "MultiHeadAttention": _xlm,
}
#: attention of causal LM types that cpshard does not rewrite, by class (its modeling module under
#: ``transformers.models``), and why: none is causal attention over one sequence that a registry function
#: could compute (CPM-Ant's is not causal at all), or its model does what a cut sequence cannot follow (GIT's
#: image tokens); Reformer's is served otherwise, by its layout file
NOT_REWRITTEN = {
    "big_bird.modeling_big_bird.BigBirdBlockSparseAttention": "BigBird's block-sparse attention (sliding, "
    "global and random blocks, in both directions; attention_type='original_full' is served)",
    "xlnet.modeling_xlnet.XLNetRelativeAttention": "XLNet's two-stream relative attention (a permutation LM: "
    "content and query streams over a memory, in both directions unless attn_type='uni')",
    "reformer.modeling_reformer.LSHSelfAttention": "Reformer's LSH attention (keys hashed into buckets, "
    "sorted and attended in chunks): served by its layout file (its heads split over cp, "
    "cpshard.recurrent.reformer), not by a derived layout",
    "reformer.modeling_reformer.LocalSelfAttention": "Reformer's chunked local attention (each chunk attends "
    "to itself and the chunks before it): served by its layout file (its heads split over cp, "
    "cpshard.recurrent.reformer), not by a derived layout",
    "cpmant.modeling_cpmant.CpmAntAttention": "CPM-Ant's attention, which is not causal: its model marks "
    "every token as context (`context` all ones in CpmAntModel.forward), so its mask lets every position see "
    "every other, later ones too",
    "git.modeling_git.GitSelfAttention": "GIT's attention (BERT's, after image tokens: its causal LM's loss "
    "skips the image tokens' positions, so it needs pixel_values beside token ids and labels)",
}
#: what each rewrite was written against: its family's modeling module, and there the attention class, the
#: layer that calls it (the arguments it is given), the model's forward (its mask and ALiBi) and the ALiBi
#: or rotary builder, each with the fingerprint of its code in transformers 5.25.0 (Bloom's, GPT-Neo's,
#: MPT's and XGLM's the same in 5.24.0)
WRITTEN_AGAINST = written_against(__name__)


def rewritten(module: nn.Module) -> bool:
    """Whether ``module``'s class is one whose attention this module rewrites (by name and modeling module:
    OpenAI GPT's ``Attention`` shares its name with FSMT's)."""
    family = WRITTEN_AGAINST.get(type(module).__name__)
    return family is not None and type(module).__module__ == family[0]


def not_rewritten(module: nn.Module) -> str | None:
    """Why cpshard does not rewrite the attention inside ``module`` (:data:`NOT_REWRITTEN`), None where it
    has no reason on record."""
    for inner in module.modules():
        name = f"{type(inner).__module__.removeprefix('transformers.models.')}.{type(inner).__name__}"
        if name in NOT_REWRITTEN:
            return NOT_REWRITTEN[name]
    return None


def score_bias(module: nn.Module, config) -> str | None:
    """What ``module`` adds to its scores beyond a mask of allowed and hidden keys (a rewritten family's, or
    Falcon's ALiBi in its mask), None for anything else: cp generation's decode merges scores over a split
    cache without it."""
    name = type(module).__name__
    if name in ("BloomAttention", "MptAttention") or (name == "FalconAttention" and config.alibi):
        return "ALiBi"
    if name == "GPTNeoSelfAttention" and module.attention_type == "local":
        return "a local window"
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
    if type(module).__name__ == "MultiHeadAttention" and not config.causal:
        raise ValueError(_BIDIRECTIONAL)
    if getattr(module, "pretraining_tp", 1) > 1 and getattr(module, "slow_but_exact", False):
        raise ValueError(
            f"{type(module).__name__}: slow_but_exact with pretraining_tp > 1 splits the output projection "
            "as no registry function does; set config.slow_but_exact=False"
        )
    module.num_key_value_groups = 1  # every rewritten family has a k/v head per q head
    module.forward = partial(FORWARDS[type(module).__name__], module, config)
