"""Inkling2's decoder (and Inkling2-Loop's) under cp: the sequence cut where it enters the decoder, the
convolutions with a halo, attention at the rank's positions.

Inkling2's layers mix tokens as Inkling's do (short convolutions of width ``K`` on keys and values inside
attention, the full layers' with per-token taps, and after attention and the MLP; a relative position bias
per query and key; a log scale per query position), and beside them the decoder keeps a stack of block
states ``[b, s, n, d]`` in its own loop: at a block boundary it appends the hidden states a layer received,
and every layer reads the stack through an attention over a position's own blocks (per position: nothing
crosses positions; :data:`~cpshard.layouts.layout.PER_POSITION_ATTENTION`). Cut at the first layer, the stack
would hold the whole sequence's embeddings beside the later layers' slices, so cp cuts where the sequence
enters the decoder instead (:func:`_enter`, a pre-hook on the decoder; :mod:`cpshard.recurrent.entry`): it
embeds the tokens and builds the masks on the whole sequence with the model's own functions (the padding
mask of the convolutions cut to the rank's positions, the attention masks whole: cp's attention sees whole
sequences), and hands the decoder the rank's slice of the embeddings and of ``position_ids``, and a cache
that holds no past (:class:`_Entry`).
Through that cache the model's own code does the rest: each convolution's state is the previous rank's last
``K - 1`` (masked) inputs (a halo; rank 0 receives the zeros the model pads), and the relative distances it
builds count the rank's queries from its first position against the whole sequence's keys, so each
attention computes its rows of the bias ``[B, H, L/cp, L]`` and of its sinks ``[B, H, L/cp, 1]``, which
cp's attention moves as it moves q (:mod:`cpshard.attention.ulysses`). The sequence is held in contiguous
order (the plan sees to it for recurrent layouts).

Generation: the prefill runs as above; each convolution leaves the prompt's last ``K - 1`` inputs in the
call's ``state_sink`` (as Inkling's), and each attention its keys and values, split over the ranks. A decode
step runs the one new token per row whole: the same pre-hook hands the decoder no masks (cp's decode
attends with the cache's own) and a cache that places the new query at index ``T`` against every index
``0..T`` (:class:`_EntryStep`), so each attention computes the new token's bias row ``[B, H, 1, T + 1]``
(which cp's decode adds to the keys each rank holds) and its sinks ``[B, H, 1, 1]`` (merged once, after
every rank's part: :mod:`cpshard.attention.decode`); each convolution puts its carried inputs in front
(:class:`~cpshard.recurrent.inkling.StepCache`). The block states are per position: the new token's are built
in the step itself, nothing carried. Inkling2-Loop runs its looped layers in several passes, each with its
own cache layers (``cache_offset``): each convolution carries a state per pass
(:func:`~cpshard.recurrent.inkling.conv_state_key`), each attention a cache layer per pass, placed after
every layer's own in the order the forward attends, as the model's own cache appends them.

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from cpshard.call import active_decode, split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.recurrent.entry import entered, model_function
from cpshard.recurrent.inkling import SliceCache, StepCache, no_past_hooks
from cpshard.recurrent.slot import cut_to_rank

#: what the hooks were written against in transformers 5.25.0: Inkling2's file and Inkling2-Loop's
WRITTEN_AGAINST = written_against(__name__)
#: each layer's convolutions
CONVOLUTIONS = (
    "self_attn.k_proj.sconv",
    "self_attn.v_proj.sconv",
    "post_attention_convolution",
    "post_mlp_convolution",
)


def check_inkling2_unchanged(decoder: nn.Module) -> None:
    module, pieces = WRITTEN_AGAINST[type(decoder).__name__]
    check_written_for(
        f"{type(decoder).__name__} (its entry, convolutions and positions served by cpshard)", module, pieces
    )


class _Decoder:
    """What Inkling2's decoder asks of its cache beyond the sizes of its relative distances: no sliding
    layer to size them by, and no cache layers for Inkling2-Loop to copy for its later passes. Its
    convolutions get caches of their own (:func:`inkling2_entry_hooks`): a layer under activation
    checkpointing drops the one it is handed."""

    is_sliding = ()
    layers = ()


class _Entry(_Decoder, SliceCache):
    """The cache Inkling2's decoder reads under cp, for its relative distances: the rank's first position as
    the query offset, the whole sequence as the keys (:class:`~cpshard.recurrent.inkling.SliceCache`'s)."""


class _EntryStep(_Decoder, StepCache):
    """The cache Inkling2's decoder reads in a cp decode step: the new token's query at index ``T`` against
    every index ``0..T`` (:class:`~cpshard.recurrent.inkling.StepCache`'s), so each attention computes the new
    token's bias row; its keys and values pass through to cp's decode over the split cache."""


def _whole_masks(decoder: nn.Module, call, embeds: torch.Tensor, mask, positions: torch.Tensor) -> dict:
    """The decoder's masks by attention type, built on the whole sequence by the model's own functions as
    its forward builds them; the padding mask of the convolutions cut to the rank's positions (they run on
    the rank's slice), the attention masks whole (cp's attention sees whole sequences)."""
    given = dict(
        config=decoder.config, inputs_embeds=embeds, attention_mask=mask, cache=None, position_ids=positions
    )
    masks = {
        kind: model_function(decoder, name)(**given)
        for kind, name in (
            ("full_attention", "create_causal_mask"),
            ("sliding_attention", "create_sliding_window_causal_mask"),
            ("linear_attention", "create_recurrent_attention_mask"),
        )
    }
    if masks["linear_attention"] is not None:
        masks["linear_attention"] = cut_to_rank(masks["linear_attention"], call)
    return masks


def _check_inputs(decoder: nn.Module, args, kwargs) -> None:
    """Raise for inputs cp does not cut or carry: it builds the masks and the cache itself."""
    if args or kwargs.get("cache") is not None or isinstance(kwargs.get("attention_mask"), dict):
        raise ValueError(
            f"{type(decoder).__name__}: inputs by position, a cache or masks built by hand in a cp forward; "
            "cp serves Inkling2's training forward on token ids (or embeddings) and a 2D padding mask, and "
            "carries its cache itself in generation (cpshard.generate, or make_cp_prefill and make_cp_decode)"
        )


def _step(layers_path: str, step, kwargs) -> tuple:
    """The decoder's inputs in a cp decode step: the one new token per row whole, no masks (cp's decode
    attends over the split cache with the cache's mask; a new token is never padding, so the model builds
    no convolution mask either), and the cache through which it places the new token (:class:`_EntryStep`)."""
    masks = dict.fromkeys(("full_attention", "sliding_attention", "linear_attention"))
    return (), {**kwargs, "attention_mask": masks, "cache": _EntryStep(step, layers_path)}


def _enter(layers_path: str, decoder: nn.Module, args, kwargs):
    """The decoder's inputs cut to this rank where the sequence enters it (see the module's docstring); in
    a cp decode step, the new tokens whole (:func:`_step`)."""
    call, step = split_call(), active_decode()
    if call is None and step is None:
        return None
    _check_inputs(decoder, args, kwargs)
    if call is None:
        return _step(layers_path, step, kwargs)
    cut = entered(decoder, kwargs, call, partial(_whole_masks, decoder, call))
    return (), {**cut, "cache": _Entry(call, cut["inputs_embeds"].shape[1], layers_path)}


def inkling2_entry_hooks(decoder: nn.Module, layers: nn.ModuleList, layers_path: str) -> list[Hook]:
    """The pre-hook that cuts the sequence where it enters Inkling2's ``decoder``, and its ``layers``' (at
    ``layers_path``) convolutions' caches of their own."""
    check_inkling2_unchanged(decoder)
    convolutions = [
        no_past_hooks(layer, f"{layers_path}.{i}", CONVOLUTIONS) for i, layer in enumerate(layers)
    ]
    return [
        Hook(decoder, partial(_enter, layers_path), pre=True),
        *(h for hooks in convolutions for h in hooks),
    ]
