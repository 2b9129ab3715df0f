"""A slice of tokens acts on the state it receives affinely: the summaries state passing exchanges.

Every linear-attention mixer updates its state ``[B, H, dk, dv]`` by ``S_t = A_t S_{t-1} + B_t``, so a
slice acts as ``S_out = M S_in + S_local`` and its outputs are ``o = o_zero + Q_eff S_in``. Mamba2's SSD
is one of them with its state ``[P, N]`` read transposed (``N`` plays ``dk``, ``P`` plays ``dv``) and ``M``
a scalar per row and head, kept as a ``1 x 1`` matrix; RG-LRU's diagonal recurrence another, each channel a
head of a ``1 x 1`` state. Each rank
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


def widened_by_identity(values: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` ``[B, T, H, w]`` with ``size`` zero columns more, and the initial state ``[B, H, size, w +
    size]`` that holds zeros for the ``w`` columns and the ``size x size`` identity for the new ones."""
    batch, length, heads, width = values.shape
    identity = torch.eye(size, device=values.device, dtype=values.dtype).expand(batch, heads, size, size)
    initial = torch.cat([identity.new_zeros(batch, heads, size, width), identity], dim=-1)
    return torch.cat([values, values.new_zeros(batch, length, heads, size)], dim=-1), initial


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
    dv = value.shape[-1]
    widened, initial_state = widened_by_identity(value, key.shape[-1])
    kernel_kwargs |= {"g": g, "beta": beta, "initial_state": initial_state, "output_final_state": True}
    out, state = kernel(query, key, widened, **kernel_kwargs)
    return SliceSummary(out[..., :dv], out[..., dv:], state[..., :dv], state[..., dv:])


def ssd_summary(
    kernel: Callable, hidden_states, dt, A, B, C, chunk_size: int, **kernel_kwargs
) -> SliceSummary:
    """One call of the model's own SSD scan (transformers' ``mamba2_chunk_scan`` or mamba_ssm's
    ``mamba_chunk_scan_combined``) from a zero state gives ``o_zero`` and ``S_local``; its decay is a scalar
    per row, step and head, so ``M`` and ``Q_eff`` have a closed form (:func:`ssd_decays`) and the scan runs
    at its own width (widening it by an identity, as :func:`delta_rule_summary` must, would cost ``(P + N) /
    P`` scans). ``kernel_kwargs`` are the model's own (``D``, ``dt_bias``, ``dt_softplus``, ``dt_limit``);
    ``D``'s skip term does not read the state."""
    kernel_kwargs |= {"return_final_states": True}
    out, state = kernel(hidden_states, dt, A, B, C, chunk_size, **kernel_kwargs)
    log_decay = torch.cumsum(A.float() * kernel_dt(dt, **kernel_kwargs).float(), dim=1)  # [B, T, H]
    q_eff, transition = ssd_decays(log_decay, C.float(), hidden_states.shape[2])
    return SliceSummary(out.float(), q_eff, state.float().transpose(-1, -2), transition)


def kernel_dt(dt, dt_bias=None, dt_softplus: bool = False, dt_limit=(0.0, float("inf")), **_) -> torch.Tensor:
    """The step sizes the SSD kernel discretises with, as its interface defines them: ``dt`` plus
    ``dt_bias``, through softplus where asked, clamped to ``dt_limit``, in ``dt``'s dtype."""
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    return torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])


def ssd_decays(log_decay: torch.Tensor, C: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q_eff, M)`` of an SSD slice from its running log decay ``[B, T, H]`` (``sum_{s<=t} A dt_s``) and
    ``C`` ``[B, T, G, N]`` (``G`` groups of heads): output ``t`` reads the incoming state through
    ``exp(log_decay_t) C_t`` (``[B, T, H, N]``), and the slice carries it on by ``exp(log_decay_T)``
    (``[B, H, 1, 1]``)."""
    decay = torch.exp(log_decay)
    per_head = C.repeat_interleave(heads // C.shape[2], dim=2)
    return per_head * decay[..., None], decay[:, -1, :, None, None]


def diagonal_summary(scan: Callable, hidden_states, gate, reset, acc_dtype) -> SliceSummary:
    """One call of the model's own diagonal scan (RG-LRU's ``_rnn_scan``: ``h_t = a_t h_{t-1} + x_t`` per
    channel, ``[B, T, D]``) summarises a slice: the batch doubled, the copy's inputs zero and its state
    started from ones, returns ``prod_{s<=t} a_s`` (``Q_eff``) beside the outputs and the slice's decay
    (``M``) beside ``S_local``. Each channel is a head of a ``1 x 1`` state. Inputs are upcast so that the
    outputs come back fp32 (the scan accumulates in fp32 whatever it is given)."""
    x, batch = hidden_states.float(), hidden_states.shape[0]
    initial = torch.cat([x.new_zeros(x[:, 0].shape), x.new_ones(x[:, 0].shape)])
    reset = reset.expand(batch, *reset.shape[1:])  # position_ids may be one row for all
    doubled = [torch.cat([t, t]) for t in (gate.float(), reset)]
    out, state = scan(torch.cat([x, torch.zeros_like(x)]), *doubled, initial, acc_dtype)
    out, state = out[..., None].float(), state[..., None, None].float()
    return SliceSummary(out[:batch], out[batch:], state[:batch], state[batch:])


def stabilised_fold(previous: tuple, local: tuple, log_decay: torch.Tensor) -> tuple:
    """The state after a slice, kept as RWKV and xLSTM keep theirs: parts and a running max ``m``, the true
    state being ``part e^m``. ``previous``: the state entering the slice; ``local``: where the slice's own run
    from a zero state ended; ``log_decay``: the log of what the slice does to the state it receives (shaped as
    ``m``). True states add, ``part e^m = e^{log_decay} part_1 e^{m_1} + part_2 e^{m_2}``; the new ``m`` is
    the larger exponent, so the max-plus stabiliser composes as the recurrence does."""
    *parts_1, max_1 = previous
    *parts_2, max_2 = local
    carried = max_1 + log_decay
    new_max = torch.maximum(carried, max_2)
    old, new = torch.exp(carried - new_max), torch.exp(max_2 - new_max)

    def on(factor: torch.Tensor, part: torch.Tensor) -> torch.Tensor:  # m's shape, widened to the part's
        return factor.reshape(*factor.shape, *[1] * (part.dim() - factor.dim()))

    folded = (on(old, a) * a + on(new, b) * b for a, b in zip(parts_1, parts_2, strict=True))
    return (*folded, new_max)


def outgoing_state(
    transition: torch.Tensor, state_local: torch.Tensor, state_in: torch.Tensor
) -> torch.Tensor:
    """``M S_in + S_local`` in fp32: the state a slice hands on (the last slice's is the final state a
    generation cache keeps); a ``1 x 1`` ``M`` is a scalar decay."""
    transition, state_in = transition.float(), state_in.float()
    scalar = transition.shape[-2:] == (1, 1)  # SSD's decay (or a delta rule's dk = 1: the same product)
    return (transition * state_in if scalar else torch.matmul(transition, state_in)) + state_local.float()


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
