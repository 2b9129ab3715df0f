"""ProphetNet's causal LM (prophetnet) under cp: its streams cut where they enter the first decoder layer, its
n-stream attention run whole on every rank.

ProphetNet's decoder builds, from the whole sequence, a main stream and ``ngram`` predict streams (position
and ngram embeddings), concatenated along the sequence dim ``[B, (1 + n) L, D]``, with the relative-position
buckets of both kinds and both masks, slices of ones of its longest length. Its layers run the n-stream
attention, then norms and an FFN per position; its causal LM reads the predict streams' rows back as
``[B, n, L, D]`` for its head. So cp cuts each stream on its own sequence (the layout's ``hidden``,
``b n s d -> b n s@cp d``) where the streams enter the first layer, and every layer's per-position work holds
the rank's rows of each stream.

No registry function computes the attention (each predict stream attends to the main stream's keys and to
its own position, with relative-position biases from its hidden states), and no share of it is exact: its
forward reshapes its output by the whole model's width, so it runs on all heads or none, and in transformers
5.25 its predict streams' bias reads the rows of its hidden states in another order than its buckets
(``get_predict_relative_pos_embeddings``: rows by position, stream and head against buckets by stream, head
and position), so each query's bias comes from other heads and positions, later ones among them, and depends
on the sequence's length (a token changes the logits of up to half the positions before it). So cp runs it as
it is, on the whole real sequence: each rank's rows are all-gathered into the whole streams (gradient:
reduce-scattered), cp's padding dropped, and the module's own forward runs on them with the decoder's masks,
buckets and positions cut to the real length (as the decoder builds them for it); the rank keeps its rows of
the output. Exact by construction; the attention's compute is not split (ProphetNet's positions are bounded by
``max_position_embeddings``, 512 in its checkpoints, and its decoder builds ``[M, M]`` buckets and masks of
that size in every forward anyway). Bytes a layer and rank: the all-gather of the rank's ``(1 + n) L / cp``
rows of ``D`` forward, the reduce-scatter of the whole streams' gradient backward.

After the last layer each stream's rows are handed back first in a tensor of the sequence's length (the
decoder splits the streams by it; the layout's ``restores_length``), and the head takes the rank's rows again
(:func:`cpshard.runtime.cut.held_rows_only`). The causal LM's loss is every counted stream's against the
same labels (:mod:`cpshard.loss.streams`). Not served, refused by name: encoder states (cross-attention), a
cache and generation, per-layer outputs, label smoothing (``eps > 0``).

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

import torch
from torch import nn

from cpshard.call import CallPlan, split_call
from cpshard.comm.collectives import gathered
from cpshard.comm.redistribute import redistribute
from cpshard.interfaces import Hook
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.fingerprint import check_written_for, written_against

#: what the hooks were written against in transformers 5.25.0: the decoder that builds the streams, the
#: layer and FFN that run per position, the attention run whole, the causal LM's head and loss
WRITTEN_AGAINST = written_against(__name__)


def check_prophetnet_unchanged(config) -> None:
    """Raise where the installed ProphetNet code is not the code the hooks were written for, or where its
    causal LM's loss smooths labels (cp's loss is the streams' cross-entropy alone)."""
    check_written_for("ProphetNet's decoder (its streams cut, its attention run whole)", *WRITTEN_AGAINST)
    if config.eps > 0:
        raise LayoutError(
            f"ProphetNet with eps={config.eps}: cp computes its causal LM's loss as the streams' "
            "cross-entropy, without label smoothing; set config.eps=0.0"
        )


def _streams(hidden: torch.Tensor, streams: int) -> torch.Tensor:
    """``[B, (1 + n) L, D]`` -> ``[B, 1 + n, L, D]``: the streams apart."""
    return hidden.view(hidden.shape[0], streams, -1, hidden.shape[-1])


def _cut(hidden: torch.Tensor, call: CallPlan, streams: int) -> torch.Tensor:
    """The rank's rows of each stream, the streams concatenated again (a slice: no communication)."""
    return redistribute(_streams(hidden, streams), *call.layout.hidden, call.mesh).flatten(1, 2)


def _padded(hidden: torch.Tensor, streams: int, length: int) -> torch.Tensor:
    """Each stream's rows padded with zero rows to ``length``, the streams concatenated again."""
    rows = _streams(hidden, streams)
    return nn.functional.pad(rows, (0, 0, 0, length - rows.shape[2])).flatten(1, 2)


