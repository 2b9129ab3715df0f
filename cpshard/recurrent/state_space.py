"""State-space scans under cp: Mamba2's SSD by state passing, Mamba1's selective scan split over channels.

Their slots (``mamba_chunk_scan_combined``, ``selective_scan_fn``) are taken as the delta rules' are
(:mod:`cpshard.recurrent.slots`, which installs them), and so is the fused slot that would do a whole Mamba2
mixer in one call, which steps aside under cp. Their convolutions take the halo of :mod:`cpshard.recurrent.
halo`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cpshard.comm.collectives import all_gather_shards
from cpshard.comm.exchange import all_to_all, all_to_all_together, collectives_together
from cpshard.comm.record import expect
from cpshard.recurrent.affine import correct_outputs, fold_states, outgoing_state, ssd_summary
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.slot import Slot, cp_group, handed_on, tensor_bytes


class SSDScan(Slot):
    """Mamba2's chunked scan slot (``mamba_chunk_scan_combined``), by state passing: the slice scanned
    from a zero state with the model's own kernel (:func:`~cpshard.recurrent.affine.ssd_summary`), the
    summaries gathered, the incoming state folded (a scalar decay per row and head) and the outputs
    corrected before the mixer's gate and norm. Or by the head split: the scan's per-head inputs exchanged
    from sequence-split to head-split, ``B`` and ``C`` split with them where cp divides their groups and
    gathered whole where it does not, the model's scan on whole sequences for a share of the heads, and its
    output back. The call asks for one, or for the one with fewer analytic bytes; a prefill passes states."""

    def serve(self, call, hidden_states, dt, A, B, C, chunk_size, initial_states=None, **kwargs):
        packed = [name for name in ("seq_idx", "cu_seqlens") if kwargs.pop(name, None) is not None]
        if packed:
            raise ValueError(
                f"{self.path}: packed documents ({packed[0]}) in a state-space layer; cp does not yet keep "
                "their states apart across ranks: pass one document per row"
            )
        wants_final = kwargs.pop("return_final_states", False)
        if kwargs.pop("z", None) is not None:  # transformers' mixers gate after the scan, in their norm
            raise ValueError(
                f"{self.path}: a gate z inside the scan (applied to its outputs before cp's correction) is "
                "not served; cp serves mixers that gate after the scan, as transformers' Mamba2 mixers do"
            )
        group = cp_group(call)
        if call.state_sink is None and self.scheme(call, hidden_states, dt, B, group) == "head_split":
            if initial_states is not None or wants_final:
                raise ValueError(f"{self.path}: the head split carries no state in or out of the call")
            return self.head_split(group, hidden_states, dt, A, B, C, chunk_size, kwargs)
        rank, (batch, _, heads, width) = dist.get_rank(group), hidden_states.shape
        summary = ssd_summary(self.original, hidden_states, dt, A, B, C, chunk_size, **kwargs)
        nbytes = batch * heads * (B.shape[-1] * width + 1) * 4
        every = gathered_summaries((summary.transition, summary.state_local), group, self.path, nbytes)
        incoming = None if initial_states is None else initial_states.transpose(-1, -2)
        states = fold_states(*zip(*every, strict=True), incoming)
        state_in = states[rank] + 0 * states[-1]  # every rank's outputs read every summary (see DeltaRule)
        outputs = correct_outputs(summary.o_zero, summary.q_eff, state_in, summary.o_zero.dtype)
        if call.state_sink is not None:  # a prefill: the state after the prompt's last token is carried on
            inputs = (hidden_states, dt, A, B, C, chunk_size)
            self.sink(call, self.state_at(call, inputs, states, group, kwargs).transpose(-1, -2))
        return (outputs, states[-1].transpose(-1, -2)) if wants_final else outputs

    def scheme(self, call, hidden_states, dt, B, group) -> str:
        """The scheme of this layer and call: the one asked for, else the one with fewer analytic bytes
        (state passing where the head split cannot share the heads and their groups out)."""
        size, (batch, _, heads, width), (groups, state) = group.size(), hidden_states.shape, B.shape[2:]
        # each rank's heads must read whole groups of B and C, or all lie in one
        splits = heads % size == 0 and (groups % size == 0 or size % groups == 0)
        if call.recurrent == "head_split" and not splits:
            raise ValueError(
                f"{self.path}: recurrent='head_split' splits {heads} heads in {groups} groups of B and C "
                f"over cp={size}, which must divide the heads and divide or be divided by the groups; use "
                "recurrent='state_passing' or 'auto'"
            )
        if call.recurrent != "auto":
            return call.recurrent
        passing = batch * heads * (state * width + 1) * 4 * (1 + size)
        return (
            "head_split"
            if splits and ssd_head_split_bytes(hidden_states, dt, B, size) < passing
            else "state_passing"
        )

    def head_split(self, group, hidden_states, dt, A, B, C, chunk_size, kwargs):
        """Sequence-split inputs to head-split whole sequences, the model's scan on them, and back."""
        size, rank = group.size(), dist.get_rank(group)
        heads, groups = hidden_states.shape[2], B.shape[2]
        share = slice(rank * heads // size, (rank + 1) * heads // size)
        if groups % size == 0:  # B and C split over their groups, with x and dt
            *whole, whole_b, whole_c = all_to_all_together(
                (hidden_states, dt, B, C), 2, 1, group, f"{self.path} x dt B C"
            )
        else:  # every rank's heads lie in one group: B and C gathered whole, that group kept
            whole = all_to_all_together((hidden_states, dt), 2, 1, group, f"{self.path} x dt")
            tokens = [x.transpose(0, 1).contiguous() for x in (B, C)]
            gathered = all_gather_shards(
                tokens, [t.shape[0] * size for t in tokens], group, f"{self.path} B C"
            )
            group_of = rank // (size // groups)
            whole_b, whole_c = (x.transpose(0, 1)[:, :, group_of : group_of + 1] for x in gathered)
        per_head = {
            key: value[share]
            for key, value in kwargs.items()
            if key in ("D", "dt_bias") and value is not None
        }
        outputs = self.original(*whole, A[share], whole_b, whole_c, chunk_size, **{**kwargs, **per_head})
        for phase in ("forward", "backward"):
            self.expect_head_split(phase, hidden_states, dt, B, size, outputs)
        return all_to_all(outputs, 1, 2, group, f"{self.path} output")

    def expect_head_split(self, phase: str, hidden_states, dt, B, size: int, outputs) -> None:
        """Declare the head split's bytes of one phase: x, dt and the output all-to-all'd, B and C
        all-to-all'd with them, or gathered (forward) and their gradients reduce-scattered (backward)."""
        pair, moved = (
            2 * tensor_bytes(B),
            tensor_bytes(hidden_states) + tensor_bytes(dt) + tensor_bytes(outputs),
        )
        if B.shape[2] % size == 0:  # x, dt, B and C together, then the output
            expect(
                self.module,
                "all_to_all",
                phase,
                collectives_together((hidden_states, dt, B)) + 1,
                moved + pair,
            )
            return
        expect(self.module, "all_to_all", phase, collectives_together((hidden_states, dt)) + 1, moved)
        gather = "all_gather" if phase == "forward" else "reduce_scatter"
        expect(self.module, gather, phase, 1, pair * (1 if phase == "forward" else size))

    def state_at(self, call, inputs: tuple, states: list, group, kwargs) -> torch.Tensor:
        """The state after position ``call.length - 1`` (before the positions cp padded past the sequence), on
        every rank: the rank that holds that position scans its slice up to it from its incoming state, one
        all-reduce brings it to the others. (A delta rule makes its padding a no-op instead; the scan's
        time step cannot be zeroed through its inputs where ``dt_limit`` floors it.)"""
        rank, held = dist.get_rank(group), inputs[0].shape[1]

        def after(end: int) -> torch.Tensor:
            if end == held:
                return states[rank + 1]
            x, dt, A, B, C, chunk_size = inputs
            cut = ssd_summary(
                self.original, x[:, :end], dt[:, :end], A, B[:, :end], C[:, :end], chunk_size, **kwargs
            )
            return outgoing_state(cut.transition, cut.state_local, states[rank])

        return handed_on(call, held, after, states[rank], self.module, f"{self.path} final state")

    def decode(self, step, hidden_states, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, **kwargs):
        """One token per row from the carried state, as the model's own recurrent form runs it with a cache
        (its mixer's one-token update, its arguments shaped per head dimension; no ``dt_limit``, which
        Zamba2's chunked form applies and its recurrent form does not), every rank alike."""
        width, size = hidden_states.shape[-1], B.shape[-1]
        per_dim = lambda x: None if x is None else x[:, None].expand(-1, width)  # noqa: E731
        state = self.carried(step).clone()  # the update writes its state in place
        outputs = self.siblings["selective_state_update"](
            state,
            hidden_states[:, 0],
            dt[:, 0, :, None].expand(-1, -1, width),
            A[:, None, None].expand(-1, width, size),
            B[:, 0],
            C[:, 0],
            per_dim(D),
            z=None if z is None else z[:, 0],
            dt_bias=per_dim(dt_bias),
            dt_softplus=kwargs.get("dt_softplus", False),
        )
        step.new_states[self.path] = state
        return outputs[:, None]


def ssd_head_split_bytes(hidden_states, dt, B, size: int) -> int:
    """What one rank puts into collectives for one Mamba2 layer, forward and backward, by the head split:
    x, dt and the output (fp32, as the scan returns it) all-to-all'd each way; B and C all-to-all'd where cp
    divides their groups, else gathered and their gradients reduce-scattered."""
    pair = 2 * tensor_bytes(B)
    moved = 2 * (tensor_bytes(hidden_states) + hidden_states.numel() * 4 + tensor_bytes(dt))
    return moved + (2 * pair if B.shape[2] % size == 0 else pair * (1 + size))


class ChannelSplit(Slot):
    """Mamba1's selective scan slot (``selective_scan_fn``), split over channels: its per-channel inputs
    (``x``, ``dt``, the gate ``z``; ``[B, D, T]``) go from sequence-split to channel-split by all-to-all,
    ``B`` and ``C`` (``[B, N, T]``, shared by every channel) are all-gathered, the model's own scan runs on
    whole sequences for ``D / cp`` channels (so on one process's arithmetic) and its output comes back. The
    scan takes no incoming state, so state passing would rebuild its decays outside the model's code; the
    split needs none, and ``D`` (the inner width) is large. A prefill scans up to the prompt's last token
    and gathers the channels' final states; decode continues them with the model's own one-token update
    (its ``selective_state_update`` slot)."""

    def serve(self, call, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, **kwargs):
        group = cp_group(call)
        size, rank, channels = dist.get_world_size(group), dist.get_rank(group), hidden_states.shape[1]
        if call.recurrent == "state_passing":
            raise ValueError(
                f"{self.path}: Mamba1's selective scan takes no incoming state, so cp cannot pass it one: it "
                "is served by a split of its channels over the cp ranks (recurrent='auto' or 'head_split')"
            )
        if channels % size:
            raise ValueError(
                f"{self.path}: Mamba1's selective scan is served by a split of its {channels} channels over "
                f"cp={size} ranks, which cp must divide; cp sizes up to 128 that work: "
                f"{', '.join(str(c) for c in range(1, min(channels, 128) + 1) if channels % c == 0)}"
            )
        if kwargs.pop("return_last_state", False):
            raise ValueError(f"{self.path}: a cp call hands on its state only to cp decode (cp_prefill)")
        share = slice(rank * channels // size, (rank + 1) * channels // size)
        named = [(name, x) for name, x in (("x", hidden_states), ("dt", dt), ("z", z)) if x is not None]
        exchanged = tuple(x for _, x in named)
        moved = iter(
            all_to_all_together(exchanged, 1, 2, group, f"{self.path} {' '.join(name for name, _ in named)}")
        )
        split = [None if x is None else next(moved) for x in (hidden_states, dt, z)]
        whole = [*split, *self.gathered((B, C), group)]
        own = [None if p is None else p[share] for p in (A, D, delta_bias)]
        prefill = call.state_sink is not None
        if prefill:  # the prompt only, not cp's padding after it: the final state is the one handed on
            whole = [None if x is None else x[..., : call.length] for x in whole]
        x, dt_split, z_split, whole_b, whole_c = whole
        outputs = self.original(
            x,
            dt_split,
            own[0],
            whole_b,
            whole_c,
            D=own[1],
            z=z_split,
            delta_bias=own[2],
            return_last_state=prefill,
            **kwargs,
        )
        if prefill:
            outputs, state = outputs
            self.sink(call, self.channels_gathered(state, group))
            outputs = F.pad(outputs, (0, hidden_states.shape[-1] * size - call.length))
        for phase, gather in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            # each per-channel input and the output, there and back; B and C gathered, their gradients back
            nbytes = sum(tensor_bytes(x) for x in exchanged) + tensor_bytes(outputs)
            expect(self.module, "all_to_all", phase, collectives_together(exchanged) + 1, nbytes)
            expect(
                self.module,
                gather,
                phase,
                1,
                (tensor_bytes(B) + tensor_bytes(C)) * (size if gather == "reduce_scatter" else 1),
            )
        return all_to_all(outputs, 2, 1, group, f"{self.path} output")

    def channels_gathered(self, state: torch.Tensor, group) -> torch.Tensor:
        """``[B, D, N]`` on every rank from each rank's ``[B, D / cp, N]`` (one all-gather)."""
        shard = state.transpose(0, 1).contiguous()
        rows = shard.shape[0] * dist.get_world_size(group)
        expect(self.module, "all_gather", "forward", 1, tensor_bytes(shard))
        return all_gather_shards([shard], [rows], group, f"{self.path} final state")[0].transpose(0, 1)

    def decode(self, step, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, **kwargs):
        """One token per row from the carried state, by the model's own one-token update (every rank
        alike)."""
        state = self.carried(step).clone()  # the update writes its state in place
        update = self.siblings["selective_state_update"]
        outputs = update(
            state,
            hidden_states[..., 0],
            dt[..., 0],
            A,
            B[..., 0],
            C[..., 0],
            D,
            z=None if z is None else z[..., 0],
            dt_bias=delta_bias,
            dt_softplus=kwargs.get("delta_softplus", False),
        )
        step.new_states[self.path] = state
        return outputs.unsqueeze(-1)

    def gathered(self, inputs: tuple, group) -> list[torch.Tensor]:
        """``inputs`` ``[B, N, T]`` of this rank's positions, whole along the sequence on every rank (one
        all-gather)."""
        size = dist.get_world_size(group)
        tokens = [x.permute(2, 0, 1).contiguous() for x in inputs]
        whole = all_gather_shards(tokens, [t.shape[0] * size for t in tokens], group, f"{self.path} B C")
        return [x.permute(1, 2, 0) for x in whole]


class Unfused(Slot):
    """A fused kernel that does a whole mixer in one call (``mamba_split_conv1d_scan_combined``): inside a
    cp call or decode step it answers None, as transformers' torch fallback does, so the mixer takes its
    unfused path through the slots cpshard serves; outside both, the model's own."""

    def serve(self, call, *args, **kwargs):
        return None

    def decode(self, step, *args, **kwargs):
        return None
