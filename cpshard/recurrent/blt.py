"""BLT (``BltForCausalLM``, the Byte Latent Transformer) under cp: its bytes cut over cp, and its patches.

BLT runs three stacks over two sequences: a local encoder over the bytes, a global transformer over
patches (runs of consecutive bytes, each pooled from the encoder's states of its bytes), and a local decoder
over the bytes again, which cross-attends to the patches; a frozen byte LM (the patcher) starts a patch
where its next-byte entropy is high. Each stack attends causally over its own sequence, so cp cuts both
sequences, and moves states only where they meet:

- the patches are one process's: their lengths from the model's own code on the batch's real bytes, whole
  on every rank (the patcher, frozen and without gradient, runs whole and keeps nothing: a boundary is a
  threshold on an entropy, which any other arithmetic could move by a rounding), so each byte's patch, the
  count ``P`` and the patch each byte reads are the same on every rank as in one process;
- the bytes are cut over cp (contiguous): the hash embeddings of the rank's bytes (from the bytes before
  them that its byte-group hashes read), the encoder's and decoder's layers on the rank's rows, under cp's
  attention over the byte sequence (the call's own);
- the patches are cut over cp too, ``ceil(P / cp)`` a rank: the global transformer runs on the rank's
  patches under cp's attention over the patch sequence (a call of the patches' length, :func:`_patch_call`);
- where the two meet, states are all-gathered with their gradient: the encoder's byte states at its
  cross-attention (a patch pools its bytes and attends to them; of a crossing after every layer, the last:
  each replaces the one before unread), and the decoder's projected patch states once (a byte attends to
  one patch's ``cross_attn_k`` keys). Each cross-attention runs the module's own forward on the rank's
  queries, the model's own attention function outside the call, over the keys those queries can see: the
  bytes the rank's patches hold, the patches the rank's bytes read. The keys left out are keys the model's
  mask hides from each of those queries, so every softmax is one process's.

Bytes a step and rank (:func:`gathered_bytes`): ``B * L/cp * d_encoder`` into an all-gather at the encoder's
cross-attention and ``B * P/cp * k * d_decoder`` into one for the decoder (their gradients
reduce-scattered, ``cp`` times those), beside Ulysses' all-to-alls in every layer of the three stacks.

A patch with no bytes attends to none, and the model's mask then spreads its attention over every byte of
the sequence, later ones too: one process's patch past the last byte (where every byte is a patch), and
those past a row's last patch (rows hold as many patches as the row with most). No byte reads those, and
cp gives them the keys of their span, so that they stay finite; an empty patch that a byte reads (given
patch lengths with a zero among them) is refused: the model is not causal there. Refused too, on every rank:
a cache (and generation), per-layer outputs, a rope type that rescales by the longest position (each stack's
rotary pair is computed on the rank's positions).

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpshard.call import CallPlan, running, split_call
from cpshard.comm.collectives import gathered
from cpshard.comm.redistribute import redistribute
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.recurrent.entry import check_rope_per_position, model_function, named_inputs
from cpshard.recurrent.slot import cp_group, cut_to_rank

#: what the forward below restates, in transformers 5.25.0: the model's forward and its patch ids, the
#: encoder (its pooling), the global transformer, the decoder, the cross-attention, the byte-group hashes
#: (how far back they read) and the patches' cross-attention mask (its rows and columns), the causal LM
WRITTEN_AGAINST = written_against(__name__)
#: the configs of the stacks that attend under cp (the patcher runs whole)
STACKS = ("encoder_config", "global_config", "decoder_config")


def check_blt_unchanged(model: nn.Module) -> None:
    """Raise where the installed BLT code is not the code cp was written for, or where a stack's rotary pair,
    which cp computes on the rank's positions, is not per position."""
    check_written_for("BltModel (its bytes and its patches cut over cp)", *WRITTEN_AGAINST)
    for name in ("local_encoder", "global_transformer", "local_decoder"):
        check_rope_per_position(f"BLT's {name}", getattr(model, name).rotary_emb)


@dataclass(frozen=True)
class Patching:
    """A batch's patches as one process makes them, and this rank's share of them."""

    #: ``[B, P]``: each patch's length, the model's own
    lengths: torch.Tensor
    #: ``[B, L]``: each real byte's patch, which the encoder pools it into
    encoder_ids: torch.Tensor
    #: ``[B, padded]``: the patch each byte reads in the decoder (cp's padding too: a real patch)
    decoder_ids: torch.Tensor
    #: patches a rank holds, and this rank's first
    share: int
    first: int

    @property
    def count(self) -> int:
        return self.lengths.shape[1]

    @property
    def held(self) -> int:
        """The real patches this rank holds (the rest of its share is cp's padding)."""
        return max(0, min(self.share, self.count - self.first))


