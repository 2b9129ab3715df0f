"""XLM as a causal LM (``config.causal=True``) under cp: the sequence cut where it enters ``XLMModel``.

XLM has no layer module: ``XLMModel.forward`` embeds the tokens (token, position, language, token type),
builds its masks (``get_masks``) and runs lists of attentions, norms and FFNs, multiplying the stream by its
padding mask ``[B, L]`` between them, so there is no layer to cut at. Everything it runs is per position
but attention, whose causal mask is the triangle of the sequence's shape alone (XLM hides no padding key:
it zeroes padding rows between its layers), which the rewritten attention
(:mod:`cpshard.layouts.family_attention`) applies over the whole sequence cp's attention gathers, whatever
slice the model built its mask for. So cp cuts where the sequence enters the model
(:attr:`~cpshard.layouts.layout.Layout.cut_at_entry`): a pre-hook builds the padding mask of the whole
sequence with the model's own ``get_masks`` (from ``attention_mask``, else from the count of ids that are not
padding, as the model does), and hands the model the rank's slice of every per-position input and of that
mask; its loop then holds the rank's rows only. Generation is refused (its model keeps no cache).

Written against transformers 5.25's code: ``XLMModel.forward``, ``get_masks`` and ``TransformerFFN`` are
fingerprinted with the rewritten attention (:data:`~cpshard.layouts.family_attention.WRITTEN_AGAINST`).
"""

from __future__ import annotations

import torch
from torch import nn

from cpshard.call import split_call
from cpshard.comm.redistribute import redistribute
from cpshard.interfaces import Hook
from cpshard.recurrent.entry import model_function, named_inputs
from cpshard.recurrent.slot import cut_to_rank

#: XLMModel's inputs with one value per position ``[B, L]`` that a cp batch carries: each cut to the rank's
#: positions (a cp batch has no ``langs``, ``token_type_ids`` or ``lengths``: XLM's own defaults hold)
PER_POSITION = ("input_ids", "position_ids", "attention_mask")


class _NoPast:
    """The cache XLM's model gets inside a cp call, where its generation is refused: no past, nothing kept.
    ``XLMModel.forward`` makes a cache in every forward and the rewritten attention puts its keys there, so
    an attention run again in the backward (``attention_recompute=True``) found its own keys beside the ones
    it recomputed; the model asks the length of its past, the attention hands its keys on."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, kwargs=None) -> tuple:
        return key, value


def _whole_mask(decoder: nn.Module, inputs: dict, sequence: torch.Tensor) -> torch.Tensor:
    """The padding mask ``[B, L]`` of the whole sequence (token ids or embeddings), as ``XLMModel.forward``
    builds it: the ``attention_mask`` given, else the first positions, as many as the ids that are not
    padding (all, for embeddings)."""
    batch, length = sequence.shape[:2]
    ids = inputs.get("input_ids")
    lengths = (
        (ids != decoder.pad_index).sum(dim=1).long()
        if ids is not None
        else torch.full((batch,), length, device=sequence.device, dtype=torch.long)
    )
    get_masks = model_function(decoder, "get_masks")
    return get_masks(length, lengths, decoder.causal, inputs.get("attention_mask"))[0]


def _enter(decoder: nn.Module, args, kwargs):
    """The model's inputs cut to this rank where the sequence enters it (see the module's docstring)."""
    call = split_call()
    if call is None:
        return None
    inputs = named_inputs(decoder, args, kwargs)
    embeds = inputs.get("inputs_embeds")
    sequence = inputs["input_ids"] if embeds is None else embeds
    positions = inputs.get("position_ids")
    whole = {
        **inputs,
        "cache": _NoPast(),
        "attention_mask": _whole_mask(decoder, inputs, sequence),
        # the model's own count from 0, one row per sequence (it takes given ones as [B, L] only)
        "position_ids": decoder.position_ids[:, : sequence.shape[1]].expand(sequence.shape[0], -1)
        if positions is None
        else positions,
    }
    cut = {key: cut_to_rank(whole[key], call) for key in PER_POSITION if whole.get(key) is not None}
    if embeds is not None:
        cut["inputs_embeds"] = redistribute(embeds, *call.layout.hidden, call.mesh)
    return (), {**whole, **cut}


def xlm_entry_hooks(decoder: nn.Module, layers: nn.ModuleList, layers_path: str) -> list[Hook]:
    """The pre-hook that cuts the sequence where it enters XLM's ``decoder`` (its ``layers``, the attention
    modules, receive slices); the code it was written for is checked with the rewritten attention's
    (:func:`cpshard.layouts.family_attention.check_unchanged`, before any layout is resolved)."""
    return [Hook(decoder, _enter, pre=True)]
