"""RecurrentGemma's recurrent block (Griffin's RG-LRU) under cp: its convolution with a halo, its scan by
state passing.

``RecurrentGemmaRecurrentBlock`` calls its temporal convolution (an ``nn.Conv1d`` padded by ``kernel - 1``
on both sides, cut to the slice's length) and its RG-LRU's scan (the method ``_rnn_scan``, a loop of
``h_t = a_t h_{t-1} + x_t`` per channel, ``a`` zeroed where ``position_ids`` is 0) directly, through no
kernel slot. Under cp:

- the convolution's input gets the previous rank's last ``kernel - 1`` positions in front
  (:func:`~cpshard.recurrent.halo.with_halo`; a forward pre-hook) and the outputs of the widened front are
  dropped (a forward hook), so the block's cut keeps this slice's causal outputs;
- the scan is taken as a :class:`~cpshard.recurrent.slot.Slot` (an attribute of the module, in front of
  its class's method): the model's own scan summarises the slice (:func:`~cpshard.recurrent.affine.
  diagonal_summary`: the decay ``prod a_t`` per row and channel beside the zero-state outputs), the
  summaries are all-gathered (fp32, ``B x D x 2``), folded, and the outputs corrected, ``h_t += (prod_{s<=t}
  a_s) S_in``. The gates are computed by the model's code on each rank's slice; ``position_ids`` are the
  whole sequence's, so only the first token resets.

Generation: the model keeps its states inside the modules (``recurrent_states``, ``conv1d_state``); cp
carries them in its cache instead. A prefill leaves the scan's state and the convolution's last
``kernel - 1`` inputs after the prompt's last token (one all-reduce each, from the rank that holds it); a
decode step (run as the model runs without a cache) gives the convolution the carried inputs in front and
the scan its carried state, through the model's own one-token scan.

Written against transformers 5.25's module (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import active_decode, split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import RG_LRU
from cpshard.recurrent.affine import correct_outputs, diagonal_summary, fold_states
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.slot import Slot, carried_state, cp_group, handed_on, last_inputs, sink_state

#: what the scan slot and the convolution's hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = written_against(__name__)
#: the name of the RG-LRU's scan method, which cpshard's slot shadows on each module
SCAN = "_rnn_scan"


def check_rg_lru_unchanged() -> None:
    check_written_for(f"{RG_LRU} (its scan and convolution served by cpshard)", *WRITTEN_AGAINST)


class DiagonalScan(Slot):
    """The RG-LRU's scan, by state passing (see the module's docstring); outside a cp call, the model's."""

    def serve(
        self, call, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float32
    ):
        if call.recurrent == "head_split":
            raise ValueError(
                f"{self.path}: recurrent='head_split' is not served for RG-LRU layers; use "
                "recurrent='state_passing' or 'auto'"
            )
        group = cp_group(call)
        summary = diagonal_summary(self.original, hidden_states, recurrent_gate, reset, acc_dtype)
        batch, _, channels = hidden_states.shape
        every = gathered_summaries(
            (summary.transition, summary.state_local), group, self.path, batch * channels * 2 * 4
        )
        incoming = None if recurrent_states is None else recurrent_states[..., None, None]
        states = fold_states(*zip(*every, strict=True), incoming)
        rank = dist.get_rank(group)
        state_in = states[rank] + 0 * states[-1]  # every rank's outputs read every summary (see DeltaRule)
        outputs = correct_outputs(summary.o_zero, summary.q_eff, state_in, hidden_states.dtype)
        if call.state_sink is not None:  # a prefill: the state after the prompt's last token is carried on

            def after(end: int) -> torch.Tensor:  # the state after this rank's position ``end - 1``
                at = slice(end - 1, end)
                return correct_outputs(summary.o_zero[:, at], summary.q_eff[:, at], state_in, torch.float32)

            held, like = hidden_states.shape[1], summary.o_zero[:, :1]
            final = handed_on(call, held, after, like, self.module, f"{self.path} final state")
            self.sink(call, final.flatten(1))
        return outputs[..., 0], states[rank + 1].flatten(1)

    def decode(
        self, step, hidden_states, recurrent_gate, reset, recurrent_states=None, acc_dtype=torch.float32
    ):
        """One token per row from the carried state (the model's own one-token scan, every rank alike)."""
        outputs, state = self.original(hidden_states, recurrent_gate, reset, self.carried(step), acc_dtype)
        step.new_states[self.path] = state
        return outputs, state


def _widened(width: int, path: str, conv, args, kwargs):
    """The convolution's input with the ``width`` inputs before it in front: the previous rank's in a cp
    call (a prefill also carries the prompt's last ones on), the carried ones in a decode step."""
    call, key, (inputs, *rest) = split_call(), f"{path} conv_1d", args
    if call is None and (step := active_decode()) is not None:
        widened = torch.cat([carried_state(step, key), inputs], dim=-1)
        step.new_states[key] = widened[..., inputs.shape[-1] :]
        return (widened, *rest), kwargs
    if call is None:
        return None
    group = cp_group(call)
    declare_halo(path, inputs[..., :width], group)
    widened = with_halo(inputs, width, group, f"{path} conv_1d conv halo")
    if call.state_sink is not None:
        sink_state(call, key, last_inputs(widened, width, call, path, f"{key} conv state"))
    return (widened, *rest), kwargs


def _halo_dropped(width: int, conv, args, output):
    return output[..., width:] if split_call() is not None or active_decode() is not None else None


def rg_lru_hooks(block: nn.Module, path: str) -> list[Hook]:
    """Take ``block``'s scan (idempotent); the hooks that give its convolution a halo."""
    scan = block.rg_lru.__dict__.get(SCAN)
    original = scan.original if isinstance(scan, Slot) else getattr(block.rg_lru, SCAN)
    setattr(block.rg_lru, SCAN, DiagonalScan(original, path, SCAN, {}))
    width = block.conv_1d.kernel_size[0] - 1
    return [
        Hook(block.conv_1d, partial(_widened, width, path), pre=True),
        Hook(block.conv_1d, partial(_halo_dropped, width), pre=False),
    ]
