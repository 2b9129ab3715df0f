"""ZAYA's compressed convolutional attention under cp: the convolutions and the delayed value of its
projection, each with a halo.

``ZayaCCAProjection`` mixes tokens in two places before attention: q and k (concatenated) pass two
convolutions of width 2 (depthwise, then grouped) after ``conv_kernel_size`` (2) zero positions are padded in
front, and half of each value head is the previous token's (``v_proj_delayed``; the first token's from a
zero input). Under cp:

- a forward pre-hook on the first convolution puts the previous rank's last positions where the padding was
  (:func:`~cpshard.recurrent.halo.with_halo`; rank 0 receives the zeros the model pads);
- the projection's pre-hook cuts its padding mask (``conv``, the whole sequence's ``[B, L]``) to this rank's
  positions and keeps its last input; its forward hook gives the first position the previous rank's last
  delayed value (rank 0 keeps the model's own).

Attention itself is served as any attention is. Written against transformers 5.25's code
(:data:`WRITTEN_AGAINST`); other code is refused at setup. Generation (its conv and value states in the
model's cache) is refused.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for
from cpshard.layouts.layout import ZAYA_CCA
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.slot import cp_group, cut_to_rank

#: what the hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = (
    "transformers.models.zaya.modeling_zaya",
    {"ZayaCCAProjection": "832460781ef5e68b", "ZayaAttention.forward": "3f1c6a69e4f94bdc"},
)


def check_zaya_unchanged() -> None:
    check_written_for(f"{ZAYA_CCA} (its convolutions and delayed value served by cpshard)", *WRITTEN_AGAINST)


def _widened(width: int, path: str, conv, args, kwargs):
    """The first convolution's input, its ``width`` padded positions replaced by the previous rank's last."""
    call = split_call()
    if call is None:
        return None
    inputs, group = args[0][..., width:], cp_group(call)
    declare_halo(path, inputs[..., :width], group)
    return (with_halo(inputs, width, group, f"{path} qk conv halo"), *args[1:]), kwargs


def _entered(held: dict, projection, args, kwargs):
    """The padding mask cut to this rank's positions; the last input kept (masked, as the model masks)."""
    call = split_call()
    if call is None:
        return None
    hidden, cache, mask = args  # ZayaAttention.forward passes the three by position (fingerprinted)
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = cut_to_rank(mask, call)
    held["last"] = hidden[:, -1:] if mask is None else hidden[:, -1:] * mask[:, -1:, None].to(hidden.dtype)
    return (hidden, cache, mask), kwargs


def _delayed_from_before(held: dict, path: str, projection, args, output):
    """The outputs with the first position's delayed value half the previous rank's last."""
    call = split_call()
    if call is None:
        return None
    query, key, value = output
    group = cp_group(call)
    last = projection.v_proj_delayed(held.pop("last")).transpose(1, 2)  # [B, half, 1]
    declare_halo(path, last, group)
    received = with_halo(last, 1, group, f"{path} delayed value halo")[..., :1].transpose(1, 2)
    flat = value.reshape(*value.shape[:2], -1)
    half = flat.shape[-1] - received.shape[-1]
    if dist.get_rank(group) == 0:  # the model's own first value; the halo's graph kept for its backward
        received = flat[:, :1, half:] + 0 * received
    first = torch.cat([flat[:, :1, :half], received], dim=-1)
    return query, key, torch.cat([first, flat[:, 1:]], dim=1).view_as(value)


def zaya_hooks(projection: nn.Module, path: str) -> list[Hook]:
    """The hooks of one CCA projection at ``path``."""
    held: dict = {}
    return [
        Hook(projection, partial(_entered, held), pre=True),
        Hook(projection, partial(_delayed_from_before, held, path), pre=False),
        Hook(projection.conv_qk_depthwise, partial(_widened, projection.conv_kernel_size, path), pre=True),
    ]
