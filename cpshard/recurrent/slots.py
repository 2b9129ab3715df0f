"""Linear-attention mixers under cp: their kernel slots taken, their padding mask cut.

transformers 5.25 calls a Gated DeltaNet's or KDA's chunked kernel and its short convolution through
slots the kernels package keeps per module (``module._kernel_funcs``, filled by ``@use_kernelized_func``).
cpshard puts its own callable into each mixer's slots: inside a cp call it serves this rank's slice,
outside one it calls the model's own function, so the model is unchanged outside cp.

- The kernel slot runs by state passing: the model's own kernel once on the slice (:func:`~cpshard.recurrent.
  affine.delta_rule_summary`), the slices' fixed-size summaries all-gathered over cp (fp32), those before
  this rank folded into its incoming state and its outputs corrected; the gather's backward carries the
  transposed chain. Or by the head split (Ulysses for linear layers): the kernel's inputs exchanged from
  sequence-split to head-split, the kernel on whole sequences for a share of the heads, and back. The call
  asks for one, or for the one with fewer analytic bytes.
- The convolution slot puts the previous rank's last ``kernel - 1`` positions in front of the slice
  (:func:`~cpshard.recurrent.halo.with_halo`) and drops their outputs.
- A forward pre-hook cuts the 2D padding mask the model hands the mixer to this rank's positions.

The sequence must be held in contiguous order (the plan sees to it).

Generation: a prefill's call carries a ``state_sink``, where each slot leaves the state the prompt hands on
(a kernel its state after the prompt's last token, a convolution that token's last ``kernel - 1`` inputs),
the same on every rank; a decode step (one token per row, nothing split) gives each slot its state back
and takes the new one, so every rank continues the recurrence alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import CallPlan, active_decode, split_call
from cpshard.comm.collectives import all_gather_shards, all_to_all, sum_over_group
from cpshard.comm.record import expect
from cpshard.comm.redistribute import redistribute
from cpshard.interfaces import Hook
from cpshard.layouts.layout import FUSED_SLOTS, RECURRENT_KERNELS, Recurrent, kernel_slots, recurrent_module
from cpshard.recurrent.affine import (
    correct_outputs,
    delta_rule_summary,
    fold_states,
    outgoing_state,
    ssd_summary,
)
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.halo import with_halo
from cpshard.recurrent.lightning import check_lightning_unchanged, lightning_hooks
from cpshard.spec.notation import Spec


class _Slot:
    """One slot of one mixer, taken by cpshard. ``serve`` runs inside a cp call, ``decode`` in a cp decode
    step; outside both, the model's own function (``original``) runs."""

    def __init__(self, original, module: str, name: str):
        self.original, self.module, self.path = original, module, f"{module} {name}"

    def forward(self, *args, **kwargs):
        if not isinstance(self, _Slot):  # the kernels package calls slots so under torch.compile
            raise RuntimeError(
                "cpshard's linear-attention slots do not run under torch.compile; compile a model that "
                "no cp_forward has prepared (or run this one eagerly)"
            )
        call = split_call()
        if call is not None:
            return self.serve(call, *args, **kwargs)
        step = active_decode()
        if step is not None:
            return self.decode(step, *args, **kwargs)
        return self.original(*args, **kwargs)

    __call__ = forward

    def serve(self, call: CallPlan, *args, **kwargs):
        raise NotImplementedError

    def decode(self, step, *args, **kwargs):
        raise NotImplementedError

    def sink(self, call: CallPlan, state: torch.Tensor) -> None:
        """Leave the state this slot hands on after the prompt in a prefill's sink (once per forward)."""
        if self.path in call.state_sink:
            raise ValueError(
                f"{self.path} ran twice in one forward; cp generation carries one state per slot and call"
            )
        call.state_sink[self.path] = state

    def carried(self, step) -> torch.Tensor:
        """The state a decode step hands this slot, from the cache of the prefill or the last step."""
        if self.path not in step.states:
            raise ValueError(
                f"{self.path}: the cache holds no state for this layer; give cp_decode the cache that "
                "cp_prefill (or the last cp_decode) of this model returned"
            )
        return step.states[self.path]


def _cp_group(call: CallPlan):
    return call.mesh.get_group("cp")


