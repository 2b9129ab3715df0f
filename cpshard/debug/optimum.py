"""The analytic communication optimum: what every byte count in cpshard is checked against.

A training step's optimum by implementation (Ulysses, ring, hybrid), one redistribution's bytes and
one experts layer's token exchange: the bytes of each collective's input tensor on one rank, as
:mod:`cpshard.comm.record` counts them. :mod:`cpshard.debug.analytic` shows the same counts per
declared move of a layout, per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.attention.choice import choose_implementation
from cpshard.attention.ulysses import kv_replication
from cpshard.comm.redistribute import plan
from cpshard.debug.analytic import head_dim, value_head_dim
from cpshard.layouts.registry import resolve_layout
from cpshard.layouts.structure import text_config
from cpshard.runtime.forward import params_of
from cpshard.spec.notation import Spec
from cpshard.spec.sequence import chunk_positions, padded_length_for, positions


@dataclass(frozen=True)
class CommOptimum:
    """The bytes one rank must put into collectives for one training step, by purpose."""

    all_to_all: int
    gradients: int
    loss: int
    #: ring attention's point-to-point sends (k, v forward; k, v, dk, dv backward)
    send: int = 0

    @property
    def all_reduce(self) -> int:
        return self.gradients + self.loss

    @property
    def total(self) -> int:
        return self.all_to_all + self.all_reduce + self.send


def ulysses_optimum(
    *,
    batch: int,
    length: int,
    cp: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    param_bytes: int,
    itemsize: int = 4,
    value_head_dim: int | None = None,
) -> CommOptimum:
    """Bytes per rank per Ulysses training step on a cp-only mesh (inputs of each collective).

    Per decoder layer, forward and again backward: q, k and v (one all-to-all for the three) and the
    attention output (one more), each of ``B * L/cp * heads * head_dim`` elements (k and v with the kv
    heads after replication; v and the output ``value_head_dim`` wide where it differs, as in
    latent attention). Then one all-reduce of every gradient and one of the fp32 loss.
    """
    if cp == 1:
        return CommOptimum(0, 0, 0)
    tokens = batch * padded_length_for(length, cp) // cp
    kv = kv_heads * kv_replication(heads, kv_heads, cp)
    v = head_dim if value_head_dim is None else value_head_dim
    per_layer = tokens * itemsize * ((heads + kv) * head_dim + (kv + heads) * v)
    return CommOptimum(all_to_all=2 * layers * per_layer, gradients=param_bytes, loss=4)


def tp_sums_optimum(
    sums: list[tuple[str, str]], *, batch: int, length: int, cp: int, hidden: int, itemsize: int = 4
) -> dict[tuple[str, str], tuple[int, int]]:
    """``(event name, phase) -> (count, bytes)`` of the all-reduces over tp of the residual stream, each
    ``(event name, phase)`` of ``sums`` one (:func:`cpshard.parallel.tensor.tensor_parallel_sums`): each
    moves this rank's tokens of the stream, ``B * L/cp * hidden`` elements."""
    one = batch * padded_length_for(length, cp) // cp * hidden * itemsize
    counts: dict[tuple[str, str], int] = {}
    for key in sums:
        counts[key] = counts.get(key, 0) + 1
    return {key: (count, count * one) for key, count in counts.items()}


def ring_optimum(
    *,
    batch: int,
    length: int,
    cp: int,
    degree: int,
    order: str,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    param_bytes: int,
    itemsize: int = 4,
    rank: int = 0,
    value_head_dim: int | None = None,
) -> CommOptimum:
    """Bytes rank ``rank`` puts into collectives per ring (``degree`` 1) or hybrid training step,
    when every block is needed (head-tail under a causal mask; skipped blocks only save).

    Per layer: Ulysses inside groups of ``degree`` ranks as in :func:`ulysses_optimum`; then on
    a ring of ``R = cp / degree``: k and v forward R-1 times; backward k and v R-1 times and dk,
    dv (fp32) R times, the last hop bringing them home. Head-tail order is undone once before
    the LM head: the rank's real tokens of hidden state forward, its chunk of gradients back.
    """
    padded = padded_length_for(length, cp, order)
    tokens = batch * padded // cp
    kv = kv_heads * (kv_replication(heads, kv_heads, degree) if degree > 1 else 1)
    v = head_dim if value_head_dim is None else value_head_dim
    ulysses = 0 if degree == 1 else 2 * tokens * itemsize * ((heads + kv) * head_dim + (kv + heads) * v)
    block = tokens * kv * (head_dim + v)  # k and v of this rank's share of the heads, over its group's tokens
    ring = cp // degree
    send = layers * block * ((ring - 1) * itemsize + (ring - 1) * itemsize + ring * 4)
    undo = 0
    if order != "contiguous":
        held = int((positions(order, padded, cp, rank) < length).sum())
        undo = batch * hidden * itemsize * (held + len(chunk_positions(length, cp, rank)))
    return CommOptimum(all_to_all=layers * ulysses + undo, gradients=param_bytes, loss=4, send=send)


