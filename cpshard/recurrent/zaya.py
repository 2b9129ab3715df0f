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

Attention itself is served as any attention is. Generation carries the convolution's last ``width`` inputs and
the last delayed value after the prompt (one all-reduce each, from the rank that holds the prompt's last
token) in place of the model's cache; a decode step puts them where the padding and the zero input were, as
the model's cached path does. Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other
code is refused at setup.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import active_decode, split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import ZAYA_CCA
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.slot import (
    carried_state,
    cp_group,
    cut_to_rank,
    handed_on,
    last_inputs,
    sink_state,
)

#: what the hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = written_against(__name__)


def check_zaya_unchanged() -> None:
    check_written_for(f"{ZAYA_CCA} (its convolutions and delayed value served by cpshard)", *WRITTEN_AGAINST)


def _widened(width: int, path: str, conv, args, kwargs):
    """The first convolution's input, its ``width`` padded positions replaced by the previous rank's last (in
    a decode step: the carried ones)."""
    call, key = split_call(), f"{path} qk conv"
    inputs = args[0][..., width:]
    if call is None and (step := active_decode()) is not None:
        widened = torch.cat([carried_state(step, key), inputs], dim=-1)
        step.new_states[key] = widened[..., -width:]
        return (widened, *args[1:]), kwargs
    if call is None:
        return None
    group = cp_group(call)
    declare_halo(path, inputs[..., :width], group)
    widened = with_halo(inputs, width, group, f"{path} qk conv halo")
    if call.state_sink is not None:  # a prefill: the prompt's last inputs are carried on
        sink_state(call, key, last_inputs(widened, width, call, path, f"{key} state"))
    return (widened, *args[1:]), kwargs


def _entered(held: dict, projection, args, kwargs):
    """The padding mask cut to this rank's positions; the inputs kept (masked, as the model masks) for the
    delayed value."""
    call = split_call()
    hidden, cache, mask = args  # ZayaAttention.forward passes the three by position (fingerprinted)
    if call is None and active_decode() is not None:
        held["inputs"] = hidden
    if call is None:
        return None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        mask = cut_to_rank(mask, call)
    held["inputs"] = hidden if mask is None else hidden * mask[..., None].to(hidden.dtype)
    return (hidden, cache, mask), kwargs


def _delayed_from_before(held: dict, path: str, projection, args, output):
    """The outputs with the first position's delayed value half the previous rank's last (in a decode step:
    the carried one)."""
    call, key = split_call(), f"{path} delayed value"
    if call is None and (step := active_decode()) is not None:
        inputs = held.pop("inputs")
        step.new_states[key] = projection.v_proj_delayed(inputs[:, -1:])
        return _with_first_delayed(output, carried_state(step, key))
    if call is None:
        return None
    group, inputs = cp_group(call), held.pop("inputs")
    delayed = projection.v_proj_delayed(inputs[:, -1:])  # [B, 1, half]
    if call.state_sink is not None:  # a prefill: the prompt's last delayed value is carried on
        at_end = lambda end: projection.v_proj_delayed(inputs[:, end - 1 : end])  # noqa: E731
        sink_state(call, key, handed_on(call, inputs.shape[1], at_end, delayed, path, f"{key} state"))
    last = delayed.transpose(1, 2)  # [B, half, 1]
    declare_halo(path, last, group)
    received = with_halo(last, 1, group, f"{path} delayed value halo")[..., :1].transpose(1, 2)
    if dist.get_rank(group) == 0:  # the model's own first value; the halo's graph kept for its backward
        flat = output[2].reshape(*output[2].shape[:2], -1)
        received = flat[:, :1, flat.shape[-1] - received.shape[-1] :] + 0 * received
    return _with_first_delayed(output, received)


def _with_first_delayed(output: tuple, delayed: torch.Tensor) -> tuple:
    """The projection's ``(query, key, value)`` with the first position's delayed value half ``delayed``
    (``[B, 1, half]``)."""
    query, key, value = output
    flat = value.reshape(*value.shape[:2], -1)
    first = torch.cat([flat[:, :1, : flat.shape[-1] - delayed.shape[-1]], delayed], dim=-1)
    return query, key, torch.cat([first, flat[:, 1:]], dim=1).view_as(value)


def zaya_hooks(projection: nn.Module, path: str) -> list[Hook]:
    """The hooks of one CCA projection at ``path``."""
    held: dict = {}
    return [
        Hook(projection, partial(_entered, held), pre=True),
        Hook(projection, partial(_delayed_from_before, held, path), pre=False),
        Hook(projection.conv_qk_depthwise, partial(_widened, projection.conv_kernel_size, path), pre=True),
    ]
