"""Reformer (``ReformerModelWithLMHead``, ``is_decoder=True``) under cp: its heads split over the cp ranks.

Reformer's attention is its own code, per head over the whole sequence: LSH attention hashes every position
by a random rotation per head, sorts by bucket and attends in chunks; local attention lets each chunk see
itself and the chunk before it. Neither is a registry function on one sequence, so cp serves it as
Megatron's tensor parallelism with sequence parallelism serves a layer, the cp ranks as the head axis:

- the sequence is cut where it enters the encoder (embeddings and axial positions happen before, whole),
  and the encoder's stream, its feed-forward blocks and norms, per position, hold the rank's rows;
- each attention all-gathers its input (the layer-normed rows; backward: a reduce-scatter) and runs the
  module's own forward on the whole sequence for this rank's ``heads / cp`` heads (its projections' rows of
  those heads, :class:`HeadShare`); the output projection of those heads gives a partial sum, reduce-scattered
  back to the rank's rows (backward: an all-gather). Bytes per layer and rank, forward and backward alike:
  ``B * L/cp * d`` fp32 into the all-gather and ``B * L * d`` into the reduce-scatter (:func:`layer_bytes`);
- LSH's random rotations are the rows of one process's draw: the hash runs the model's own ``_hash_vectors``
  over every head (the other ranks' heads zero) and keeps this rank's, so it draws the whole
  ``[heads, d, hashes, buckets / 2]`` tensor from the same generator state one process has (``hash_seed``
  reseeds it; without one every rank first takes rank 0's state, one all-gather of it: 5,056 bytes on CPU),
  and leaves the generator as one process does.

The encoder runs its layers under plain autograd (``Y1 = X1 + attention(X2)``, ``Y2 = X2 + feed_forward(Y1)``,
its layers' own seeding kept), not through its reversible function, whose backward recomputes each layer
after the cp call has returned: outside the call's collectives and with the module's own weights, not the
call's parameters, and it leaves the layers' gradients in the modules' ``.grad`` (a functional call of the
model, cp or not, never sees them). The cost: the layers' activations are kept for the backward.

Served: training and eval forwards without a cache, whenever each attention can see one process's
sequence: a length that is a multiple of cp and of the chunk lengths' least common multiple (what Reformer
itself asks of a training batch), or any length whose cp padding is no longer than the shortest chunk (every
layer then attends over the whole sequence, unchunked; each attention runs on the batch's own positions,
cp's padding left out). Refused, on every rank: heads that cp does not divide, a sequence the model pads
itself (eval mode), cp's padding where a layer hashes or chunks, a cache, and the per-layer hidden states or
attention weights.

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

import inspect
import math
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpshard.call import CallPlan, split_call
from cpshard.comm.collectives import all_gather_rows, gathered, scatter_sums
from cpshard.comm.record import expect
from cpshard.comm.redistribute import redistribute
from cpshard.interfaces import Hook, SeenAs
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.recurrent.slot import cp_group, tensor_bytes

#: what the forwards below were written against in transformers 5.25.0: the model's and encoder's forwards,
#: the layer whose arithmetic the encoder restates, and every piece an attention runs on a share of the heads
WRITTEN_AGAINST = written_against(__name__)
#: the projections of an attention module whose output features are heads (LSH: ``query_key``; local: three)
PROJECTIONS = ("query_key", "query", "key", "value")


def check_reformer_unchanged(decoder: nn.Module) -> None:
    """Raise where the installed Reformer code is not the code cp was written for, or its attention is not
    causal (``is_decoder=False``: every position sees later ones)."""
    check_written_for("ReformerModel (its attention split over cp by heads)", *WRITTEN_AGAINST)
    if not all(layer.attention.self_attention.is_decoder for layer in decoder.encoder.layers):
        raise LayoutError(
            "ReformerModel's attention with is_decoder=False attends in both directions; cp serves Reformer "
            "as a causal LM (ReformerModelWithLMHead, is_decoder=True)"
        )


def layer_bytes(batch: int, length: int, hidden: int, cp: int, itemsize: int = 4) -> dict[str, int]:
    """What one rank puts into each collective of one layer's attention, per pass (forward and backward
    alike): its rows into the all-gather, the partial sums of the whole sequence into the reduce-scatter."""
    return {
        "all_gather": batch * length // cp * hidden * itemsize,
        "reduce_scatter": batch * length * hidden * itemsize,
    }


def _chunk_lengths(config) -> list[int]:
    kinds = set(config.attn_layers)
    return [getattr(config, f"{kind}_attn_chunk_length") for kind in ("lsh", "local") if kind in kinds]


def unserved_length(config, length: int, padded_length: int, cp: int) -> str | None:
    """Why the encoder would see another sequence under cp than in one process (None: the same), for a batch
    of ``length`` tokens that cp pads to ``padded_length``."""
    chunks = _chunk_lengths(config)
    multiple, shortest = math.lcm(*chunks), min(chunks)
    if padded_length > shortest and padded_length % multiple:
        return (
            f"the model pads {padded_length} tokens to a multiple of its chunk lengths' least common "
            f"multiple ({multiple}) itself, after cp cut the batch's rows"
        )
    if padded_length > length and padded_length > shortest:
        return (
            f"cp pads {length} tokens to {padded_length} (a multiple of cp={cp}), and Reformer hashes or "
            f"chunks every position, cp's padding too, once the sequence is longer than its shortest chunk "
            f"({shortest})"
        )
    return None


def _check_call(config, hidden: torch.Tensor, call: CallPlan, kwargs: dict) -> None:
    """Raise, on every rank alike, for what cp does not serve (see the module's docstring)."""
    cp, name, heads = call.cp_size, "ReformerEncoder", config.num_attention_heads
    if heads % cp:
        raise ValueError(
            f"Reformer splits its attention over cp by heads: num_attention_heads={heads} does not divide by "
            f"cp={cp}; choose a cp that divides the heads"
        )
    why = unserved_length(config, call.length, call.padded_length, cp)
    if why is None and hidden.shape[1] != call.padded_length:
        why = f"the encoder received {hidden.shape[1]} positions, not the batch's {call.padded_length}"
    if why is not None:
        multiple, shortest = math.lcm(cp, *_chunk_lengths(config)), min(_chunk_lengths(config))
        raise ValueError(
            f"{name}: {why}; pass a batch whose length is a multiple of {multiple} (cp and the chunk "
            f"lengths), or at most {shortest // cp * cp} tokens"
        )
    asked = [
        key
        for key in ("past_buckets_states", "use_cache", "output_hidden_states", "output_attentions")
        if kwargs.get(key)
    ]
    if asked:
        raise ValueError(f"{name}: {', '.join(asked)} in a cp forward; cp serves Reformer without them")


def _encoder_forward(
    encoder: nn.Module, config, hidden_states, attention_mask=None, num_hashes=None, **kwargs
):
    """The encoder on this rank's rows under plain autograd inside a cp call; its own forward elsewhere."""
    call = split_call()
    if call is None:
        return type(encoder).forward(encoder, hidden_states, attention_mask, num_hashes, **kwargs)
    _check_call(config, hidden_states, call, kwargs)
    hidden = redistribute(hidden_states, *call.layout.hidden, call.mesh)
    attended = hidden  # the reversible stream's two halves start as the same embeddings
    for layer in encoder.layers:
        if layer.training:  # the layer's own seeding, as its forward does (its dropout's, the hash's)
            layer._init_attention_seed()
        attention = layer.attention(
            hidden_states=hidden, attention_mask=attention_mask, num_hashes=num_hashes
        )
        attended = attended + attention.hidden_states
        if layer.training:
            layer._init_feed_forward_seed()
        hidden = hidden + layer.feed_forward(attended)
    hidden = encoder.layer_norm(torch.cat([attended, hidden], dim=-1))
    hidden = F.dropout(hidden, p=encoder.dropout, training=encoder.training)
    return _encoder_output(encoder)(
        hidden_states=hidden, all_hidden_states=[], all_attentions=[], past_buckets_states=None
    )


def _encoder_output(encoder: nn.Module):
    return inspect.getmodule(type(encoder)).ReformerEncoderOutput


class HeadShare(SeenAs):
    """An attention module as its forward sees it on one rank: ``share`` of its heads from ``first`` on,
    each projection the rows of those heads; the model's own methods run on this view too (its ``_attend``
    reads the head count), but the hash, which draws the rotations of every head (:func:`_hash_share`), and
    what they set lands on the module."""

    def __init__(self, module: nn.Module, first: int, share: int, group, path: str):
        width = module.attention_head_size
        rows = slice(first * width, (first + share) * width)
        projections = {
            name: partial(_rows_of, getattr(module, name), rows)
            for name in PROJECTIONS
            if hasattr(module, name)
        }
        super().__init__(
            module,
            num_attention_heads=share,
            all_head_size=share * width,
            _hash_vectors=partial(_hash_share, module, slice(first, first + share), group, path),
            **projections,
        )

    def __getattr__(self, name):
        method = getattr(type(self._module), name, None)
        if inspect.isfunction(method):
            return method.__get__(self)
        return getattr(self._module, name)

    def __setattr__(self, name, value):
        """What the model's code sets (LSH's ``num_buckets``, chosen once by length) is set on the module."""
        if name == "_module" or name in self.__dict__:
            object.__setattr__(self, name, value)
        else:
            setattr(self._module, name, value)


def _rows_of(linear: nn.Linear, rows: slice, x: torch.Tensor) -> torch.Tensor:
    """A projection without bias (Reformer's have none) to the output features ``rows`` only."""
    return F.linear(x, linear.weight[rows])


def _agree_on_generator(device: torch.device, group, path: str) -> None:
    """Every rank's default generator for ``device`` set to rank 0's (one all-gather of its state, declared
    for ``path``): the draw that follows is one process's on every rank. A training layer reseeds each rank
    at random (``torch.seed``) before its hash."""
    cuda = device.type == "cuda"
    state = (torch.cuda.get_rng_state(device) if cuda else torch.get_rng_state()).to(device)
    expect(path, "all_gather", "forward", 1, tensor_bytes(state))
    first = all_gather_rows(state, group, f"{path} generator state")[0].cpu()
    if cuda:
        torch.cuda.set_rng_state(first, device)
    else:
        torch.set_rng_state(first)


def _hash_share(
    module: nn.Module, heads: slice, group, path: str, vectors, num_hashes, attention_mask, *args, **kwargs
):
    """The buckets of this rank's ``heads`` as one process hashes them: the model's own ``_hash_vectors``
    over every head (the others' vectors zero), so that it draws every head's rotations, this rank's heads'
    kept."""
    if module.hash_seed is None:
        _agree_on_generator(vectors.device, group, path)
    batch, _, length, width = vectors.shape
    every = vectors.new_zeros(batch, module.num_attention_heads, length, width)
    every[:, heads] = vectors.detach()
    buckets = type(module)._hash_vectors(module, every, num_hashes, attention_mask, *args, **kwargs)
    return buckets[:, heads].contiguous()


def _attention_forward(module: nn.Module, hidden_states, *args, **kwargs):
    """Inside a cp call: the rank's rows gathered whole, the module's own forward on this rank's heads over
    the batch's own positions (cp's padding left out: a query that sees no key, a left-padded row's first,
    averages over every position of the sequence); elsewhere its own forward."""
    call = split_call()
    if call is None:
        return type(module).forward(module, hidden_states, *args, **kwargs)
    group = cp_group(call)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    share, path = module.num_attention_heads // size, call.name_of(module)
    whole = gathered([hidden_states], 1, group, path, f"{path} input")[0]
    mask = kwargs.get("attention_mask")
    if mask is not None:
        kwargs["attention_mask"] = mask[:, : call.length]
    view = HeadShare(module, rank * share, share, group, path)
    return type(module).forward(view, whole[:, : call.length], *args, **kwargs)


def _output_forward(module: nn.Module, hidden_states):
    """Inside a cp call: this rank's heads' part of the output projection (zero at cp's padding), summed over
    the ranks and cut to the rank's rows in one reduce-scatter, then the module's dropout; elsewhere its own
    forward."""
    call = split_call()
    if call is None:
        return type(module).forward(module, hidden_states)
    group = cp_group(call)
    width, rank = hidden_states.shape[-1], dist.get_rank(group)
    partial_sum = F.linear(hidden_states, module.dense.weight[:, rank * width : (rank + 1) * width])
    partial_sum = F.pad(partial_sum, (0, 0, 0, call.padded_length - partial_sum.shape[1]))  # cp's padding
    path, size = call.name_of(module), dist.get_world_size(group)
    expect(path, "reduce_scatter", "forward", 1, tensor_bytes(partial_sum))
    expect(path, "all_gather", "backward", 1, tensor_bytes(partial_sum) // size)
    rows = scatter_sums(partial_sum.transpose(0, 1), group, f"{path} partial sums").transpose(0, 1)
    return F.dropout(rows, p=module.dropout, training=module.training)


def reformer_entry_hooks(decoder: nn.Module, layers: nn.ModuleList, layers_path: str) -> list[Hook]:
    """Reformer's forwards taken (idempotent: each calls its class's own outside a cp call): the encoder's,
    each attention's and each output projection's. No hooks: the encoder cuts the sequence itself."""
    check_reformer_unchanged(decoder)
    decoder.encoder.forward = partial(_encoder_forward, decoder.encoder, decoder.config)
    for layer in layers:
        layer.attention.self_attention.forward = partial(_attention_forward, layer.attention.self_attention)
        layer.attention.output.forward = partial(_output_forward, layer.attention.output)
    return []