def moved_bytes(local_shape, dtype: torch.dtype, src: Spec | str, dst: Spec | str) -> int:
    """Bytes this rank sends into collectives for the move (the input size of each all-to-all)."""
    numel = 1
    for size in local_shape:
        numel *= size
    per_tensor = numel * torch.empty((), dtype=dtype).element_size()
    return sum(per_tensor for move in plan(src, dst) if move.kind == "all_to_all")


def ep_bytes(
    sent: int, received: int, hidden_size: int, element_size: int, num_experts: int
) -> dict[str, int]:
    """Bytes one rank puts into the EP collectives of one experts layer (the sizes of their input tensors,
    as :mod:`cpshard.comm.record` counts them, own rows included): ``sent`` pairs out, ``received`` in."""
    row = hidden_size * element_size
    return {"forward": num_experts * 8 + (sent + received) * row, "backward": (received + sent) * row}


def tp_share_bytes(
    tokens: int, hidden_size: int, top_k: int, element_size: int, shares: int = 1
) -> dict[str, int]:
    """Bytes one rank puts into the collectives over tp that join the tp ranks' shares of one experts
    layer of ``tokens`` tokens: the output forward, the gradients of the experts' input and of the
    routing weights backward. The "all_reduce" plan all-reduces whole tensors (``shares=1``) and moves
    nothing else; "dispatch" all-gathers each rank's token share (``shares=tp``, padded to the largest)
    and adds :func:`ep_bytes` for that share's pairs."""
    rows = -(-tokens // shares)
    return {
        "forward": rows * hidden_size * element_size,
        "backward": rows * (hidden_size + top_k) * element_size,
    }


def _sizes(model) -> dict:
    """The model's sizes that the optimum formulas take."""
    layout, config = resolve_layout(model), text_config(model)
    if layout.recurrent:
        raise ValueError(
            f"{type(model).__name__} has recurrent layers: their bytes are per layer and scheme "
            "(cpshard.recurrent.slots.state_passing_bytes and head_split_bytes), which a step's optimum "
            "of attention layers does not count"
        )
    heads, kv_heads = layout.head_counts(config)
    params = list(params_of(model).values())
    return dict(
        layers=len(model.get_submodule(layout.decoder_layers)),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim(config, layout),
        value_head_dim=value_head_dim(config, layout),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        itemsize=params[0].element_size(),
    )


def optimum_of(model, batch: int, length: int, cp: int) -> CommOptimum:
    """:func:`ulysses_optimum` with the sizes read off ``model`` and its layout."""
    return ulysses_optimum(batch=batch, length=length, cp=cp, **_sizes(model))


def ring_optimum_of(
    model, batch: int, length: int, cp: int, degree: int, order: str, rank: int = 0
) -> CommOptimum:
    """:func:`ring_optimum` with the sizes read off ``model`` and its layout."""
    return ring_optimum(
        batch=batch,
        length=length,
        cp=cp,
        degree=degree,
        order=order,
        hidden=text_config(model).hidden_size,
        rank=rank,
        **_sizes(model),
    )


def optimum_for(
    model, batch: int, length: int, cp: int, implementation: str = "auto", sequence_order: str = "auto"
) -> CommOptimum:
    """Rank 0's optimum for ``make_cp_forward(model, implementation=..., sequence_order=...)``: the
    implementation and Ulysses degree it would choose for this cp, and its sequence order."""
    heads = resolve_layout(model).head_counts(text_config(model))[0]
    chosen, degree = choose_implementation(implementation, heads, cp)
    if chosen == "ulysses":
        return optimum_of(model, batch, length, cp)
    return ring_optimum_of(
        model, batch, length, cp, degree, "head_tail" if sequence_order == "auto" else sequence_order
    )