def _gathered(hidden: torch.Tensor, call: CallPlan, streams: int, path: str) -> torch.Tensor:
    """Every rank's rows of each stream, whole and in order, to the sequence's real length (cp's padding
    dropped), in one all-gather (its gradient reduce-scattered back: each rank's rows summed over the ranks
    that used them); its bytes declared for ``path``."""
    group = call.mesh.get_group("cp")
    (whole,) = gathered([_streams(hidden, streams)], 2, group, path, f"{path} streams")
    return whole[:, :, : call.length].flatten(1, 2)


#: the attention's inputs of the decoder's whole (cp-padded) length, by how many runs of keys each holds: its
#: main-stream mask and buckets ``[..., L, L]``, its predict streams' ``[..., L, 2L]`` (the main stream's
#: keys, then the stream's own)
_KEY_RUNS = {
    "attention_mask": 1,
    "main_relative_position_buckets": 1,
    "extended_predict_attention_mask": 2,
    "predict_relative_position_buckets": 2,
}


def _to_length(kwargs: dict, length: int) -> dict:
    """The attention's masks, buckets and positions cut to the sequence's first ``length`` positions (queries,
    and keys in each run), as the decoder builds them for that length: its masks and buckets are slices of
    ones of its longest length, and its positions count from the start."""
    cut = {
        key: kwargs[key][..., :length, :].unflatten(-1, (runs, -1))[..., :length].flatten(-2)
        for key, runs in _KEY_RUNS.items()
        if kwargs.get(key) is not None
    }
    if kwargs.get("position_ids") is not None:
        cut["position_ids"] = kwargs["position_ids"][..., :length]
    return {**kwargs, **cut}


def _check_inputs(decoder: nn.Module, kwargs: dict) -> None:
    """Raise for what cp does not cut or carry: encoder states, a cache, per-layer outputs (the decoder's own
    default where the call gives None)."""
    per_layer = kwargs.get("output_hidden_states")
    given = {
        "encoder_hidden_states (cross-attention)": kwargs.get("encoder_hidden_states") is not None,
        "a cache": kwargs.get("cache") is not None or bool(kwargs.get("use_cache")),
        "output_hidden_states": decoder.config.output_hidden_states if per_layer is None else per_layer,
    }
    refused = [what for what, asked in given.items() if asked]
    if refused:
        raise ValueError(
            f"{type(decoder).__name__}: {', '.join(refused)} in a cp forward; cp serves ProphetNet's causal "
            "LM on token ids (or embeddings) and a padding mask, without them"
        )


def prophetnet_hooks(decoder: nn.Module, layers: nn.ModuleList, layers_path: str) -> list[Hook]:
    """The hooks of ProphetNet's ``decoder`` (see the module's docstring): its inputs checked, the streams cut
    at the first of its ``layers``, each layer's attention run on the gathered streams, the streams handed
    back at the sequence's length after the last layer."""
    check_prophetnet_unchanged(decoder.config)
    streams = 1 + decoder.ngram

    def enter(module, args, kwargs):
        if split_call() is not None:
            _check_inputs(module, kwargs)

    def cut(module, args, kwargs):
        call = split_call()
        if call is None:
            return None
        return (_cut(args[0], call, streams), *args[1:]), kwargs

    def gather(path: str):
        def hook(module, args, kwargs):
            call = split_call()
            if call is None:
                return None
            whole = _gathered(kwargs["hidden_states"], call, streams, path)
            return (), {**_to_length(kwargs, call.length), "hidden_states": whole}

        return hook

    def own_rows(module, args, output):
        call = split_call()
        if call is None:
            return None
        return (_cut(_padded(output[0], streams, call.padded_length), call, streams), *output[1:])

    def hand_back(module, args, output):
        call = split_call()
        if call is None:
            return None
        return (_padded(output[0], streams, call.padded_length), *output[1:])

    attentions = [(f"{layers_path}.{index}.self_attn", layer.self_attn) for index, layer in enumerate(layers)]
    return [
        Hook(decoder, enter, pre=True),
        Hook(layers[0], cut, pre=True),
        *(Hook(attention, gather(path), pre=True) for path, attention in attentions),
        *(Hook(attention, own_rows, pre=False) for _, attention in attentions),
        Hook(layers[-1], hand_back, pre=False),
    ]
