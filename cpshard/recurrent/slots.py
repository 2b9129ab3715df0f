"""Linear-attention mixers under cp: their kernel slots taken, their padding mask cut.

transformers 5.25 calls a Gated DeltaNet's or KDA's chunked kernel and its short convolution through
slots the kernels package keeps per module (``module._kernel_funcs``, filled by ``@use_kernelized_func``).
cpshard puts its own callable into each mixer's slots: inside a cp call it serves this rank's slice,
outside one it calls the model's own function, so the model is unchanged outside cp.

- The kernel slot runs the model's own kernel once on the slice (:func:`~cpshard.recurrent.affine.
  delta_rule_summary`), all-gathers the slices' fixed-size summaries over cp (fp32), folds those before
  this rank into its incoming state and corrects its outputs; the gather's backward carries the transposed
  chain.
- The convolution slot puts the previous rank's last ``kernel - 1`` positions in front of the slice
  (:func:`~cpshard.recurrent.halo.with_halo`) and drops their outputs.
- A forward pre-hook cuts the 2D padding mask the model hands the mixer to this rank's positions.

The sequence must be held in contiguous order (the plan sees to it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import CallPlan, split_call
from cpshard.comm.collectives import all_gather_shards
from cpshard.comm.redistribute import redistribute
from cpshard.interfaces import Hook
from cpshard.layouts.layout import Recurrent, kernel_slots, recurrent_module
from cpshard.recurrent.affine import correct_outputs, delta_rule_summary, fold_states
from cpshard.recurrent.halo import with_halo
from cpshard.spec.notation import Spec


class _Slot:
    """One slot of one mixer, taken by cpshard. ``serve`` runs inside a cp call; outside one, the model's
    own function (``original``) runs."""

    def __init__(self, original, path: str):
        self.original, self.path = original, path

    def forward(self, *args, **kwargs):
        if not isinstance(self, _Slot):  # the kernels package calls slots so under torch.compile
            raise RuntimeError(
                "cpshard's linear-attention slots do not run under torch.compile; compile a model that "
                "no cp_forward has prepared (or run this one eagerly)"
            )
        call = split_call()
        if call is None:
            return self.original(*args, **kwargs)
        return self.serve(call, *args, **kwargs)

    __call__ = forward

    def serve(self, call: CallPlan, *args, **kwargs):
        raise NotImplementedError


def _cp_group(call: CallPlan):
    return call.mesh.get_group("cp")


class StatePassing(_Slot):
    """A delta-rule kernel slot (``chunk_gated_delta_rule``, ``chunk_kda``) served by state passing."""

    def serve(self, call, query, key, value, g=None, beta=None, initial_state=None, **kwargs):
        if kwargs.get("cu_seqlens") is not None:
            raise ValueError(
                f"{self.path}: packed documents (cu_seqlens) in a linear-attention layer; cp does not yet "
                "keep their states apart across ranks: pass one document per row"
            )
        kwargs.pop("cu_seqlens", None)
        wants_final = kwargs.pop("output_final_state", False)
        kwargs.pop("initial_state", None)
        group = _cp_group(call)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        summary = delta_rule_summary(self.original, query, key, value, g, beta, **kwargs)
        transition, local = summary.transition, summary.state_local
        mine = torch.cat([transition.flatten(), local.flatten()])
        every = all_gather_shards([mine[None]], [size], group, f"{self.path} state")[0]
        transitions, locals_ = every.split([transition.numel(), local.numel()], dim=1)
        states = fold_states(
            [t.view_as(transition) for t in transitions], [s.view_as(local) for s in locals_], initial_state
        )
        # every rank's outputs depend on every summary (rank 0's through a zero), so that the gather's
        # backward, a reduce-scatter, runs on every rank
        state_in = states[rank] + 0 * states[-1]
        outputs = correct_outputs(summary.o_zero, summary.q_eff, state_in, query.dtype)
        return outputs, (states[-1] if wants_final else None)


class Halo(_Slot):
    """A short causal convolution slot (``causal_conv1d_fn``): the slice with the previous rank's halo."""

    def serve(self, call, hidden_states, weight, bias=None, activation=None, **kwargs):
        width = weight.shape[-1] - 1
        widened = with_halo(hidden_states, width, _cp_group(call), f"{self.path} conv halo")
        return self.original(widened, weight, bias, activation=activation, **kwargs)[..., width:]


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
    slots[name] = kind(original, f"{path} {name}")


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
        _take(slots, row.kernel, StatePassing, path)
        if row.conv is not None:
            _take(slots, row.conv, Halo, path)
        hooks.append(Hook(module, _cut_mask, pre=True))
    return hooks
