"""Recurrent mixers under cp: their kernel slots taken (:class:`~cpshard.recurrent.slot.Slot`), their
padding mask cut; the delta rules' kernel slot and the convolution's here, the state-space scans' in
:mod:`cpshard.recurrent.state_space`.

transformers 5.25 calls a Gated DeltaNet's or KDA's chunked kernel and its short convolution through
slots the kernels package keeps per module (``module._kernel_funcs``, filled by ``@use_kernelized_func``).

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

from cpshard.call import split_call
from cpshard.comm.exchange import all_to_all, all_to_all_together, collectives_together
from cpshard.comm.record import expect
from cpshard.interfaces import Hook
from cpshard.layouts.layout import CUT_AT_ENTRY, FUSED_SLOTS, RECURRENT_KERNELS, Layout, Recurrent
from cpshard.layouts.structure import kernel_slots, recurrent_module
from cpshard.recurrent.affine import correct_outputs, delta_rule_summary, fold_states
from cpshard.recurrent.blt import blt_entry_hooks
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.halo import declare_halo, with_halo
from cpshard.recurrent.hrm import hrm_entry_hooks
from cpshard.recurrent.inkling import check_inkling_unchanged, inkling_hooks
from cpshard.recurrent.inkling2 import inkling2_entry_hooks
from cpshard.recurrent.lightning import check_lightning_unchanged, lightning_hooks
from cpshard.recurrent.prophetnet import prophetnet_hooks
from cpshard.recurrent.reformer import reformer_entry_hooks
from cpshard.recurrent.rg_lru import check_rg_lru_unchanged, rg_lru_hooks
from cpshard.recurrent.rwkv import check_rwkv_unchanged, rwkv_hooks
from cpshard.recurrent.slot import Slot, cp_group, cut_to_rank, last_inputs, tensor_bytes
from cpshard.recurrent.state_space import ChannelSplit, SSDScan, Unfused
from cpshard.recurrent.xlm import xlm_entry_hooks
from cpshard.recurrent.xlstm import check_xlstm_unchanged, mlstm_hooks
from cpshard.recurrent.zaya import check_zaya_unchanged, zaya_hooks

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
    return 2 * (sum(tensor_bytes(x) for x in tensors) + output_bytes)


class DeltaRule(Slot):
    """A delta-rule kernel slot (``chunk_gated_delta_rule``, ``chunk_kda``): state passing or head split."""

    def serve(self, call, query, key, value, g=None, beta=None, initial_state=None, **kwargs):
        if kwargs.pop("cu_seqlens", None) is not None:
            raise ValueError(
                f"{self.path}: packed documents (cu_seqlens) in a linear-attention layer; cp does not yet "
                "keep their states apart across ranks: pass one document per row"
            )
        wants_final = kwargs.pop("output_final_state", False)
        kwargs.pop("initial_state", None)
        inputs, group = (query, key, value, g, beta), cp_group(call)
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
        output_bytes = tensor_bytes(value)
        return (
            "head_split" if divides and head_split_bytes(inputs, output_bytes) < passing else "state_passing"
        )

    def head_split(self, group, inputs, initial_state, wants_final: bool, kwargs):
        """Sequence-split inputs to head-split whole sequences, the model's kernel on them, and back."""
        if initial_state is not None or wants_final:
            raise ValueError(f"{self.path}: the head split carries no state in or out of the call")
        per_phase = head_split_bytes(inputs, tensor_bytes(inputs[2])) // 2
        kernel_inputs = tuple(inputs[: len(_INPUTS)])
        count = collectives_together(kernel_inputs) + 1  # the inputs together, the output, there and back
        for phase in ("forward", "backward"):
            expect(self.module, "all_to_all", phase, count, per_phase)
        whole = all_to_all_together(kernel_inputs, 2, 1, group, f"{self.path} {' '.join(_INPUTS)}")
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


class Halo(Slot):
    """A short causal convolution slot (``causal_conv1d_fn``): the slice with the previous rank's halo."""

    def serve(self, call, hidden_states, weight, bias=None, activation=None, **kwargs):
        width, group = weight.shape[-1] - 1, cp_group(call)
        declare_halo(self.module, hidden_states[..., :width], group)
        widened = with_halo(hidden_states, width, group, f"{self.path} conv halo")
        if call.state_sink is not None:  # a prefill: the last real token's inputs are carried on
            self.sink(call, last_inputs(widened, width, call, self.module, f"{self.path} conv state"))
        return self.original(widened, weight, bias, activation=activation, **kwargs)[..., width:]

    def decode(self, step, hidden_states, weight, bias=None, activation=None, **kwargs):
        """One token per row after the carried inputs; the last ``kernel - 1`` inputs carried on."""
        widened = torch.cat([self.carried(step), hidden_states], dim=-1)
        step.new_states[self.path] = widened[..., hidden_states.shape[-1] :]
        outputs = self.original(widened, weight, bias, activation=activation, **kwargs)
        return outputs[..., -hidden_states.shape[-1] :]


