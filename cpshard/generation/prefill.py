"""``make_cp_prefill``: a prompt run under cp into a KV cache that stays split over the cp ranks.

The prompt runs as in ``cp_forward`` (Ulysses, ring or hybrid, the model's own masks), and each attention
layer leaves this rank's keys and values (those of its own sequence shard) in the call's ``kv_sink``: no
rank ever holds the whole cache (:mod:`cpshard.attention.kv_cache`). The model's head runs on the last
real position of each row alone, on the rank that holds it, and one all-reduce of ``[B, V]`` brings those
logits to every rank.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import replace

import torch
from torch.distributed.tensor import DTensor
from transformers.cache_utils import get_layer_types_and_kwargs

from cpshard.attention.kv_cache import ShardedKVCache, prefill_cache
from cpshard.comm.collectives import sum_over_group
from cpshard.layouts.family_attention import score_bias
from cpshard.layouts.layout import ENTERED_DECODERS
from cpshard.layouts.registry import resolve_layout
from cpshard.parallel.mesh import cp_rank
from cpshard.runtime.batch import BatchError, validate
from cpshard.runtime.forward import CPForward, running_call
from cpshard.runtime.install import attention_modules, ensure_installed
from cpshard.runtime.plan import CPOptions, plan_call
from cpshard.spec.sequence import chunk_positions, positions

#: the cache layers of transformers' DynamicCache that a split cache serves (and "linear_attention", whose
#: states the cache carries whole, where the layout has recurrent rows)
SERVED_LAYER_TYPES = ("full_attention", "sliding_attention")
PROMPT_KEYS = ("input_ids", "attention_mask")
#: why cp generation does not serve the decoders cut where the sequence enters them, by class
#: (:data:`~cpshard.layouts.layout.ENTERED_DECODERS`)
_NOT_GENERATED = {
    "HrmTextModel": "HRM's decoder (its cache holds a layer per stack pass, which cp's split cache does not "
    "place)",
    "XLMModel": "XLM (its model makes a new cache in every forward and returns none, and its generation "
    "appends a mask token to every step's ids: no cache for cp's split cache to follow)",
    "ProphetNetDecoder": "ProphetNet (its n-stream attention keeps its own cache of the main stream's keys "
    "and builds its relative-position buckets from the cache's length)",
    "ReformerModel": "Reformer (its cache keeps the hidden states and LSH buckets of every past position, "
    "which its one-token step re-hashes and attends over whole)",
    "BltModel": "BLT (its cache holds its byte stacks' keys alone: a step's global transformer sees that "
    "step's patches only, with no past that cp's split cache could place)",
}


def check_servable(model, layout) -> None:
    """Raise, naming what to change, for a model cp generation does not serve (at setup: every rank
    prepares the same model, so every rank raises alike)."""
    if layout.sparse_attention:
        pools = any(getattr(m, "compressor", None) is not None for m in attention_modules(model, layout))
        why = (
            "its compressors pool windows of tokens into keys that its own cache layers carry between steps "
            "(the window under way, the last one's overlap, the entries so far), which cp generation's split "
            "cache does not hold"
            if pools
            else "its indexer selects keys per query over the whole cache, which cp generation's split cache "
            "does not hold on any rank"
        )
        raise ValueError(f"{type(model).__name__}: {why}; generate without cp")
    decoder = type(model.get_submodule(layout.decoder)).__name__
    if decoder in ENTERED_DECODERS:
        raise ValueError(
            f"{type(model).__name__}: cp generation does not serve {_NOT_GENERATED[decoder]}; generate "
            "without cp"
        )
    if layout.per_head_params:
        raise ValueError(
            f"{type(model).__name__}: the per-head parameters {layout.per_head_params} (attention sinks) "
            "have no place in the split cache's log-sum-exp merge; cp generation does not serve this model"
        )
    modules = [inner for attention in attention_modules(model, layout) for inner in attention.modules()]
    biased = {bias for module in modules if (bias := score_bias(module, model.config))}
    if biased:
        raise ValueError(
            f"{type(model).__name__} adds {' and '.join(sorted(biased))} to its attention scores, which cp "
            "generation's decode over the split cache does not carry yet; generate without cp"
        )
    if not modules:  # no attention: the split cache holds nothing, the recurrent states all there is
        return
    text_config = model.config.get_text_config(decoder=True)
    served = (
        SERVED_LAYER_TYPES
        + (("linear_attention", "conv", "hybrid", "hybrid_sliding") if layout.recurrent else ())
        + (("dummy",) if layout.pointwise else ())  # a cache layer that holds nothing (MLP, MoE layers)
    )
    types = sorted(set(get_layer_types_and_kwargs(text_config)[0]) - set(served))
    # a hybrid's own cache class holds its recurrent layers' states (MiniMax's), which cp carries itself
    if types or not (model._supports_default_dynamic_cache() or layout.recurrent):
        raise ValueError(
            f"{type(model).__name__} needs its own cache class (layer types {types or 'custom'}); cp "
            f"generation splits a cache of {' and '.join(SERVED_LAYER_TYPES)} layers only"
        )


def layers_of(blocks: list) -> dict[int, int]:
    """The cache's layer number of every module inside each layer's attention module, by ``id(module)``:
    the module that attends may sit inside the layout's (Zamba2's hybrid layer holds it in a block)."""
    return {id(module): number for number, block in enumerate(blocks) for module in block.modules()}


def sunk_layers(blocks: list, sink: dict, names: dict) -> tuple[list, list[str]]:
    """Each cache layer's ``(keys, values, window)`` from the prefill's sink and its name: each layer's by
    the module inside it that attended, then those of the later passes of a module that attended more than
    once, in the order they came (:func:`~cpshard.attention.decode.sink_keys`)."""
    found = [[module for module in block.modules() if id(module) in sink] for block in blocks]
    missing = [
        names[id(block)] for block, attending in zip(blocks, found, strict=True) if len(attending) != 1
    ]
    if missing:
        raise ValueError(f"the prefill saw no keys and values at {missing}: cpshard cannot cache them")
    again = [key for key in sink if isinstance(key, tuple)]
    layers_holding = Counter(id(module) for attending in found for module in attending)
    shared = sorted({names[module] for module, _ in again if layers_holding[module] > 1})
    if shared:
        raise ValueError(
            f"{shared} attended more than once in one forward from more than one layer (a module shared by "
            "layers); cp generation caches one layer per attention module and pass"
        )
    layers = [sink[id(attending[0])] for attending in found] + [sink[key] for key in again]
    return layers, [names[id(block)] for block in blocks] + [f"{names[m]} pass {n + 1}" for m, n in again]


def check_mesh_and_params(mesh, params: dict) -> None:
    """Raise for a mesh or parameters cp generation does not run on (the same on every rank)."""
    others = {n: s for n, s in zip(mesh.mesh_dim_names, mesh.mesh.shape, strict=True) if n != "cp" and s > 1}
    if others:
        raise ValueError(
            f"cp generation runs over the cp dimension alone; this mesh also has {others}: build a mesh "
            "with make_mesh(cp=...) for generation"
        )
    if any(isinstance(value, DTensor) for value in params.values()):
        raise ValueError(
            "cp generation takes the plain parameters (cpshard.params_of(model) before cpshard.parallelize): "
            "each rank computes every decoded token with whole weights"
        )


def prompt_inputs(batch: dict) -> tuple[dict, torch.Tensor]:
    """The model's inputs (``input_ids`` and ``attention_mask`` as given, ``position_ids`` as transformers'
    ``generate`` makes them (each row's real tokens counted from 0, padding at 0)) and the 2-D mask (all
    ones when the batch has none: then the model needs none, and builds no ``L x L`` mask)."""
    validate(batch)
    unknown = sorted(set(batch) - set(PROMPT_KEYS))
    if unknown:
        raise BatchError(f"a prompt batch holds {' and '.join(PROMPT_KEYS)} only, got also {unknown}")
    ids = batch.get("input_ids")
    if ids is None:
        raise BatchError("a prompt batch takes input_ids (token ids; generation appends tokens to them)")
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask.long()
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise BatchError("batch['attention_mask'] must hold 1 for a real token and 0 for padding")
    empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
    if empty:
        raise BatchError(f"rows {empty} of the prompt have no real token (attention_mask all 0)")
    inputs = {"input_ids": ids, "position_ids": (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)}
    return inputs | ({"attention_mask": mask} if "attention_mask" in batch else {}), mask


def check_left_padded(mask: torch.Tensor) -> None:
    """A recurrent layer hands on its state after the prompt's last column, so a row's padding must come
    before its tokens (as transformers' generate asks of every decoder): raise for a right-padded row."""
    late = ((mask.cummax(1).values == 1) & (mask == 0)).any(1).nonzero().flatten().tolist()
    if late:
        raise BatchError(
            f"rows {late} of the prompt have padding after a real token; a model with recurrent layers "
            "carries its state on from the prompt's last column: pad prompts on the left"
        )


def last_real(mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the index of each row's last real token."""
    return mask.shape[1] - 1 - mask.flip(1).argmax(1)


def rows_at(logits: torch.Tensor, kept: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """``[B, V]``: row b's logits at position ``last[b]`` where this rank kept it (``logits`` ``[B, k, V]``
    at positions ``kept``), else 0."""
    match = kept[None, :] == last[:, None]
    if not kept.numel():
        return logits.new_zeros(logits.shape[0], logits.shape[2])
    picked = logits[torch.arange(logits.shape[0]), match.long().argmax(1)]
    return torch.where(match.any(1, keepdim=True).to(logits.device), picked, 0.0)


class CPPrefill:
    """A cp prefill for one model: ``cp_prefill(params, batch, mesh) -> (logits [B, V], cache)``. It plans
    each call as the training forward does (:func:`cpshard.runtime.plan.plan_call`) and runs the model
    under that plan without gradients, keeping each attention's keys and values."""

    def __init__(self, model, layout, options: CPOptions):
        check_servable(model, layout)
        self.model, self.layout = model, layout
        #: the training forward of the same model, layout and implementation: it installs cpshard's pieces,
        #: and the probe verifies a derived layout through it (losses, logits and gradients, which a prefill
        #: does not give; a layout it verified stays verified)
        self.training_forward = CPForward(model, layout, options)
        self.attention = attention_modules(model, layout)
        # a decoder that reads logits_to_keep itself (Gemma4 slices its inputs with it) would read this
        # rank's indices as the whole sequence's: such a model gets its local logits whole, then the rows
        decoder = model.get_submodule(layout.decoder)
        self.head_keeps_rows = "logits_to_keep" not in inspect.signature(decoder.forward).parameters

    def __call__(self, params: dict, batch: dict, mesh) -> tuple[torch.Tensor, ShardedKVCache]:
        check_mesh_and_params(mesh, params)
        try:  # raised after the batch is checked the same on every rank, so that every rank raises
            (prompt, mask), error = prompt_inputs(batch), None
            if self.layout.recurrent:
                check_left_padded(mask)
        except BatchError as raised:
            prompt, mask, error = batch, None, raised
        failed = self.training_forward.check_call(params, mesh)
        names = self.training_forward.module_names
        options = self.training_forward.options
        call, padded = plan_call(self.model, self.layout, options, names, params, prompt, mesh, failed)
        ensure_installed(self.model, self.layout, tp=1)
        if error is not None:
            raise error
        if self.layout.recurrent and call.cp_size == 1:
            raise ValueError(
                f"{type(self.model).__name__}: cp generation carries recurrent states from a prefill split "
                "over cp > 1 ranks; at cp=1 nothing is split: use the model's own generate"
            )
        call = replace(call, kv_sink={}, state_sink={})
        cp, group = call.cp_size, mesh.get_group("cp")
        rank = cp_rank(mesh)
        held, last = chunk_positions(padded.length, cp, rank), last_real(mask).cpu()  # positions: CPU
        keep = (held[:, None] == last[None, :]).any(1).nonzero().flatten()
        inputs = {**padded.model_inputs, "use_cache": False}
        if self.head_keeps_rows:
            inputs["logits_to_keep"] = keep
        with torch.no_grad(), running_call(self.model, call, inputs):
            local = torch.func.functional_call(self.model, params, (), inputs, strict=False, tie_weights=True)
            # a model may ignore logits_to_keep (xLSTM takes any keyword): then it gave every position's
            kept = local.logits if local.logits.shape[1] == keep.numel() else local.logits[:, keep]
            logits = sum_over_group(rows_at(kept, held[keep], last), group, name="last logits")
        layers, layer_names = sunk_layers(self.attention, call.kv_sink, names)
        cache = prefill_cache(
            layers,
            [positions(call.order, call.padded_length, cp, r) for r in range(cp)],
            mask,
            prompt["position_ids"],
            group,
            layer_names,
        )
        return logits, replace(cache, recurrent=dict(call.state_sink))


def make_cp_prefill(model, *, layout="auto", implementation="auto") -> CPPrefill:
    """Prepare ``model`` once and return its ``cp_prefill(params, batch, mesh) -> (logits, cache)``: the
    logits ``[B, V]`` of each row's last real token, the same on every rank, and the
    :class:`~cpshard.attention.kv_cache.ShardedKVCache` split over the cp ranks. ``batch``: ``input_ids``
    and optionally a 2-D ``attention_mask`` (left or right padding). Inference: nothing is differentiated."""
    # checked before the layout is resolved. A prefill hands on each recurrent layer's state: its delta rules
    # and SSD scans pass states whatever the scheme (the head split would gather them again), Mamba1's
    # channel split gathers its final states
    options = CPOptions(implementation=implementation)
    return CPPrefill(model, resolve_layout(model, layout), options)
