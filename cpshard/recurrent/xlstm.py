"""xLSTM's mLSTM under cp: its matrix memory by state passing, the stabiliser folded across ranks.

The mLSTM keeps a matrix memory ``C``, a normaliser ``n`` and a stabiliser ``m`` per head; the true state
``C e^m`` decays by ``f_t = sigmoid(fgate_t)`` and gains ``e^{i_t} k_t v_t^T``, so it is affine, and ``m`` is
a max-plus recurrence that composes as well: over a slice ``m_out = max(G + m_in, A)``, with ``G`` the sum of
``log f_t`` and ``A`` what the slice reaches from a stabiliser of minus infinity. The output reads ``m`` (its
normaliser floor ``e^{-m}``), so each rank must enter its slice with one process's ``(C, n, m)``, in the same
stabilised form. The layer calls its backend (an ``nn.Module`` running the model's chunkwise and step kernels)
with initial states, and cpshard takes its ``forward`` (:class:`MLSTMScan`): inside a cp call the backend runs
once on the slice from a zero memory and a stabiliser far below any reachable (giving ``A``), the summaries
``(C, n, A, G)`` are all-gathered (fp32), those before the rank are folded
(:func:`~cpshard.recurrent.affine.stabilised_fold`) and the backend runs again from the folded state for the
outputs. Where each slice starts on the kernel's chunk grid (a multiple of ``chunk_size`` tokens a rank) the
arithmetic is one process's.

Generation carries ``(C, n, m)`` (packed in one tensor, :func:`packed`): a prefill leaves the state after the
prompt's last token (one all-reduce from the rank that holds it), a decode step continues it with the
model's backend on every rank alike.

Written against transformers 5.25's code (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import XLSTM
from cpshard.recurrent.affine import stabilised_fold
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.slot import Slot, cp_group, handed_on

#: what the backend's slot was written against in transformers 5.25.0 (the kernels whose stabiliser it folds)
WRITTEN_AGAINST = written_against(__name__)
#: the stabiliser a slice's own run starts from: below anything the gates reach (they are soft-capped), so
#: that its final stabiliser is ``A``
FLOOR = -1e30


def check_xlstm_unchanged() -> None:
    check_written_for(f"{XLSTM} (its backend served by cpshard)", *WRITTEN_AGAINST)


class MLSTMScan(Slot):
    """The mLSTM backend's ``forward`` (see the module's docstring); outside a cp call, the model's."""

    def serve(
        self,
        call,
        query,
        key,
        value,
        igate,
        fgate,
        c_initial=None,
        n_initial=None,
        m_initial=None,
        return_last_states=None,
        mode=None,
    ):
        if c_initial is not None or call.recurrent == "head_split":
            raise ValueError(
                f"{self.path}: cp serves xLSTM's mLSTM by state passing, from no state (no cache; at most "
                "max_inference_chunksize tokens a rank in eval mode; recurrent='state_passing' or 'auto')"
            )
        batch, heads, _, width = key.shape
        floor = torch.full((batch, heads, 1), FLOOR, device=key.device)
        zeros = (
            key.new_zeros(batch, heads, width, value.shape[-1], dtype=torch.float32),
            key.new_zeros(batch, heads, width, dtype=torch.float32),
        )
        _, own = self.original(
            query, key, value, igate, fgate, *zeros, floor, return_last_states=True, mode=mode
        )
        forget = F.logsigmoid(fgate.float()).sum(-1, keepdim=True)
        summary = (*(part.float() for part in own), forget)
        nbytes = batch * heads * (width * value.shape[-1] + width + 2) * 4
        group = cp_group(call)
        every = gathered_summaries(summary, group, self.path, nbytes)
        states = [(*zeros, torch.zeros_like(floor))]  # one process's start: the model's default
        for entry in every:
            states.append(stabilised_fold(states[-1], entry[:3], entry[3]))  # (C, n, A), G
        rank = dist.get_rank(group)
        # every rank's outputs read every summary, so that every rank runs the gather's backward
        incoming = [part + 0 * last for part, last in zip(states[rank], states[-1], strict=True)]
        h, final = self.original(
            query, key, value, igate, fgate, *incoming, return_last_states=True, mode=mode
        )
        if call.state_sink is not None:  # a prefill: the state after the prompt's last token is carried on
            gates = (query, key, value, igate, fgate)
            self.sink(call, self.state_at(call, gates, states[rank], final, mode))
        return (h, final) if self.returns_states(return_last_states, mode) else h

    def state_at(self, call, gates: tuple, incoming: tuple, final: tuple, mode) -> torch.Tensor:
        """The state after the prompt's last token, packed, on every rank (the rank that holds it runs its
        slice up to there from its incoming state)."""
        held = gates[1].shape[2]  # key [B, H, T, D]

        def after(end: int) -> torch.Tensor:
            if end == held:
                return packed(final)
            cut = [x[:, :, :end] for x in gates]  # q, k, v [B, H, T, ...]; the gates [B, H, T]
            return packed(self.original(*cut, *incoming, return_last_states=True, mode=mode)[1])

        return handed_on(call, held, after, packed(incoming), self.module, f"{self.path} final state")

    def returns_states(self, return_last_states, mode) -> bool:
        """Whether the backend returns its last states beside the outputs when called so: always in
        inference mode, else as asked (by default, as its config says)."""
        config = self.original.__self__.config
        if "inference" in (mode or config.mode):
            return True
        return config.return_last_states if return_last_states is None else return_last_states

    def decode(self, step, query, key, value, igate, fgate, return_last_states=None, mode=None, **initial):
        """One token per row from the carried state (the model's backend, every rank alike; the layer's own
        ``initial`` states are None: cp runs it without a cache)."""
        state = unpacked(self.carried(step), key.shape[-1], value.shape[-1])
        h, new = self.original(query, key, value, igate, fgate, *state, return_last_states=True, mode=mode)
        step.new_states[self.path] = packed(new)
        return (h, new) if self.returns_states(return_last_states, mode) else h


def packed(state) -> torch.Tensor:
    """``(C [B, H, D, V], n [B, H, D], m [B, H, 1])`` as one ``[B, H, D V + D + 1]`` fp32 tensor."""
    memory, normaliser, stabiliser = state
    return torch.cat([memory.flatten(2), normaliser, stabiliser], dim=-1).float()


def unpacked(state: torch.Tensor, width: int, value_width: int) -> tuple:
    """:func:`packed`'s parts again."""
    memory, normaliser, stabiliser = state.split([width * value_width, width, 1], dim=-1)
    return memory.unflatten(-1, (width, value_width)), normaliser, stabiliser


def mlstm_hooks(layer: nn.Module, path: str) -> list:
    """Take the backend's ``forward`` of the mLSTM layer ``layer`` at ``path`` (idempotent); no hooks."""
    backend = layer.mlstm_backend
    current = backend.__dict__.get("forward")
    original = current.original if isinstance(current, Slot) else backend.forward
    backend.forward = MLSTMScan(original, path, "mlstm_backend", {})
    return []
