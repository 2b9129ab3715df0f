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
(:class:`_Slice`): its convolution state is the previous rank's last ``K - 1`` (masked) inputs
(:func:`~cpshard.recurrent.halo.with_halo`; rank 0 receives the zeros the model pads), its query offset the
rank's first position, and its keys the whole sequence's, so the model computes the rank's rows of the bias
``[B, H, L/cp, L]`` and its log scale at their true positions. cp's attention moves those rows as it moves
q (:mod:`cpshard.attention.ulysses`). Each convolution's padding mask is cut to the rank's positions. The
sequence is held in contiguous order (the plan sees to it for recurrent layouts).

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup. The
bias costs ``B x H x L/cp x L`` floats a layer and rank, moved once each way (the model's own sdpa and eager
paths hold it whole: ``B x H x L x L``).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for
from cpshard.layouts.layout import INKLING
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.slot import cp_group, cut_to_rank

#: what the hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = (
    "transformers.models.inkling.modeling_inkling",
    {
        "InklingDecoderLayer": "44ef0ddd6f184b6a",
        "InklingAttention.forward": "af7fc981f9ffad9c",
        "InklingRelativeLogits": "b639762521f79348",
        "InklingShortConvolution.forward": "ff0276d021b192b6",
        "causal_conv1d_forward": "26ed805ea88075b7",
        "InklingTextModel.forward": "7e9487335f9788f7",
    },
)


def check_inkling_unchanged() -> None:
    check_written_for(f"{INKLING} (its convolutions and positions served by cpshard)", *WRITTEN_AGAINST)


class _Slice:
    """The cache an Inkling module reads under cp: no past; the rank's first position as the query offset,
    the whole sequence as the keys, and each convolution's state the previous rank's last inputs."""

    def __init__(self, call, held: int, path: str):
        self.group, self.held, self.path = cp_group(call), held, path

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> None:
        return None  # no one-token update: the convolution runs on the widened slice

    def update_conv_state(self, hidden_states, layer_idx: int, state_idx: int = 0, conv_kernel_size: int = 0):
        width = conv_kernel_size - 1
        declare_halo(self.path, hidden_states[..., :width], self.group)
        return with_halo(hidden_states, width, self.group, f"{self.path} conv halo")

    def get_mask_sizes(self, q_length: int, layer_idx: int) -> tuple[int, int]:
        return self.held * dist.get_world_size(self.group), 0

    def get_query_offset(self, layer_idx: int) -> int:
        return self.held * dist.get_rank(self.group)

    def update(self, key, value, layer_idx: int, kwargs=None):
        return key, value


def _sliced(path: str, module, args, kwargs):
    """The module's cache a :class:`_Slice` of this rank, its padding mask cut to the rank's positions."""
    call = split_call()
    if call is None:
        return None
    if not isinstance(kwargs.get("cache"), _Slice | None):  # attention hands its convolutions its own
        raise ValueError(f"{path}: a cache in a cp forward; cp serves Inkling's training forward only")
    # the layer passes its hidden states by position, attention by name (both fingerprinted)
    hidden = args[0] if args else kwargs["hidden_states"]
    mask = kwargs.get("conv_mask")
    if isinstance(mask, torch.Tensor) and mask.shape[-1] != hidden.shape[1]:
        kwargs = {**kwargs, "conv_mask": cut_to_rank(mask, call)}
    return args, {**kwargs, "cache": _Slice(call, hidden.shape[1], path)}


def inkling_hooks(layer: nn.Module, path: str) -> list[Hook]:
    """The hooks of one decoder layer at ``path``: its attention and its four convolutions."""
    names = ("self_attn", "self_attn.k_sconv", "self_attn.v_sconv", "attn_sconv", "mlp_sconv")
    return [Hook(layer.get_submodule(name), partial(_sliced, f"{path}.{name}"), pre=True) for name in names]
