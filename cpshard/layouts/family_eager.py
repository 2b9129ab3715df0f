"""The eager attention of the families that hide scores in their own way (MPT's ``masked_fill``, XGLM's clamp,
OpenAI GPT's and XLM's causal fills, GPT-Neo's float32 scores), for their rewritten forwards
(:mod:`cpshard.layouts.family_attention`) and for cp's attention, which runs them where the model's
implementation is eager.

A family that adds its mask to the scores gets transformers' eager function. One that hides a score otherwise
gives it another value and gradient: in a row that sees no key the two differ, so the eager function here does
what the family's own code does, and :func:`hides_scores` tells cp's attention which families those are (the
ring adds its mask, and refuses such rows for them).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.llama.modeling_llama import eager_attention_forward, repeat_kv


def hidden_value(dtype: torch.dtype) -> float:
    """The score transformers gives a hidden position: the dtype's minimum."""
    return torch.finfo(dtype).min


def _eager_then(hide):
    """transformers' eager attention with ``hide(scores, mask)`` applied to the masked scores, as a family's
    own code treats its hidden positions (their gradient, in a row that sees no key, differs from a sum's)."""

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key, value = (repeat_kv(x, module.num_key_value_groups) for x in (key, value))
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
        scores = scores if attention_mask is None else scores + attention_mask
        weights = nn.functional.softmax(hide(scores, attention_mask).float(), dim=-1).to(value.dtype)
        weights = nn.functional.dropout(weights, p=dropout, training=module.training)
        return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

    eager.causal_by_shape = hide in _CAUSAL_BY_SHAPE  # Ulysses' blocks of queries refuse such a function
    return eager


def _filled(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MPT's ``masked_fill``: a hidden score (the dtype's minimum in the mask) is that minimum, gradient 0."""
    return scores.masked_fill(mask == hidden_value(mask.dtype), hidden_value(scores.dtype))


def _clamped(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """XGLM's ``torch.max(scores, minimum)`` (a hidden score ties the minimum: half its gradient)."""
    return torch.max(scores, torch.full((), hidden_value(scores.dtype), device=scores.device))


#: the score OpenAI GPT gives a later key, whatever q·k (its padding mask added after)
OPENAI_LATER = -1e4


def _later_fixed(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """OpenAI GPT's ``w * b - 1e4 * (1 - b)``: a later key's score is -1e4 plus the padding mask (what
    :func:`_openai` put in ``mask`` there), gradient 0; a row of padding sees only those. The causal part
    comes from the shape: the queries and keys are whole sequences from their first position (one process,
    Ulysses; the ring refuses a mask of -1e4)."""
    later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
    fixed = torch.full((), OPENAI_LATER, dtype=scores.dtype, device=scores.device)
    return torch.where(later, fixed if mask is None else mask, scores)


def _later_filled(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """XLM's causal ``masked_fill``: a later key's score is the dtype's minimum, gradient 0. Its causal mask
    is the triangle of the sequence's shape and nothing else (XLM hides no padding key), so it comes from the
    shape here, the queries the last of the keys (whole sequences: one process, Ulysses)."""
    queries, keys = scores.shape[-2:]
    later = torch.ones(queries, keys, dtype=torch.bool, device=scores.device).triu(keys - queries + 1)
    return scores.masked_fill(later, hidden_value(scores.dtype))


#: the hides that make attention causal from the scores' shape, the queries the last of the keys: a block of
#: queries (``make_cp_forward(attention_block_bytes=...)``) would be taken for the sequence's last
_CAUSAL_BY_SHAPE = (_later_fixed, _later_filled)
#: the families whose own code treats hidden scores otherwise than by adding the mask
_HIDING = {
    "MptAttention": _filled,
    "XGLMAttention": _clamped,
    "Attention": _later_fixed,
    "MultiHeadAttention": _later_filled,
}
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