#: how a linear-attention layer runs under cp (``make_cp_forward``'s ``recurrent``)
RECURRENT_SCHEMES = ("auto", "state_passing", "head_split")


def summary_bytes(batch: int, heads: int, dk: int, dv: int) -> int:
    """One slice's fp32 summary, ``M`` ``[dk, dk]`` and ``S_local`` ``[dk, dv]`` per row and head."""
    return batch * heads * dk * (dk + dv) * 4


def state_passing_bytes(batch: int, heads: int, dk: int, dv: int, cp: int) -> int:
    """What one rank puts into collectives for one layer, forward and backward, by state passing: its fp32
    summary all-gathered, and the reduce-scatter of every rank's gradient of it."""
    return summary_bytes(batch, heads, dk, dv) * (1 + cp)


def head_split_bytes(tensors: tuple[torch.Tensor, ...], output_bytes: int) -> int:
    """The same by the head split: every kernel input and the output all-to-all'd, forward and backward."""
    return 2 * (sum(x.numel() * x.element_size() for x in tensors) + output_bytes)


def _bytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def halo_bytes(tail: torch.Tensor) -> int:
    """A convolution's halo (or its carried inputs): ``[B, channels, kernel - 1]`` in the input's dtype."""
    return tail.numel() * tail.element_size()


class DeltaRule(_Slot):
    """A delta-rule kernel slot (``chunk_gated_delta_rule``, ``chunk_kda``): state passing or head split."""

    def serve(self, call, query, key, value, g=None, beta=None, initial_state=None, **kwargs):
        if kwargs.pop("cu_seqlens", None) is not None:
            raise ValueError(
                f"{self.path}: packed documents (cu_seqlens) in a linear-attention layer; cp does not yet "
                "keep their states apart across ranks: pass one document per row"
            )
        wants_final = kwargs.pop("output_final_state", False)
        kwargs.pop("initial_state", None)
        inputs, group = (query, key, value, g, beta), _cp_group(call)
        if call.state_sink is not None:  # a prefill: the state after the prompt's last token is carried on
            inputs = without_cp_padding(inputs, call.length, dist.get_rank(group))
            outputs, final = self.state_passing(group, inputs, initial_state, True, kwargs)
            self.sink(call, final)
            return outputs, (final if wants_final else None)
        if self.scheme(call, inputs, dist.get_world_size(group)) == "head_split":
            return self.head_split(group, inputs, initial_state, wants_final, kwargs)
        return self.state_passing(group, inputs, initial_state, wants_final, kwargs)

    def decode(self, step, query, key, value, g=None, beta=None, initial_state=None, **kwargs):
        """One token per row from the carried state (the model's own kernel, every rank alike)."""
        kwargs.pop("output_final_state", None)
        outputs, state = self.original(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=self.carried(step),
            output_final_state=True,
            **kwargs,
        )
        step.new_states[self.path] = state
        return outputs, None

    def scheme(self, call, inputs, cp: int) -> str:
        """The scheme of this layer and call: the one asked for, else the one with fewer analytic bytes
        (state passing where cp does not divide the heads)."""
        query, _, value = inputs[:3]
        divides = query.shape[2] % cp == 0 and value.shape[2] % cp == 0
        if call.recurrent == "head_split" and not divides:
            raise ValueError(
                f"{self.path}: recurrent='head_split' splits {query.shape[2]} key and {value.shape[2]} value "
                f"heads over cp={cp}, which does not divide them; use recurrent='state_passing' or 'auto'"
            )
        if call.recurrent != "auto":
            return call.recurrent
        batch, _, heads, dv = value.shape
        passing = state_passing_bytes(batch, heads, query.shape[-1], dv, cp)
        output_bytes = value.numel() * value.element_size()
        return (
            "head_split" if divides and head_split_bytes(inputs, output_bytes) < passing else "state_passing"
        )

    def head_split(self, group, inputs, initial_state, wants_final: bool, kwargs):
        """Sequence-split inputs to head-split whole sequences, the model's kernel on them, and back."""
        if initial_state is not None or wants_final:
            raise ValueError(f"{self.path}: the head split carries no state in or out of the call")
        per_phase = head_split_bytes(inputs, inputs[2].numel() * inputs[2].element_size()) // 2
        for phase in ("forward", "backward"):  # each input and the output, there and back
            expect(self.module, "all_to_all", phase, len(_INPUTS) + 1, per_phase)
        whole = [all_to_all(x, 2, 1, group, f"{self.path} {name}") for name, x in zip(_INPUTS, inputs)]
        outputs, _ = self.original(*whole[:3], g=whole[3], beta=whole[4], **kwargs)
        return all_to_all(outputs, 1, 2, group, f"{self.path} output"), None

    def state_passing(self, group, inputs, initial_state, wants_final: bool, kwargs):
        """The slice from a zero state, its summary gathered, the incoming state folded, the outputs
        corrected."""
        rank, (batch, _, heads, dv) = dist.get_rank(group), inputs[2].shape
        summary = delta_rule_summary(self.original, *inputs[:3], inputs[3], inputs[4], **kwargs)
        nbytes = summary_bytes(batch, heads, inputs[1].shape[-1], dv)
        every = gathered_summaries((summary.transition, summary.state_local), group, self.path, nbytes)
        states = fold_states(*zip(*every, strict=True), initial_state)
        # every rank's outputs depend on every summary (rank 0's through a zero), so that the gather's
        # backward, a reduce-scatter, runs on every rank
        state_in = states[rank] + 0 * states[-1]
        outputs = correct_outputs(summary.o_zero, summary.q_eff, state_in, inputs[0].dtype)
        return outputs, (states[-1] if wants_final else None)


