"""Attention that selects its keys per query inside its module, under cp: the queries stay, the keys gather.
DeepSeek's sparse attention (DSA: deepseek_v32, glm_moe_dsa, axk2, dots3_note; hy_v4 with sinks, a gate and
layers that reuse the previous indexer's top-k), Doge's dynamic mask (each head keeps its ``keep_window_size``
highest-scored keys per query, scored from every key's value), and Kolibri 1.1's indexed layers (NoPE; a
weightless indexer picks blocks of keys into a pool, then keys from the pool, sinks and local keys besides;
later indexed layers may reuse an earlier one's keys, values and pool; its sliding layers are cp's ordinary
attention), and DeepSeek-V4's compressed layers (below). What each class hands its cache, and so what is
gathered, is :data:`GATHERS`.

A lightning indexer scores every key for each query, sums the scores over its own heads and keeps a top-k;
the sum over indexer heads comes before the top-k, so a head split does not fit. Under cp each rank keeps
its queries and gathers the key side whole, in sequence order: the compressed latent and the rope key the
module hands its cache (``cache.update``; their gradients come back reduce-scattered) and the indexer's key
(``cache.update_indexer``; the indexer runs without gradients). A cache of no past that gathers
(:class:`WholeKeys`) puts them in place, and the module's attention mask is cut to the rank's query rows.
The module then runs its own code: it scores its queries against every key, selects what one process selects
for them, expands the keys and calls the attention function, which cp passes through (its queries are the
rank's, its keys whole: nothing to exchange). Each rank holds ``[B, L/cp, indexer heads, L]`` scores, a
cp-th of one process's. Bytes a layer and rank: ``B x L/cp x (latent + rope + indexer key)`` elements
forward, the latent and rope key's gradients backward (Doge and Kolibri: its keys and values, both ways).
Every query's selection depends on its own row of the mask and the whole keys alone, so it is one process's
on any sequence order (Kolibri's pool zeroes, in its block averages, keys no query of the rank sees where one
process zeroes those no query sees: the rank's extra ones lie past each of its queries' last key, in blocks
its scoring sets to 0 or hides for that query).

DeepSeek-V4's compressed layers (CSA: a compressor and a lightning indexer over its compressed keys; HCA: a
compressor alone) pool windows of ``compress_rate`` tokens into compressed keys, which every query then sees
beside its sliding window of keys (CSA: the top-k its indexer selects). The module hands its cache its one key
(which is its value): gathered whole, as above. Its compressor and indexer read the cache layer
``cache.layers[layer_idx]``, :class:`~cpshard.attention.compressed.CompressedWindows`: each rank pools the
windows that end in its slice with the model's own code, from its tokens and a halo of the tokens before its
slice, and the ranks gather the pooled entries (a ``compress_rate``-th as many as the tokens), in window
order: the module's own code then scores the rank's queries (their ``position_ids``, global, say which
entries each sees) against every entry. Bytes a layer and rank: ``B x L/cp x head_dim`` (the key), the halo
and the entries (:mod:`~cpshard.attention.compressed`); backward, the key's and the compressor's gradients.
Its sliding layers are cp's ordinary attention (Ulysses: their sinks leave the ring no place).

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from cpshard.attention.compressed import CompressedWindows
from cpshard.call import CallPlan, split_call
from cpshard.comm.collectives import gathered
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import SELECTING_WITH, gathers_keys
from cpshard.spec.sequence import positions

#: what the hooks, the cache and the selection were written against in transformers 5.25.0, by attention class
WRITTEN_AGAINST = written_against(__name__)


class Gathers(NamedTuple):
    """What a module of a sparse attention class hands its cache, which cp gathers whole: ``update``, the
    pair it hands ``cache.update`` (named so in the communication record; their gradients come back
    reduce-scattered; one key where it is the value too), and, where its indexer has a key, that key
    (``cache.update_indexer``, no gradient); DeepSeek-V4's compressor and indexer pool their windows
    (:mod:`~cpshard.attention.compressed`). ``only_with``: where not all the class's modules select keys, the
    attribute those that do have set (:data:`~cpshard.layouts.layout.SELECTING_WITH`; the others run cp's
    ordinary attention over their own slice: their keys are not gathered)."""

    update: str
    only_with: str | None = None


#: what each sparse attention class gathers (:data:`~cpshard.layouts.layout.SPARSE_ATTENTION`): DeepSeek's
#: compressed latent and rope key, or the keys and values themselves (Doge's dynamic mask, Kolibri 1.1's NoPE
#: indexed layers, whose sliding layers have no indexer and are cp's ordinary attention), or DeepSeek-V4's one
#: key (its compressed layers'; its sliding layers are cp's ordinary attention)
GATHERS = {
    name: Gathers(update, SELECTING_WITH.get(name))
    for name, update in {
        "DeepseekV32Attention": "latent and rope key",
        "GlmMoeDsaAttention": "latent and rope key",
        "AXK2Attention": "latent and rope key",
        "Dots3NoteTextAttention": "latent and rope key",
        "HYV4Attention": "latent and rope key",
        "DogeAttention": "key and value",
        "Kolibri1_1Attention": "key and value",
        "DeepseekV4Attention": "key",
    }.items()
}


def check_sparse_attention_unchanged(class_name: str) -> None:
    check_written_for(f"{class_name} (its keys gathered by cpshard)", *WRITTEN_AGAINST[class_name])


def attend_selected(function, module, query, key, value, attention_mask, indices=None, **kwargs):
    """The model's attention over the keys its indexer selected (``indices`` ``[B, S, k]``), as its eager and
    sdpa paths select them: a module sees cpshard's implementation name, not "sdpa" or "eager", and so hands
    the indices to the attention function (for a kernel that takes them) instead of folding them into its
    mask; this folds them in its way (its code is fingerprinted). Under cp its queries are the rank's and its
    keys whole: nothing to exchange."""
    if indices is not None:
        batch, _, rows, _ = query.shape
        hidden = (
            indices.new_ones((batch, rows, key.shape[2]), dtype=torch.bool)
            .scatter(-1, indices.long(), False)
            .unsqueeze(1)
        )
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & ~hidden
        else:
            attention_mask = attention_mask.masked_fill(hidden, torch.finfo(query.dtype).min)
    return function(module, query, key, value, attention_mask, **kwargs)


def selects_keys(module: nn.Module, call: CallPlan | None) -> bool:
    """Whether ``module`` is a sparse attention module (served by :func:`attend_selected`); under a cp call
    whose layout does not gather its keys, an error (its queries and keys would be the rank's alone)."""
    if not gathers_keys(module):
        return False
    if call is not None and not call.layout.sparse_attention:
        raise ValueError(
            f"{call.name_of(module)} selects its keys per query (an indexer, a compressor), and the layout "
            f"{call.layout.name!r} does not gather them (sparse_attention): use the derived layout "
            "(layout='auto')"
        )
    return True


def _sequence_order(call: CallPlan) -> torch.Tensor:
    """Where each position of the ranks' slices, gathered in rank order, lies in the sequence."""
    size = call.cp_size
    held = torch.cat([positions(call.order, call.padded_length, size, r) for r in range(size)])
    return torch.argsort(held)


class WholeKeys:
    """The cache a sparse attention module reads under cp: no past; what it hands on gathered over the cp
    ranks into the whole sequence's, in order, without cp's padding: each query's row of indexer scores is
    then one process's row, value for value, and its top-k breaks ties (many scores are exactly 0 after the
    indexer's ReLU) as one process's does. For DeepSeek-V4's compressed layers, its cache layer
    (``cache.layers[layer_idx]``) is :class:`~cpshard.attention.compressed.CompressedWindows`."""

    def __init__(self, call: CallPlan, path: str, update: str, module: nn.Module):
        self.call, self.path, self.what = call, path, update
        compressing = getattr(module, "compressor", None) is not None
        self.layers = {module.layer_idx: CompressedWindows(call, path, module)} if compressing else {}

    def _whole(self, parts: list[torch.Tensor], dim: int, what: str, gradient: bool) -> list[torch.Tensor]:
        call = self.call
        whole = gathered(parts, dim, call.mesh.get_group("cp"), self.path, what, gradient)
        order = call.shared(("sequence order",), lambda: _sequence_order(call)).to(whole[0].device)
        return [x.index_select(dim, order[: call.length]) for x in whole]

    def update(self, key_states, value_states, layer_idx: int, kwargs=None):
        """The pair the module hands on ``[B, heads, L/cp, d]`` (the compressed latent and the rope key, or
        the keys and values), whole; one gathered where the key is the value too (DeepSeek-V4's)."""
        if key_states is value_states:
            key = self._whole([key_states], 2, f"{self.path} {self.what}", True)[0]
            return key, key
        return tuple(self._whole([key_states, value_states], 2, f"{self.path} {self.what}", True))

    def update_indexer(self, key, layer_idx: int):
        """The indexer's key ``[B, L/cp, d]``, whole."""
        return self._whole([key], 1, f"{self.path} indexer key", False)[0]


def _whole_keys(path: str, update: str, module, args, kwargs):
    call = split_call()
    if call is None:
        return None
    if kwargs.get("cache") is not None:
        raise ValueError(f"{path}: a cache in a cp forward; cp serves sparse attention in training")
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(
            f"{path}: cp needs the whole [B, 1, L, L] mask the indexer scores with, got {mask!r}"
        )
    if mask.shape[-2:] != (call.padded_length, call.padded_length):
        raise ValueError(f"{path}: a mask of {tuple(mask.shape)} for a sequence of {call.padded_length}")
    rank, size = call.mesh.get_local_rank("cp"), call.cp_size
    rows = positions(call.order, call.padded_length, size, rank).to(mask.device)
    cut = mask.index_select(2, rows)[..., : call.length]
    return args, {**kwargs, "attention_mask": cut, "cache": WholeKeys(call, path, update, module)}


#: inside each sparse attention class, the modules whose output carries no gradient (DeepSeek-V4's CSA
#: indexer: the indices of its top-k), which cp runs without autograd (their code is fingerprinted above)
UNDIFFERENTIATED = {"DeepseekV4Attention": "compressor.indexer"}


def undifferentiated_modules(layers: nn.ModuleList, paths: tuple[str, ...]) -> list[nn.Module]:
    """The modules of :data:`UNDIFFERENTIATED` in the sparse attention modules at ``paths`` of ``layers``
    (their intermediate tensors, ``[B, L/cp, indexer heads, L/rate]`` scores among them, are then kept for
    no backward)."""
    found = []
    for layer in layers:
        for path in paths:
            module = layer.get_submodule(path)
            inner = UNDIFFERENTIATED.get(type(module).__name__)
            if inner is not None and gathers_keys(module):
                try:
                    found.append(module.get_submodule(inner))
                except AttributeError:  # an HCA layer's compressor has no indexer
                    continue
    return found


def sparse_attention_hooks(layers: nn.ModuleList, layers_path: str, paths: tuple[str, ...]) -> list[Hook]:
    """The pre-hook of each layer's sparse attention module (at ``paths`` inside it; checked against its
    code first) that selects its keys."""
    hooks = []
    for index, layer in enumerate(layers):
        for path in paths:
            module = layer.get_submodule(path)
            name = type(module).__name__
            check_sparse_attention_unchanged(name)
            if gathers_keys(module):
                where = f"{layers_path}.{index}.{path}"
                hooks.append(Hook(module, partial(_whole_keys, where, GATHERS[name].update), pre=True))
    return hooks