def _cut_mask(module, args, kwargs):
    call = split_call()
    mask = kwargs.get("attention_mask")
    if call is None or not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    return args, {**kwargs, "attention_mask": cut_to_rank(mask, call)}


def _take(slots: dict, name: str, kind: type, path: str) -> None:
    current = slots[name]
    original = current.original if isinstance(current, Slot) else current  # installed before: re-taken
    slots[name] = kind(original, path, name, slots)


def install_recurrent(layers: nn.ModuleList, rows: tuple[Recurrent, ...], layers_path: str) -> list[Hook]:
    """Take the kernel and convolution slots of every recurrent mixer in ``layers`` (idempotent); the
    hooks that cut their padding masks, to install with the others."""
    hooks = []
    for index, layer in enumerate(layers):
        found = recurrent_module(layer, rows)
        if found is None:
            continue
        module, row = found
        if row.kernel in CUT_AT_ENTRY:  # served through the decoder's entry hook (entry_hooks)
            continue
        slots, path = kernel_slots(module), f"{layers_path}.{index}.{row.module}"
        hooks.append(Hook(module, _cut_mask, pre=True))
        if row.kernel in HOOKED_MIXERS:
            check_unchanged, mixer_hooks = HOOKED_MIXERS[row.kernel]
            check_unchanged()
            hooks += mixer_hooks(layer, f"{layers_path}.{index}", row.module)
            continue
        _take(slots, row.kernel, SCAN_SLOTS[RECURRENT_KERNELS[row.kernel]], path)
        for fused in FUSED_SLOTS.intersection(slots):
            _take(slots, fused, Unfused, path)
        if row.conv is not None:
            _take(slots, row.conv, Halo, path)
    return hooks


def entry_hooks(decoder: nn.Module, layers: nn.ModuleList, layout: Layout) -> list[Hook]:
    """The hooks that cut the sequence where it enters the ``decoder``, and what its ``layers`` hold: those
    of its mixers' kernel (:data:`~cpshard.layouts.layout.CUT_AT_ENTRY`), else, in a layout cut there
    (:attr:`Layout.cut_at_entry`), the decoder's class's (:data:`~cpshard.layouts.layout.ENTERED_DECODERS`).
    A layout cut there with neither is refused: nothing would cut the sequence at all."""
    kernels = sorted({row.kernel for row in layout.recurrent} & CUT_AT_ENTRY)
    installers = [ENTRY_HOOKS[kernel] for kernel in kernels]
    if layout.cut_at_entry and not installers and type(decoder).__name__ in DECODER_ENTRY_HOOKS:
        installers.append(DECODER_ENTRY_HOOKS[type(decoder).__name__])
    if layout.cut_at_entry and not installers:
        raise ValueError(
            f"layout {layout.name!r} cuts the sequence where it enters {layout.decoder} "
            f"({type(decoder).__name__}), for which cpshard has no entry hook (kernels "
            f"{', '.join(sorted(CUT_AT_ENTRY))}; decoders {', '.join(sorted(DECODER_ENTRY_HOOKS))})"
        )
    return [hook for install in installers for hook in install(decoder, layers, layout.decoder_layers)]


def _on_mixer(hooks):
    """``hooks(mixer, path)`` as an installer of a layer's mixer (the layer, its path, the mixer's name)."""
    return lambda layer, at, name: hooks(layer.get_submodule(name), ".".join(filter(None, (at, name))))


#: the kernels served by hooks (:data:`~cpshard.layouts.layout.HOOKED`): the check of the code their hooks
#: were written against, and the installer of one layer's (RWKV's token shifts sit beside its mixer)
HOOKED_MIXERS = {
    "lightning": (check_lightning_unchanged, _on_mixer(lightning_hooks)),
    "rg_lru": (check_rg_lru_unchanged, _on_mixer(rg_lru_hooks)),
    "rwkv": (check_rwkv_unchanged, rwkv_hooks),
    "mlstm": (check_xlstm_unchanged, _on_mixer(mlstm_hooks)),
    "zaya_cca": (check_zaya_unchanged, _on_mixer(zaya_hooks)),
    "inkling": (check_inkling_unchanged, _on_mixer(inkling_hooks)),
}
#: the installers of the decoder's entry hooks, by kernel (:func:`entry_hooks`)
ENTRY_HOOKS = {"inkling2": inkling2_entry_hooks}
#: the installers of the decoder's entry hooks, by the decoder's class
#: (:data:`~cpshard.layouts.layout.ENTERED_DECODERS`, whose names these are)
DECODER_ENTRY_HOOKS = {
    "HrmTextModel": hrm_entry_hooks,
    "XLMModel": xlm_entry_hooks,
    "ProphetNetDecoder": prophetnet_hooks,
    "ReformerModel": reformer_entry_hooks,
    "BltModel": blt_entry_hooks,
}
#: the slot that serves each decay kind's kernel ("none": the kernel is a convolution, served by its halo)
SCAN_SLOTS = {"matrix": DeltaRule, "scalar": SSDScan, "diagonal": ChannelSplit, "none": Halo}