#: the kernel's per-token inputs, ``[B, T, heads, ...]``, as the head split names their exchanges
_INPUTS = ("q", "k", "v", "g", "beta")


def without_cp_padding(inputs: tuple, length: int, rank: int) -> tuple:
    """The kernel's inputs with the positions cp padded past the sequence's ``length`` made to leave the
    state as it is (no key, no decay: ``k = 0``, ``g = 0``), so that the last slice hands on the state
    after the last real token. Their outputs, read by no real token, change."""
    query, key, value, g, beta = inputs
    held = key.shape[1]
    real = torch.arange(rank * held, (rank + 1) * held, device=key.device) < length
    if bool(real.all()):
        return inputs
    kept = lambda x: torch.where(real.view(1, -1, *[1] * (x.dim() - 2)), x, 0)  # noqa: E731
    return query, kept(key), value, kept(g), beta


class SSDScan(_Slot):
    """Mamba2's chunked scan slot (``mamba_chunk_scan_combined``), by state passing: the slice scanned
    from a zero state with the model's own kernel (:func:`~cpshard.recurrent.affine.ssd_summary`), the
    summaries gathered, the incoming state folded (a scalar decay per row and head) and the outputs
    corrected before the mixer's gate and norm."""

    def serve(self, call, hidden_states, dt, A, B, C, chunk_size, initial_states=None, **kwargs):
        packed = [name for name in ("seq_idx", "cu_seqlens") if kwargs.pop(name, None) is not None]
        if packed:
            raise ValueError(
                f"{self.path}: packed documents ({packed[0]}) in a state-space layer; cp does not yet keep "
                "their states apart across ranks: pass one document per row"
            )
        if call.recurrent == "head_split":
            raise ValueError(
                f"{self.path}: recurrent='head_split' is not served for Mamba2 layers yet; use "
                "recurrent='state_passing' or 'auto'"
            )
        wants_final = kwargs.pop("return_final_states", False)
        if kwargs.pop("z", None) is not None:  # transformers' mixers gate after the scan, in their norm
            raise ValueError(
                f"{self.path}: a gate z inside the scan (applied to its outputs before cp's correction) is "
                "not served; cp serves mixers that gate after the scan, as transformers' Mamba2 mixers do"
            )
        group = _cp_group(call)
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
            self.sink(call, self.state_at(call.length, inputs, states, group, kwargs).transpose(-1, -2))
        return (outputs, states[-1].transpose(-1, -2)) if wants_final else outputs

    def state_at(self, length: int, inputs: tuple, states: list, group, kwargs) -> torch.Tensor:
        """The state after position ``length - 1`` (before the positions cp padded past the sequence), on
        every rank: the rank that holds that position scans its slice up to it from its incoming state, one
        all-reduce brings it to the others. (A delta rule makes its padding a no-op instead; the scan's
        time step cannot be zeroed through its inputs where ``dt_limit`` floors it.)"""
        rank, held = dist.get_rank(group), inputs[0].shape[1]
        end = length - rank * held
        if 0 < end < held:
            x, dt, A, B, C, chunk_size = inputs
            cut = ssd_summary(
                self.original, x[:, :end], dt[:, :end], A, B[:, :end], C[:, :end], chunk_size, **kwargs
            )
            mine = outgoing_state(cut.transition, cut.state_local, states[rank])
        else:
            mine = states[rank + 1] if end == held else torch.zeros_like(states[rank])
        expect(self.module, "all_reduce", "forward", 1, mine.numel() * 4)
        return sum_over_group(mine, group, name=f"{self.path} final state")

    def decode(self, step, hidden_states, dt, A, B, C, chunk_size, initial_states=None, **kwargs):
        """One token per row from the carried state (the model's own scan, every rank alike)."""
        kwargs.pop("return_final_states", None)
        outputs, state = self.original(
            hidden_states,
            dt,
            A,
            B,
            C,
            chunk_size,
            initial_states=self.carried(step),
            return_final_states=True,
            **kwargs,
        )
        step.new_states[self.path] = state
        return outputs


