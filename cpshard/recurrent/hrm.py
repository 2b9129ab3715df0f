"""HRM's text model (hrm_text) under cp: the sequence cut where it enters the decoder.

HRM's decoder holds two stacks of layers, L and H, and runs them in cycles from its own loop: the L stack
``L_cycles`` times per H cycle on its state plus the H state, then the H stack on its state plus the L
state, ``H_cycles`` times (earlier L cycles under ``no_grad``). The states are whole-sequence tensors the
loop keeps beside the layers (the H state starts as the scaled embeddings, the L state as a learned vector
repeated at every position), so a cut at a layer's entry would add the whole sequence's state to a slice.
Everything it computes is per position but attention: the states, their sums, the norms, the MLP, the gate
on the attention output, the rotary pair (of the position ids; rope types that rescale by the longest
position are refused, :func:`~cpshard.recurrent.entry.check_rope_per_position`). So cp cuts where the
sequence enters the decoder (:mod:`cpshard.recurrent.entry`): a pre-hook embeds the tokens and builds the
causal mask on the whole sequence with the model's own ``create_causal_mask`` (cp's attention sees whole
sequences), and hands the decoder the rank's slice of the embeddings and ``position_ids``; both states, and
every pass, then hold the rank's positions only. Not served: ``token_type_ids`` (the prefix-LM block HRM
overlays on its mask), a cache and generation (its cache slots per cycle), which are refused by name.

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from cpshard.call import split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.recurrent.entry import check_rope_per_position, entered, model_function

#: what the hook was written against in transformers 5.25.0: the decoder's loop, and everything it runs per
#: position on the slice (a change there could mix positions)
WRITTEN_AGAINST = written_against(__name__)


def check_hrm_unchanged(decoder: nn.Module) -> None:
    """Raise where the installed HRM code is not the code the entry cut was written for, or where its rotary
    pair is not per position."""
    check_written_for("HrmTextModel (its loop over the H and L stacks, cut at its entry)", *WRITTEN_AGAINST)
    check_rope_per_position(type(decoder).__name__, decoder.rotary_emb)


def _check_inputs(decoder: nn.Module, args, kwargs) -> None:
    """Raise for inputs cp does not cut or carry: it builds the mask itself, and holds no cache."""
    if args or kwargs.get("cache") is not None or kwargs.get("use_cache"):
        raise ValueError(
            f"{type(decoder).__name__}: inputs by position or a cache in a cp forward; cp serves HRM's "
            "training forward (token ids or embeddings and a 2D padding mask), without a cache"
        )
    if kwargs.get("token_type_ids") is not None or isinstance(kwargs.get("attention_mask"), dict):
        raise ValueError(
            f"{type(decoder).__name__}: token_type_ids (HRM's prefix-LM block) or masks built by hand in a "
            "cp forward; cp builds HRM's causal mask from a 2D padding mask only"
        )


def _whole_mask(decoder: nn.Module, embeds: torch.Tensor, mask, positions: torch.Tensor):
    """The causal mask of the whole sequence, built by the model's own function as its forward builds it; a
    4D mask passes through the forward's own build unchanged."""
    return model_function(decoder, "create_causal_mask")(decoder.config, embeds, mask, None, positions)


def _check_no_mask(decoder: nn.Module, cut: dict) -> None:
    """Where the whole sequence needs no mask (SDPA's causal skip: no padding, no packed documents), the
    forward builds its own on the rank's slice from ``None``; that one must be none too, else cp's attention
    would get a mask of the slice's size."""
    if cut["attention_mask"] is not None:
        return
    if _whole_mask(decoder, cut["inputs_embeds"], None, cut["position_ids"]) is not None:
        raise ValueError(
            f"{type(decoder).__name__}: the model builds a mask on a cp rank's slice where the whole "
            "sequence needs none, so cp's attention would not see the whole sequence's: report this model"
        )


def _enter(decoder: nn.Module, args, kwargs):
    """The decoder's inputs cut to this rank where the sequence enters it (see the module's docstring),
    without a cache (the forward would make one of the slice's keys for ``use_cache``)."""
    call = split_call()
    if call is None:  # outside cp, or a decode step (refused before: generation.prefill.check_servable)
        return None
    _check_inputs(decoder, args, kwargs)
    cut = entered(decoder, kwargs, call, partial(_whole_mask, decoder))
    _check_no_mask(decoder, cut)
    return (), {**cut, "use_cache": False}


def hrm_entry_hooks(decoder: nn.Module, layers: nn.ModuleList, layers_path: str) -> list[Hook]:
    """The pre-hook that cuts the sequence where it enters HRM's ``decoder`` (its ``layers``, one of its two
    stacks, need nothing more: they receive slices)."""
    check_hrm_unchanged(decoder)
    return [Hook(decoder, _enter, pre=True)]
