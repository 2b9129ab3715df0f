"""Inkling's decoder layer under cp: its four short convolutions with a halo, its attention at the rank's
positions.

``InklingDecoderLayer`` mixes tokens outside attention in four depthwise causal convolutions of width ``K``
(``k_sconv`` and ``v_sconv`` inside attention, ``attn_sconv`` and ``mlp_sconv`` after it), each behind its
2D padding mask (``conv_mask``), and its attention places the queries from their index in the call
(``arange``, plus the cache's offset): a relative position bias per query and key (zero beyond
``rel_extent``) and, in full layers, a log scale of the query and of that bias per query position.

The model's cached path already does what a slice needs: a convolution puts the cache's last ``K - 1``
inputs in front of its own and drops their outputs, and attention counts its queries from the cache's
offset and its keys from the cache's sizes. Under cp each of these modules gets a cache that holds no past
(:class:`SliceCache`): its convolution state is the previous rank's last ``K - 1`` (masked) inputs
(:func:`~cpshard.recurrent.halo.with_halo`; rank 0 receives the zeros the model pads), its query offset the
rank's first position, and its keys the whole sequence's, so the model computes the rank's rows of the bias
``[B, H, L/cp, L]`` and its log scale at their true positions. cp's attention moves those rows as it moves
q (:mod:`cpshard.attention.ulysses`). Each convolution's padding mask is cut to the rank's positions. The
sequence is held in contiguous order (the plan sees to it for recurrent layouts).

Generation: a prefill runs as above and each convolution also leaves the last ``K - 1`` inputs of the prompt
in the call's ``state_sink`` (:func:`~cpshard.recurrent.slot.last_inputs`: one all-reduce from the rank
that holds the prompt's last token); the keys and values stay split over the ranks as for any attention.
A decode step runs the model's own cached path for the one new token with a cache per module
(:class:`StepCache`): each convolution puts its carried inputs in front; attention places its query at index
``T`` (the cache's length) against every index ``0..T``, so the model computes the new token's bias row
``[B, H, 1, T + 1]`` and its log scale at its true index, and hands it to the attention function, where cp's
decode adds to each rank's partial scores the columns of the keys that rank holds
(:mod:`cpshard.attention.decode`).

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup. The
bias costs ``B x H x L/cp x L`` floats a layer and rank, moved once each way (the model's own sdpa and eager
paths hold it whole: ``B x H x L x L``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import active_decode, split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import INKLING
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.slot import carried_state, cp_group, cut_to_rank, last_inputs, sink_state

#: what the hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = written_against(__name__)


def check_inkling_unchanged() -> None:
    check_written_for(f"{INKLING} (its convolutions and positions served by cpshard)", *WRITTEN_AGAINST)


class SliceCache:
    """The cache an Inkling module reads under cp: no past; the rank's first position as the query offset,
    the whole sequence as the keys, and each convolution's state the previous rank's last inputs."""

    def __init__(self, call, held: int, path: str, offset: int = 0):
        self.call, self.group, self.held, self.path, self.offset = call, cp_group(call), held, path, offset

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None  # no one-token update: the convolution runs on the widened slice

    def update_conv_state(self, hidden_states, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 0):
        width, path = conv_kernel_size - 1, self.path
        declare_halo(path, hidden_states[..., :width], self.group)
        widened = with_halo(hidden_states, width, self.group, f"{path} conv halo")
        if self.call.state_sink is not None:  # a prefill: the prompt's last inputs are carried on
            key = conv_state_key(path, self.offset)
            sink_state(self.call, key, last_inputs(widened, width, self.call, path, f"{key} state"))
        return widened

    def get_mask_sizes(self, q_length: int, layer_idx: int) -> tuple[int, int]:
        return self.held * dist.get_world_size(self.group), 0

    def get_query_offset(self, layer_idx: int) -> int:
        return self.held * dist.get_rank(self.group)

    def update(self, key, value, layer_idx: int, kwargs=None):
        return key, value


def conv_state_key(path: str, offset: int = 0) -> str:
    """Where the cache of cp generation carries the last inputs of the convolution at ``path``, in the pass
    whose cache layers sit ``offset`` after the module's own (a looped layer runs its convolutions once per
    pass, each with its own state: Inkling2-Loop's ``cache_offset``; 0 for the first pass)."""
    return f"{path} conv" + (f"+{offset}" if offset else "")


class StepCache:
    """The cache an Inkling module reads in a cp decode step (one new token per row after the cache's ``T``
    indices): each convolution's state its carried last inputs; attention's query at index ``T``, its keys
    every index ``0..T``, so the model computes the bias row and the log scale of the new token at its true
    index. The keys and values pass through: cp's decode appends them to the split cache and attends over it
    (:mod:`cpshard.attention.decode`), adding the bias row to the keys each rank holds."""

    def __init__(self, step, path: str, offset: int = 0):
        self.step, self.path, self.offset = step, path, offset

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None  # the convolution runs on its carried inputs and the new one (update_conv_state)

    def update_conv_state(self, hidden_states, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 0):
        key = conv_state_key(self.path, self.offset)
        widened = torch.cat([carried_state(self.step, key), hidden_states], dim=-1)
        self.step.new_states[key] = widened[..., hidden_states.shape[-1] :]
        return widened

    def get_mask_sizes(self, q_length: int, layer_idx: int) -> tuple[int, int]:
        return self.step.cache.length + q_length, 0

    def get_query_offset(self, layer_idx: int) -> int:
        return self.step.cache.length

    def update(self, key, value, layer_idx: int, kwargs=None):
        return key, value


def _sliced(path: str, module, args, kwargs):
    """The module's cache a :class:`SliceCache` of this rank, its padding mask cut to the rank's positions
    (in a cp decode step, a :class:`StepCache`)."""
    call, offset = split_call(), kwargs.get("cache_offset", 0)  # which pass of a looped layer
    if call is None:
        step = active_decode()
        return None if step is None else (args, {**kwargs, "cache": StepCache(step, path, offset)})
    if not isinstance(kwargs.get("cache"), SliceCache | None):  # attention hands its convolutions its own
        raise ValueError(
            f"{path}: a cache in a cp forward; cp generation carries Inkling's cache itself "
            "(cpshard.generate, or make_cp_prefill and make_cp_decode)"
        )
    # the layer passes its hidden states by position, attention by name (both fingerprinted)
    hidden = args[0] if args else kwargs["hidden_states"]
    mask = kwargs.get("conv_mask")
    if isinstance(mask, torch.Tensor) and mask.shape[-1] != hidden.shape[1]:
        kwargs = {**kwargs, "conv_mask": cut_to_rank(mask, call)}
    return args, {**kwargs, "cache": SliceCache(call, hidden.shape[1], path, offset)}


def no_past_hooks(layer: nn.Module, path: str, names: tuple[str, ...]) -> list[Hook]:
    """Pre-hooks that hand each module ``names`` of the decoder layer at ``path`` its own cache of no past
    (:class:`SliceCache`; in a decode step, :class:`StepCache`)."""
    return [Hook(layer.get_submodule(name), partial(_sliced, f"{path}.{name}"), pre=True) for name in names]


def inkling_hooks(layer: nn.Module, path: str) -> list[Hook]:
    """The hooks of one decoder layer at ``path``: its attention and its four convolutions."""
    return no_past_hooks(
        layer, path, ("self_attn", "self_attn.k_sconv", "self_attn.v_sconv", "attn_sconv", "mlp_sconv")
    )