def gathered_bytes(config, batch: int, length: int, patches: int, cp: int, itemsize: int = 4) -> dict:
    """What one rank puts into the all-gathers of one forward: the encoder's byte rows at its (last)
    cross-attention, the decoder's projected patch rows (their gradients' reduce-scatters put in ``cp`` times
    these)."""
    encoder, decoder = config.encoder_config, config.decoder_config
    return {
        "encoder": batch * -(-length // cp) * encoder.hidden_size * itemsize,
        "decoder": batch * -(-patches // cp) * config.cross_attn_k * decoder.hidden_size * itemsize,
    }


def _patch_lengths(model: nn.Module, ids, embeds, length: int) -> torch.Tensor:
    """The patch lengths ``BltModel.forward`` makes for the batch's first ``length`` bytes (its branches),
    the patcher run whole, outside the call (the model's own attention)."""
    config = model.config
    if config.patching_mode == "entropy" and model.patcher is not None:
        if ids is None:
            raise ValueError("input_ids is required for entropy-based patching")
        with running(None), torch.no_grad():
            _, lengths, _ = model.patcher(
                ids[:, :length],
                patch_size=config.patch_size,
                threshold=config.patching_threshold,
                max_patch_length=config.max_patch_length,
                patching_batch_size=config.patching_batch_size,
                device=ids.device,
            )
        return lengths
    source = ids if ids is not None else embeds
    ones = torch.ones((source.shape[0], length + 1), dtype=source.dtype, device=source.device)
    return model_function(model, "process_patch_lengths")(ones, config.max_patch_length)


def _patching(model: nn.Module, lengths: torch.Tensor, call: CallPlan) -> Patching:
    share = -(-lengths.shape[1] // call.cp_size)
    return Patching(
        lengths,
        model._patch_ids_from_lengths(lengths, call.length),
        model._patch_ids_from_lengths(lengths[:, 1:], call.padded_length),
        share,
        dist.get_rank(cp_group(call)) * share,
    )


def _check_read_patches(patching: Patching, length: int) -> None:
    """Raise where a byte reads a patch after (or at) one without bytes: the model's empty patch attends to
    every byte, later ones too, so that it is not causal, and cp gives it other keys."""
    batch, count = patching.lengths.shape
    filled = torch.zeros(batch, count, dtype=torch.bool, device=patching.lengths.device)
    filled.scatter_(1, patching.encoder_ids, True)
    last_read = patching.decoder_ids[:, :length].amax(dim=1, keepdim=True)
    patches = torch.arange(count, device=filled.device)
    empty = (~filled & (patches <= last_read)).nonzero()
    if empty.numel():
        row, patch = (int(i) for i in empty[0])
        raise ValueError(
            f"BLT: patch {patch} of row {row} holds no byte, and bytes read it or a later patch "
            f"(patch lengths {patching.lengths[row].tolist()}): the model's empty patch attends to every "
            "byte of the sequence, later ones too, so it is not causal and cp cannot give one process's "
            "numbers; give patch lengths of at least one byte before the last patch the bytes read"
        )


def _check_call(model: nn.Module, call: CallPlan, inputs: dict) -> None:
    """Raise, on every rank alike, for what cp does not serve (see the module's docstring)."""
    per_layer = ("output_hidden_states", "output_attentions")
    asked = {key for key in ("use_cache", *per_layer) if inputs.get(key)}
    asked |= {"cache"} if inputs.get("cache") is not None else set()
    asked |= {key for key in per_layer if getattr(model.config, key, False)}
    if asked:
        raise ValueError(f"BltModel: {', '.join(sorted(asked))} in a cp forward; cp serves BLT without them")
    if call.ulysses > 1:
        for name in STACKS:
            heads = getattr(model.config, name).num_attention_heads
            if heads % call.ulysses:
                raise ValueError(
                    f"BLT's {name.removesuffix('_config')} stack has {heads} heads, which Ulysses cannot "
                    f"split over {call.ulysses} ranks; choose a cp that divides every stack's heads, or "
                    "implementation='ring'"
                )


def _byte_embeddings(model: nn.Module, ids: torch.Tensor, call: CallPlan) -> torch.Tensor:
    """The encoder's embeddings of this rank's bytes, the model's own ``compute_hash_embeddings`` on them and
    on the bytes before them that its byte-group hashes read (a hash of ``g`` bytes reads ``g - 1`` back)."""
    config = model.config
    rows = call.padded_length // call.cp_size
    start = dist.get_rank(cp_group(call)) * rows
    first = max(0, start - (max(config.encoder_hash_byte_group_size, default=1) - 1))
    embeds = model_function(model, "compute_hash_embeddings")(
        ids[:, first : start + rows],
        model.local_encoder,
        model.encoder_hash_tok_embedding,
        config.encoder_hash_byte_group_nb_functions,
        config.encoder_hash_byte_group_size,
        config.encoder_hash_byte_group_vocab,
    )
    return embeds[:, start - first :]


def _span(inside: torch.Tensor, fallback: int) -> slice:
    """The positions from the first to the last that ``inside`` (``[B, n]``) marks in any row; where it marks
    none, the one position ``fallback`` (an empty patch's keys, which nothing reads: finite, not none)."""
    marked = inside.any(dim=0).nonzero()
    if marked.numel() == 0:
        return slice(fallback, fallback + 1)
    return slice(int(marked[0]), int(marked[-1]) + 1)


def _encoder_patches(model, index: int, hidden, patching: Patching, call: CallPlan, kwargs: dict):
    """The encoder's patch states at its cross-attention layer ``index`` for this rank's patches: the byte
    rows gathered whole, each patch pooled from its bytes (the model's own ``patch_reduce``), projected, and
    attending to the bytes of the rank's patches."""
    encoder, k = model.local_encoder, model.config.cross_attn_k
    attention = encoder.cross_attn_layers[index]
    path = call.name_of(attention)
    whole = gathered([hidden], 1, cp_group(call), path, f"{path} bytes")[0][:, : call.length]
    first, held = patching.first, patching.held
    pooled = encoder.patch_reduce(whole, patching.count, patching.encoder_ids)[:, first : first + held]
    queries = encoder.patch_embedding_projection(pooled)
    queries = queries.reshape(whole.shape[0], held * k, encoder.config.hidden_size)
    if held == 0:  # cp's padding only: no query (the model's attention takes none)
        return queries
    ids = patching.encoder_ids
    span = _span((ids >= first) & (ids < first + held), call.length - 1)
    mask = model_function(model, "_prepare_patch_cross_attention_mask")(
        patch_ids=ids[:, span] - first,
        num_patches=held,
        sequence_length=span.stop - span.start,
        patches_as_queries=True,
        cross_attn_k=k,
        dtype=whole.dtype,
    )
    with running(None):  # the model's own attention over keys not split
        attended, _ = attention(
            hidden_states=queries, cross_attention_states=whole[:, span], attention_mask=mask, **kwargs
        )
    return queries + attended


def _encoder(model, embeds, patching: Patching, mask, positions, call: CallPlan, kwargs: dict):
    """``BltLocalEncoder.forward`` on this rank's bytes and patches: its byte rows and the rank's patch
    states ``[B, held, k * d]``. With ``cross_attn_all_layers`` the model pools and cross-attends after every
    layer, each time from that layer's byte states, and each crossing replaces the one before unread: cp
    runs the last layer's alone (the one whose states reach the global transformer)."""
    encoder = model.local_encoder
    config = encoder.config
    hidden = F.dropout(embeds, p=config.dropout, training=encoder.training)
    position_embeddings = encoder.rotary_emb(hidden, positions)
    hidden = F.dropout(hidden, p=config.dropout, training=encoder.training)
    for layer in encoder.layers:
        hidden = layer(
            hidden, position_embeddings=position_embeddings, attention_mask=mask, cache=None, **kwargs
        )
    at = len(encoder.layers) - 1 if config.cross_attn_all_layers else 0
    patches = _encoder_patches(model, at, hidden, patching, call, kwargs)
    k = model.config.cross_attn_k
    return hidden, patches.view(hidden.shape[0], patching.held, k * config.hidden_size)


def _patch_call(call: CallPlan, patching: Patching) -> CallPlan:
    """The call as the global transformer sees it: a sequence of the patches' length, cut into shares."""
    return replace(call, length=patching.count, padded_length=patching.share * call.cp_size, derived={})


def _global(model, patches, patching: Patching, call: CallPlan, kwargs: dict):
    """``BltGlobalTransformer`` on this rank's share of the patches (cp's padding zero), under cp's
    attention over the patch sequence; its causal mask and positions as the model makes them, whole."""
    batch, share = patches.shape[0], patching.share
    rows = F.pad(patches, (0, 0, 0, share - patching.held))
    within = _patch_call(call, patching)
    whole = rows.new_zeros(()).expand(batch, within.padded_length, rows.shape[-1])  # its shape only
    mask = model_function(model, "create_causal_mask")(
        config=model.config, inputs_embeds=whole, attention_mask=None, cache=None, position_ids=None
    )
    positions = torch.arange(patching.first, patching.first + share, device=rows.device).unsqueeze(0)
    with running(within):
        return model.global_transformer(
            inputs_embeds=rows, attention_mask=mask, position_ids=positions, **kwargs
        )


def _decoder(model, hidden, states, patching: Patching, mask, positions, call: CallPlan, kwargs: dict):
    """``BltLocalDecoder.forward`` on this rank's bytes: the rank's patch states projected and gathered whole,
    each byte attending to the patches the rank's bytes read."""
    decoder, k = model.local_decoder, model.config.cross_attn_k
    width, path = decoder.config.hidden_size, call.name_of(decoder)
    projected = decoder.patch_embedding_projection(states)
    whole = gathered([projected], 1, cp_group(call), path, f"{path} patches")[0][:, : patching.count]
    keys = whole.reshape(whole.shape[0], patching.count * k, width)
    read = cut_to_rank(patching.decoder_ids, call)
    low, high = int(read.min()), int(read.max()) + 1
    cross_mask = model_function(model, "_prepare_patch_cross_attention_mask")(
        patch_ids=read - low,
        num_patches=high - low,
        sequence_length=read.shape[1],
        patches_as_queries=False,
        cross_attn_k=k,
        dtype=hidden.dtype,
    )
    keys = keys[:, low * k : high * k]
    position_embeddings = decoder.rotary_emb(hidden, positions)
    hidden = F.dropout(hidden, p=decoder.config.dropout, training=decoder.training)
    for index, layer in enumerate(decoder.layers):
        if index == 0 or decoder.config.cross_attn_all_layers:
            with running(None):  # the model's own attention over keys not split
                attended, _ = decoder.cross_attn_layers[index](
                    hidden_states=hidden, cross_attention_states=keys, attention_mask=cross_mask, **kwargs
                )
            hidden = hidden + attended
        hidden = layer(
            hidden, position_embeddings=position_embeddings, attention_mask=mask, cache=None, **kwargs
        )
    return decoder.norm(hidden)


def _byte_mask(model, sequence: torch.Tensor, dtype: torch.dtype, attention_mask, positions):
    """The bytes' causal mask over the whole (cp-padded) ``sequence`` (ids or embeddings), as
    ``BltModel.forward`` builds it for its embeddings of ``dtype``."""
    config = model.config
    windowed = config.local_attention_window_len is not None
    name = "create_sliding_window_causal_mask" if windowed else "create_causal_mask"
    shape = torch.zeros((), dtype=dtype, device=sequence.device).expand(*sequence.shape[:2], 1)
    return model_function(model, name)(
        config=config.encoder_config,
        inputs_embeds=shape,
        attention_mask=attention_mask,
        cache=None,
        position_ids=positions,
    )


def _model_forward(model: nn.Module, *args, **kwargs):
    """``BltModel.forward`` on this rank's bytes and patches inside a cp call; its own forward elsewhere."""
    call = split_call()
    if call is None:
        return type(model).forward(model, *args, **kwargs)
    inputs = named_inputs(model, args, kwargs)
    _check_call(model, call, inputs)
    ids, embeds = inputs.pop("input_ids", None), inputs.pop("inputs_embeds", None)
    attention_mask, given = inputs.pop("attention_mask", None), inputs.pop("position_ids", None)
    lengths = inputs.pop("patch_lengths", None)
    for key in ("cache", "use_cache"):
        inputs.pop(key, None)
    if lengths is None:
        lengths = _patch_lengths(model, ids, embeds, call.length)
    patching = _patching(model, lengths, call)
    _check_read_patches(patching, call.length)
    rows = (
        _byte_embeddings(model, ids, call)
        if ids is not None
        else redistribute(embeds, *call.layout.hidden, call.mesh)
    )
    sequence = ids if ids is not None else embeds
    positions = given if given is not None else torch.arange(sequence.shape[1], device=sequence.device)[None]
    mask = _byte_mask(model, sequence, rows.dtype, attention_mask, positions)
    positions = cut_to_rank(positions, call)
    hidden, patches = _encoder(model, rows, patching, mask, positions, call, inputs)
    states = _global(model, patches, patching, call, inputs)
    output = _decoder(model, hidden, states, patching, mask, positions, call, inputs)
    return model_function(model, "BaseModelOutputWithPast")(last_hidden_state=output, cache=None)


def blt_entry_hooks(decoder: nn.Module, layers: nn.ModuleList, layers_path: str) -> list[Hook]:
    """BLT's model forward taken (idempotent: outside a cp call it is the class's own); no hooks: the forward
    cuts the bytes and the patches itself."""
    check_blt_unchanged(decoder)
    decoder.forward = partial(_model_forward, decoder)
    return []
