"""MiniMax's lightning attention under cp: the module's own block loop on each rank's slice, corrected
before its norm.

``MiniMaxLightningAttention`` runs its block loop inline (no kernel slot), from a zero state when there is
no cache; its state decays by a constant ``e^{-s}`` per token and head, so a slice of ``T`` tokens carries
the state it receives as ``e^{-s T} S_in`` and each output reads ``e^{-s (t + 1)} q_t S_in`` of it (``t``
counted in the slice). Under cp the module runs as it is on the slice, and a forward pre-hook on its
``norm`` (the first thing after the loop) adds that term: ``S_local`` of every rank is computed from the
slice's k and v, all-gathered over cp (fp32) and folded. Generation carries the state after the prompt's
last token (from the rank that holds it); a decode step adds what it adds to that token's output and carries
``e^{-s} S + k v^T`` on, as the model's cached path does. The hooks are written against transformers 5.25's
module and decoder layer (:data:`WRITTEN_AGAINST`); other code is refused at setup.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from cpshard.call import active_decode, split_call
from cpshard.interfaces import Hook
from cpshard.layouts.fingerprint import check_written_for, written_against
from cpshard.layouts.layout import LIGHTNING
from cpshard.recurrent.affine import fold_states
from cpshard.recurrent.exchange import gathered_summaries
from cpshard.recurrent.slot import carried_state, handed_on, sink_state

#: what the hooks were written against in transformers 5.25.0
WRITTEN_AGAINST = written_against(__name__)


def check_lightning_unchanged() -> None:
    check_written_for(f"{LIGHTNING} (corrected before its norm by cpshard)", *WRITTEN_AGAINST)


def _decays(slope: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e^{-s (t + 1)}, e^{-s (T - 1 - t)})`` ``[H, T]`` in fp32: what the incoming state is to each query,
    and what each key's write is to the slice's outgoing state."""
    steps = torch.arange(length, device=slope.device, dtype=torch.float32)
    rates = slope.float().reshape(-1, 1)
    return torch.exp(-rates * (steps + 1)), torch.exp(-rates * (length - 1 - steps))


def _keep_inputs(held: dict, module, args, kwargs):
    if split_call() is not None or active_decode() is not None:
        held["inputs"] = (args[0] if args else kwargs["hidden_states"], kwargs.get("attention_mask"))


def _qkv(module, hidden: torch.Tensor, mask) -> tuple[torch.Tensor, ...]:
    """q, k, v ``[B, T, H, d]`` as the module makes them (activation, padding zeroed)."""
    qkv = module.act_fn(module.qkv_proj(hidden))
    if mask is not None and mask.dim() == 2:
        qkv = qkv * mask[:, :, None].to(qkv.dtype)
    qkv = qkv.reshape(*hidden.shape[:2], module.num_attention_heads, 3 * module.head_dim)
    return torch.split(qkv, module.head_dim, dim=3)


def _local_state(module, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The state that ``key`` and ``value`` ``[B, T, H, d]`` (fp32) write from a zero state."""
    from_key = _decays(module.slope_rate, key.shape[1])[1]
    return torch.einsum("bthk,bthv->bhkv", key * from_key.T[None, :, :, None], value)


def _carry(module, length: int) -> torch.Tensor:
    """``e^{-s T}`` ``[1, H, 1, 1]``: what ``length`` tokens leave of the state they enter with."""
    return torch.exp(-module.slope_rate.float().reshape(1, -1, 1, 1) * length)


def _written(module, key: torch.Tensor, value: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """The state after ``key`` and ``value``, entered with ``state_in``."""
    return _carry(module, key.shape[1]) * state_in + _local_state(module, key, value)


def _plus_incoming(module, output: torch.Tensor, query: torch.Tensor, state_in: torch.Tensor) -> torch.Tensor:
    """The zero-state outputs ``[B, T, H d]`` plus what ``state_in`` adds to each query."""
    to_query = _decays(module.slope_rate, query.shape[1])[0]
    correction = torch.einsum("bthk,bhkv->bthv", query * to_query.T[None, :, :, None], state_in)
    return output + correction.reshape(output.shape).to(output.dtype)


def _corrected(module, path: str, held: dict, norm, args, kwargs):
    """The norm's input, the slice's zero-state outputs ``[B, T, H d]``, plus what the incoming state adds."""
    call, carried_key = split_call(), f"{path} lightning"
    if call is None and (step := active_decode()) is not None:
        query, key, value = (x.float() for x in _qkv(module, *held.pop("inputs")))
        state_in = carried_state(step, carried_key)
        step.new_states[carried_key] = _written(module, key, value, state_in)
        return (_plus_incoming(module, args[0], query, state_in), *args[1:]), kwargs
    if call is None:
        return None
    hidden, mask = held.pop("inputs")
    query, key, value = (x.float() for x in _qkv(module, hidden, mask))
    length = query.shape[1]
    local = _local_state(module, key, value)
    group = call.mesh.get_group("cp")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    nbytes = query.shape[0] * module.num_attention_heads * module.head_dim**2 * 4  # S_local alone
    every = gathered_summaries((local,), group, path, nbytes)
    eye = torch.eye(module.head_dim, device=local.device)
    transition = _carry(module, length) * eye  # known without data
    states = fold_states([transition] * size, [local for (local,) in every])
    # every rank's output depends on every summary (rank 0's through a zero): the gather's backward runs
    state_in = states[rank] + 0 * states[-1]
    if call.state_sink is not None:  # a prefill: the state after the prompt's last token is carried on
        after = lambda end: _written(module, key[:, :end], value[:, :end], states[rank])  # noqa: E731
        sink_state(
            call, carried_key, handed_on(call, length, after, states[rank], path, f"{carried_key} state")
        )
    return (_plus_incoming(module, args[0], query, state_in), *args[1:]), kwargs


def lightning_hooks(module: nn.Module, path: str) -> list[Hook]:
    """The hooks that serve one lightning attention module under cp: the module's input, kept by the first
    in ``held`` for the second (the norm's, later in the same forward: a recomputed layer runs both again)."""
    held: dict = {}
    return [
        Hook(module, partial(_keep_inputs, held), pre=True),
        Hook(module.norm, partial(_corrected, module, path, held), pre=True),
    ]
