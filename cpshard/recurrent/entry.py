"""The cut where the sequence enters the decoder, shared by the decoders whose own loop keeps per-position
values beside its layers (Inkling2's block states, HRM's H and L states): cut at the first layer, those
would hold the whole sequence beside the layers' slices. Instead a pre-hook on the decoder embeds the tokens
and builds the masks on the whole sequence with the model's own code, and hands the decoder the rank's slice
of the embeddings and of ``position_ids``, so that everything its forward computes and keeps is a slice; the
layers' cut hooks are not installed (:attr:`~cpshard.layouts.layout.Layout.cut_at_entry`). The slice is
contiguous (the plan holds such layouts to contiguous order). What each family adds (its masks, a cache
that places the slice) sits with its hooks: :mod:`cpshard.recurrent.inkling2`, :mod:`cpshard.recurrent.hrm`.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from torch import nn

from cpshard.call import CallPlan
from cpshard.comm.redistribute import redistribute
from cpshard.layouts.errors import LayoutError
from cpshard.recurrent.slot import cut_to_rank


def model_function(decoder: nn.Module, name: str) -> Callable:
    """The function ``name`` as the decoder's modeling file imports it (``create_causal_mask``), so that the
    masks cp builds are the ones the model's own forward builds."""
    return getattr(sys.modules[type(decoder).__module__], name)


def check_rope_per_position(what: str, rotary: nn.Module) -> None:
    """Raise where ``rotary``'s rope type rescales its pair by the longest position a call sees
    (transformers' ``dynamic_rope_update``: its ``dynamic`` and ``longrope`` types): a pair computed on a cp
    rank's slice, as a decoder cut at its entry computes it, then differs from the whole sequence's."""
    rope = rotary.rope_type
    if "dynamic" in rope or rope == "longrope":
        raise LayoutError(
            f"{what}: rope type {rope!r} rescales its rotary pair by the longest position a call sees, which "
            "differs between a cp rank's slice and the whole sequence; cp serves it with a rope type whose "
            "pair depends on a position's id alone"
        )


def named_inputs(decoder: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The decoder's inputs by name (a causal LM may pass the token ids first, unnamed), read off its class's
    forward (the instance's may be cp's)."""
    names = list(inspect.signature(type(decoder).forward).parameters)[1:]  # past ``self``
    return {**dict(zip(names, args)), **kwargs}


def whole_inputs(decoder: nn.Module, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence's embeddings (those given, else the decoder's ``embed_tokens`` on the token ids)
    and ``position_ids`` (those given, else counted from 0 as the model counts them without a past)."""
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        embeds = decoder.embed_tokens(kwargs["input_ids"])
    positions = kwargs.get("position_ids")
    if positions is None:
        positions = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
    return embeds, positions


def entered(decoder: nn.Module, kwargs: dict, call: CallPlan, whole_masks: Callable) -> dict:
    """The decoder's keyword inputs with the sequence cut to this rank: the masks built by
    ``whole_masks(embeds, attention_mask, position_ids)`` on the whole sequence, then the rank's slice of the
    embeddings (in place of the token ids) and of ``position_ids``."""
    embeds, positions = whole_inputs(decoder, kwargs)
    masks = whole_masks(embeds, kwargs.get("attention_mask"), positions)
    return {
        **kwargs,
        "input_ids": None,
        "inputs_embeds": redistribute(embeds, *call.layout.hidden, call.mesh),
        "position_ids": cut_to_rank(positions, call),
        "attention_mask": masks,
    }
