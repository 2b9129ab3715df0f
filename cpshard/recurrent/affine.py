"""A slice of tokens acts on the state it receives affinely: the summaries state passing exchanges.

Every linear-attention mixer updates its state ``[B, H, dk, dv]`` by ``S_t = A_t S_{t-1} + B_t``, so a
slice acts as ``S_out = M S_in + S_local`` and its outputs are ``o = o_zero + Q_eff S_in``. Each rank
summarises its slice from a zero state, the ranks gather the summaries, each folds those before it into
its true ``S_in`` and corrects its outputs. Tensors are laid out ``[B, T, H, d]`` as the kernels take
them; summaries and the fold are fp32 (bf16 chains drift over long folds).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch


class SliceSummary(NamedTuple):
    """What one slice's kernel call yields, all fp32."""

    #: ``[B, T, H, dv]``: the slice's outputs had it started from a zero state
    o_zero: torch.Tensor
    #: ``[B, T, H, dk]``: what each output reads of the incoming state, ``o = o_zero + q_eff S_in``
    q_eff: torch.Tensor
    #: ``[B, H, dk, dv]``: the slice's outgoing state had it started from a zero state
    state_local: torch.Tensor
    #: ``[B or 1, H, dk, dk]``: how the outgoing state carries the incoming one, ``S_out = M S_in + S_local``
    transition: torch.Tensor


def delta_rule_summary(kernel: Callable, query, key, value, g, beta, **kernel_kwargs) -> SliceSummary:
    """One call of the model's own chunked delta-rule kernel (transformers' ``torch_chunk_gated_delta_rule``,
    ``chunk_kimi_delta_attention``, or fla's) summarises a slice.

    The kernel is linear in ``(v, initial_state)`` jointly and treats state columns (the v axis)
    independently, so widening v by ``dk`` zero columns and starting those columns from the identity
    returns ``Q_eff`` beside ``o_zero`` and ``M`` beside ``S_local``; no kernel internals are needed and
    autograd through the kernel gives every gradient. Inputs are upcast so that the outputs come back fp32
    (the torch kernels compute in fp32 whatever they are given, so their arithmetic is unchanged).
    ``kernel_kwargs`` are the model's own (``use_qk_l2norm_in_kernel=True``, ``chunk_size``).
    """
    query, key, value, g, beta = (x.float() for x in (query, key, value, g, beta))
    batch, length, heads, dv = value.shape
    dk = key.shape[-1]
    identity = torch.eye(dk, device=value.device).expand(batch, heads, dk, dk)
    initial_state = torch.cat([identity.new_zeros(batch, heads, dk, dv), identity], dim=-1)
    widened = torch.cat([value, value.new_zeros(batch, length, heads, dk)], dim=-1)
    out, state = kernel(
        query,
        key,
        widened,
        g=g,
        beta=beta,
        initial_state=initial_state,
        output_final_state=True,
        **kernel_kwargs,
    )
    return SliceSummary(out[..., :dv], out[..., dv:], state[..., :dv], state[..., dv:])


def outgoing_state(
    transition: torch.Tensor, state_local: torch.Tensor, state_in: torch.Tensor
) -> torch.Tensor:
    """``M S_in + S_local`` in fp32: the state a slice hands on (the last slice's is the final state a
    generation cache keeps)."""
    return torch.matmul(transition.float(), state_in.float()) + state_local.float()


def fold_states(
    transitions: Sequence[torch.Tensor],
    local_states: Sequence[torch.Tensor],
    initial_state: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The states at the slice boundaries, in sequence order, from the gathered summaries.

    ``states[r]`` enters slice ``r`` (``states[0]`` is ``initial_state``, a cache's, or zero);
    ``states[-1]`` leaves the last slice. A rank holding all summaries takes ``states[rank]`` (it may
    pass only the summaries before it); the fold is plain tensor arithmetic, so autograd carries the
    gradient back to every summary and to ``initial_state``.
    """
    state = torch.zeros_like(local_states[0], dtype=torch.float32) if initial_state is None else initial_state
    states = [state.float()]
    for transition, state_local in zip(transitions, local_states, strict=True):
        states.append(outgoing_state(transition, state_local, states[-1]))
    return states


def correct_outputs(
    o_zero: torch.Tensor, q_eff: torch.Tensor, state_in: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The slice's exact outputs ``o_zero + Q_eff S_in``, summed in fp32 and rounded once to ``dtype``
    (the kernel's output dtype: its query's)."""
    correction = torch.einsum("bthk,bhkv->bthv", q_eff.float(), state_in.float())
    return (o_zero.float() + correction).to(dtype)