class ChannelSplit(_Slot):
    """Mamba1's selective scan slot (``selective_scan_fn``), split over channels: its per-channel inputs
    (``x``, ``dt``, the gate ``z``; ``[B, D, T]``) go from sequence-split to channel-split by all-to-all,
    ``B`` and ``C`` (``[B, N, T]``, shared by every channel) are all-gathered, the model's own scan runs on
    whole sequences for ``D / cp`` channels (so on one process's arithmetic) and its output comes back. The
    scan takes no incoming state, so state passing would rebuild its decays outside the model's code; the
    split needs none, and ``D`` (the inner width) is large."""

    def serve(self, call, hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, **kwargs):
        group = _cp_group(call)
        size, rank, channels = dist.get_world_size(group), dist.get_rank(group), hidden_states.shape[1]
        if call.recurrent == "state_passing" or channels % size:
            raise ValueError(
                f"{self.path}: Mamba1's selective scan is served by a split of its {channels} channels over "
                f"cp={size} ranks (recurrent='auto' or 'head_split'), which cp must divide"
            )
        if kwargs.get("return_last_state"):
            raise ValueError(f"{self.path}: the channel split hands on no state")
        share = slice(rank * channels // size, (rank + 1) * channels // size)
        split = [
            None if x is None else all_to_all(x, 1, 2, group, f"{self.path} {name}")
            for name, x in (("x", hidden_states), ("dt", dt), ("z", z))
        ]
        whole_b, whole_c = self.gathered((B, C), group)
        own = [None if p is None else p[share] for p in (A, D, delta_bias)]
        outputs = self.original(
            split[0], split[1], own[0], whole_b, whole_c, D=own[1], z=split[2], delta_bias=own[2], **kwargs
        )
        exchanged = [x for x in (hidden_states, dt, z) if x is not None]
        for phase, gather in (("forward", "all_gather"), ("backward", "reduce_scatter")):
            # each per-channel input and the output, there and back; B and C gathered, their gradients back
            nbytes = sum(_bytes(x) for x in exchanged) + _bytes(outputs)
            expect(self.module, "all_to_all", phase, len(exchanged) + 1, nbytes)
            expect(
                self.module,
                gather,
                phase,
                1,
                (_bytes(B) + _bytes(C)) * (size if gather == "reduce_scatter" else 1),
            )
        return all_to_all(outputs, 2, 1, group, f"{self.path} output")

    def gathered(self, inputs: tuple, group) -> list[torch.Tensor]:
        """``inputs`` ``[B, N, T]`` of this rank's positions, whole along the sequence on every rank (one
        all-gather)."""
        size = dist.get_world_size(group)
        tokens = [x.permute(2, 0, 1).contiguous() for x in inputs]
        whole = all_gather_shards(tokens, [t.shape[0] * size for t in tokens], group, f"{self.path} B C")
        return [x.permute(1, 2, 0) for x in whole]


class Unfused(_Slot):
    """A fused kernel that does a whole mixer in one call (``mamba_split_conv1d_scan_combined``): inside a
    cp call or decode step it answers None, as transformers' torch fallback does, so the mixer takes its
    unfused path through the slots cpshard serves; outside both, the model's own."""

    def serve(self, call, *args, **kwargs):
        return None

    def decode(self, step, *args, **kwargs):
        return None


class Halo(_Slot):
    """A short causal convolution slot (``causal_conv1d_fn``): the slice with the previous rank's halo."""

    def serve(self, call, hidden_states, weight, bias=None, activation=None, **kwargs):
        width, group = weight.shape[-1] - 1, _cp_group(call)
        nbytes = halo_bytes(hidden_states[..., :width])
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        for phase in ("forward",) * (rank < size - 1) + ("backward",) * (rank > 0):  # one step on, one back
            expect(self.module, "send", phase, 1, nbytes)
        widened = with_halo(hidden_states, width, group, f"{self.path} conv halo")
        if call.state_sink is not None:  # a prefill: the last real token's inputs are carried on
            expect(self.module, "all_reduce", "forward", 1, nbytes)
            self.sink(call, last_inputs(widened, width, call.length, group, f"{self.path} conv state"))
        return self.original(widened, weight, bias, activation=activation, **kwargs)[..., width:]

    def decode(self, step, hidden_states, weight, bias=None, activation=None, **kwargs):
        """One token per row after the carried inputs; the last ``kernel - 1`` inputs carried on."""
        widened = torch.cat([self.carried(step), hidden_states], dim=-1)
        step.new_states[self.path] = widened[..., hidden_states.shape[-1] :]
        outputs = self.original(widened, weight, bias, activation=activation, **kwargs)
        return outputs[..., -hidden_states.shape[-1] :]


def last_inputs(widened: torch.Tensor, width: int, length: int, group, name: str) -> torch.Tensor:
    """``[..., width]``: the convolution's inputs at the sequence's last ``width`` real positions (before
    ``length``; zeros before the first), which the rank holding position ``length - 1`` finds in its
    halo-widened slice; one all-reduce brings them to every rank."""
    held, rank = widened.shape[-1] - width, dist.get_rank(group)
    end = length - rank * held  # the real positions this rank holds, counted from its first
    mine = widened[..., end : end + width] if 0 < end <= held else torch.zeros_like(widened[..., :width])
    return sum_over_group(mine, group, name=name)


#: the padding mask a mixer takes, whole (``b s``), and as each rank keeps it
_MASK = (Spec("b s"), Spec("b s@cp"))


def _cut_mask(module, args, kwargs):
    call = split_call()
    mask = kwargs.get("attention_mask")
    if call is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    return args, {**kwargs, "attention_mask": redistribute(mask, *_MASK, call.mesh)}


def _take(slots: dict, name: str, kind: type, path: str) -> None:
    current = slots[name]
    original = current.original if isinstance(current, _Slot) else current  # installed before: re-taken
    slots[name] = kind(original, path, name)


def install_recurrent(layers: nn.ModuleList, rows: tuple[Recurrent, ...], layers_path: str) -> list[Hook]:
    """Take the kernel and convolution slots of every recurrent mixer in ``layers`` (idempotent); the
    hooks that cut their padding masks, to install with the others."""
    hooks = []
    for index, layer in enumerate(layers):
        found = recurrent_module(layer, rows)
        if found is None:
            continue
        module, row = found
        slots, path = kernel_slots(module), f"{layers_path}.{index}.{row.module}"
        hooks.append(Hook(module, _cut_mask, pre=True))
        if row.kernel == "lightning":
            check_lightning_unchanged()
            hooks += lightning_hooks(module, path)
            continue
        _take(slots, row.kernel, SCAN_SLOTS[RECURRENT_KERNELS[row.kernel]], path)
        for fused in FUSED_SLOTS.intersection(slots):
            _take(slots, fused, Unfused, path)
        if row.conv is not None:
            _take(slots, row.conv, Halo, path)
    return hooks


#: the slot that serves each decay kind's kernel ("none": the kernel is a convolution, served by its halo)
SCAN_SLOTS = {"matrix": DeltaRule, "scalar": SSDScan, "diagonal": ChannelSplit, "none": Halo}
