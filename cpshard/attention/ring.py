"""Ring attention: q stays on its rank, k and v travel around the ring, results merge by log-sum-exp.

The math lives in small pure functions over one block (a q slice against one k/v slice), in fp32 (float64 for
float64 inputs): torch's fused CPU flash-attention kernel (it returns the log-sum-exp and takes fewer kv
heads) where it applies, explicit softmax math where it cannot (softcapping, rows that must attend evenly);
:class:`RingAttention` runs the schedule forward and backward (dk and dv travel with k and v, as in the
standard ring backward). Every rank knows the whole mask, so every rank knows which blocks are needed at all:
a hidden block is neither computed nor, where no later rank on the ring needs it, sent.

Shapes: q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv, Sk, D]`` (Hq a multiple of Hkv), block masks
``[B or 1, 1, Sq, Sk]`` booleans (True: may attend).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from cpshard.comm.arrival import arriving
from cpshard.comm.record import active_recorder, record
from cpshard.precision import own_precision
from cpshard.spec.masks import additive_mask

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- block math


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, S, D]`` as ``[B, Hkv, G, S, D]``: the G q heads that share each kv head."""
    batch, heads, length, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads, length, dim)


@dataclass(frozen=True)
class Scoring:
    """How a block's scores become weights: the scale, tanh softcapping, and the q rows (``uniform``,
    ``[B, 1, Sq]`` booleans) that score 0 everywhere they may look, eager attention's value for a row
    whose every key is masked (its gradient still flows as eager's does)."""

    scale: float
    softcap: float | None = None
    uniform: torch.Tensor | None = None

    def rows(self, rows: slice) -> Scoring:
        return self if self.uniform is None else replace(self, uniform=self.uniform[..., rows])


@dataclass(frozen=True)
class Block:
    """One q slice against one k/v slice: grouped q ``[B, Hkv, G, Sq, D]`` (fp32), k and v
    ``[B, Hkv, Sk, D]``, the mask ``allowed`` ``[B or 1, 1, Sq, Sk]`` (True: may attend), the scoring, and a
    bias ``[B, Hkv, G, Sq, Sk]`` added to the scores (Inkling's relative positions, in a decode step) or
    None."""

    qg: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor
    scoring: Scoring
    bias: torch.Tensor | None = None

    def tile(self, rows: slice, cols: slice) -> Block:
        return Block(
            self.qg[..., rows, :],
            self.k[:, :, cols],
            self.v[:, :, cols],
            self.allowed[..., rows, cols],
            self.scoring.rows(rows),
            None if self.bias is None else self.bias[..., rows, cols],
        )


@dataclass(frozen=True)
class Merged:
    """What a block's backward needs of the forward merged over every block of its q rows: ``lse``,
    ``out``, the output's gradient ``grad_out`` and ``delta = rowsum(dO * O)``."""

    lse: torch.Tensor
    out: torch.Tensor
    grad_out: torch.Tensor
    delta: torch.Tensor

    def rows(self, rows: slice) -> Merged:
        return Merged(
            self.lse[..., rows], self.out[..., rows, :], self.grad_out[..., rows, :], self.delta[..., rows]
        )


def block_scores(block: Block):
    """Masked scores ``[B, Hkv, G, Sq, Sk]`` (-inf where hidden) and the softcap's tanh (or None)."""
    scoring = block.scoring
    raw = torch.einsum("bhgqd,bhkd->bhgqk", block.qg, block.k.to(block.qg.dtype)) * scoring.scale
    capped = None
    if scoring.softcap:
        capped = torch.tanh(raw / scoring.softcap)
        raw = capped * scoring.softcap
    if scoring.uniform is not None:
        raw = raw.masked_fill(scoring.uniform[:, :, None, :, None], 0.0)
    if block.bias is not None:
        raw = raw + block.bias
    return raw.masked_fill(~block.allowed.unsqueeze(2), NEG_INF), capped


def safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees no key) replaced by 0, so that exp(s - lse) is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _fused(block: Block) -> bool:
    """Whether torch's CPU flash kernel computes this block: plain scaled softmax, on the CPU."""
    scoring = block.scoring
    plain = scoring.softcap is None and scoring.uniform is None and block.bias is None
    return plain and block.qg.device.type == "cpu"


def _flash_attention(block: Block):
    """The fused kernel on one block; its lse of a row that sees nothing (which it reports as 0) set
    to -inf."""
    batch, kv_heads, groups, rows, dim = block.qg.shape
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        block.qg.reshape(batch, kv_heads * groups, rows, dim),
        block.k.to(block.qg.dtype),
        block.v.to(block.qg.dtype),
        0.0,
        False,
        attn_mask=additive_mask(block.allowed, block.qg.dtype),
        scale=block.scoring.scale,
    )
    lse = lse.reshape(batch, kv_heads, groups, rows).masked_fill(~block.allowed.any(-1).unsqueeze(2), NEG_INF)
    return out.reshape(block.qg.shape), lse


def _flash_grads(block: Block, merged: Merged):
    batch, kv_heads, groups, rows, dim = block.qg.shape
    ungrouped = (batch, kv_heads * groups, rows)
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        merged.grad_out.reshape(*ungrouped, dim),
        block.qg.reshape(*ungrouped, dim),
        block.k.to(block.qg.dtype),
        block.v.to(block.qg.dtype),
        merged.out.reshape(*ungrouped, dim),
        safe(merged.lse).reshape(ungrouped),
        0.0,
        False,
        attn_mask=additive_mask(block.allowed, block.qg.dtype),
        scale=block.scoring.scale,
    )
    return grad_q.reshape(block.qg.shape), grad_k, grad_v


def block_attention(block: Block):
    """One block: its output ``[B, Hkv, G, Sq, D]`` and log-sum-exp ``[B, Hkv, G, Sq]`` (fp32)."""
    if _fused(block):
        return _flash_attention(block)
    scores, _ = block_scores(block)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - safe(lse).unsqueeze(-1))
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, block.v.to(block.qg.dtype)), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial softmax results over disjoint keys as one; rows with no key stay 0, never NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = safe(lse)
    weight_a, weight_b = torch.exp(lse_a - base), torch.exp(lse_b - base)
    return out_a * weight_a.unsqueeze(-1) + out_b * weight_b.unsqueeze(-1), lse


def block_grads(block: Block, merged: Merged):
    """The block's share of dq, and its dk and dv, given the forward merged over its q rows."""
    if _fused(block):
        return _flash_grads(block, merged)
    scores, capped = block_scores(block)
    probs = torch.exp(scores - safe(merged.lse).unsqueeze(-1))
    grad_v = torch.einsum("bhgqk,bhgqd->bhkd", probs, merged.grad_out)
    v = block.v.to(block.qg.dtype)
    grad_scores = probs * (torch.einsum("bhgqd,bhkd->bhgqk", merged.grad_out, v) - merged.delta.unsqueeze(-1))
    if capped is not None:
        grad_scores = grad_scores * (1 - capped * capped)
    grad_q = torch.einsum("bhgqk,bhkd->bhgqd", grad_scores, block.k.to(block.qg.dtype)) * block.scoring.scale
    grad_k = torch.einsum("bhgqk,bhgqd->bhkd", grad_scores, block.qg) * block.scoring.scale
    return grad_q, grad_k, grad_v


def tiled_attention(out, lse, block: Block, tiles: list) -> None:
    """Merge one block into ``out`` and ``lse`` (in place), tile by tile (``tiles``: the block's needed
    ``(rows, cols)`` slices, :func:`cpshard.attention.blocks.tiles`)."""
    for rows, cols in tiles:
        part = block_attention(block.tile(rows, cols))
        out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *part)


def tiled_grads(grad_q, grad_kv, block: Block, merged: Merged, tiles: list) -> None:
    """Add one block's dq into ``grad_q`` and its dk, dv into ``grad_kv`` (in place), tile by tile."""
    for rows, cols in tiles:
        dq, dk, dv = block_grads(block.tile(rows, cols), merged.rows(rows))
        grad_q[..., rows, :] += dq
        grad_kv[0][:, :, cols] += dk
        grad_kv[1][:, :, cols] += dv


# ----------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Ring:
    """One ring attention call: the blocks of the running call (:func:`cpshard.attention.blocks`), how
    scores become weights, the process group of the ring and the name its sends are recorded under."""

    blocks: object
    scale: float
    softcap: float | None
    group: object
    name: str

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def block(self, qg, kv: torch.Tensor, source: int) -> Block:
        """This rank's q against the k/v block of rank ``source``."""
        scoring = Scoring(self.scale, self.softcap, self.blocks.uniform)
        return Block(qg, kv[0], kv[1], self.blocks.masks[source], scoring)


def hops(needed: list[list[bool]], source: int) -> int:
    """How far block ``source`` travels along the ring: up to the last rank after it that needs it."""
    size = len(needed)
    return max((step for step in range(1, size) if needed[(source + step) % size][source]), default=0)


def _exchange(ring: Ring, send: torch.Tensor | None, recv_like: torch.Tensor | None, phase: str):
    """Post a send to the next rank and/or a receive from the previous one; returns (requests, receive
    buffer)."""
    ops, buffer, group = [], None, ring.group
    if send is not None:
        record(active_recorder(), "send", ring.name, phase, send, ring.size)
        to = dist.get_global_rank(group, (ring.rank + 1) % ring.size)
        ops.append(dist.P2POp(dist.isend, send.contiguous(), to, group))
    if recv_like is not None:
        buffer = torch.empty_like(recv_like)
        source = dist.get_global_rank(group, (ring.rank - 1) % ring.size)
        ops.append(dist.P2POp(dist.irecv, buffer, source, group))
    return (dist.batch_isend_irecv(ops) if ops else []), buffer


def _wait(requests, ring) -> None:
    with arriving("send", ring.name, ring.group):
        for request in requests:
            request.wait()


def _ring_steps(needed, rank: int, size: int):
    """Per step: the block held (its source rank, or None), whether it goes on to the next rank,
    and whether a block arrives for the next step. Every rank derives the same schedule."""
    for step in range(size):
        source = (rank - step) % size
        held = step <= hops(needed, source)
        arriving = (source - 1) % size
        yield (
            source if held else None,
            held and step < hops(needed, source),
            step + 1 < size and step + 1 <= hops(needed, arriving),
        )


def accumulation(dtype: torch.dtype) -> torch.dtype:
    """The type the ring computes in: fp32, or its inputs' where wider (float64: the checks' second look)."""
    return torch.promote_types(dtype, torch.float32)


def ring_forward(q, k, v, ring: Ring):
    """This rank's q over every rank's k and v: ``(out, lse)``, grouped ``[B, Hkv, G, Sq, D]`` and
    ``[B, Hkv, G, Sq]``, in fp32 (or wider: :func:`accumulation`)."""
    needed, rank = ring.blocks.needed, ring.rank
    qg = grouped(q.to(accumulation(q.dtype)), k.shape[1])
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], NEG_INF, dtype=qg.dtype, device=q.device)
    kv = template = torch.stack([k, v])
    for source, send_on, expect in _ring_steps(needed, rank, ring.size):
        requests, incoming = _exchange(ring, kv if send_on else None, template if expect else None, "forward")
        if source is not None and needed[rank][source]:
            tiled_attention(out, lse, ring.block(qg, kv, source), ring.blocks.tiles[source])
        _wait(requests, ring)
        kv = incoming
    return out, lse


def ring_backward(q, k, v, out, lse, grad_output, ring: Ring):
    """``(dq, dk, dv)`` given :func:`ring_forward`'s ``out`` and ``lse``: dk and dv travel with k and v."""
    needed, rank = ring.blocks.needed, ring.rank
    qg = grouped(q.to(accumulation(q.dtype)), k.shape[1])
    grad_out = grouped(grad_output.to(qg.dtype), k.shape[1])
    merged = Merged(lse, out, grad_out, (grad_out * out).sum(-1))
    grad_q = torch.zeros_like(qg)
    kv = kv_template = torch.stack([k, v])
    grad_kv = grad_template = torch.zeros((2, *k.shape), dtype=qg.dtype, device=k.device)
    parked: dict[int, torch.Tensor] = {}  # dk, dv of blocks whose travel ends here, by source
    for source, send_on, expect in _ring_steps(needed, rank, ring.size):
        requests, incoming = _exchange(
            ring, kv if send_on else None, kv_template if expect else None, "backward"
        )
        if source is not None and needed[rank][source]:
            grad_kv = grad_kv.clone() if grad_kv is grad_template else grad_kv
            tiled_grads(grad_q, grad_kv, ring.block(qg, kv, source), merged, ring.blocks.tiles[source])
        _wait(requests, ring)
        requests, incoming_grad = _exchange(
            ring, grad_kv if send_on else None, grad_template if expect else None, "backward"
        )
        _wait(requests, ring)
        if source is not None and not send_on:
            parked[source] = grad_kv
        kv, grad_kv = incoming, incoming_grad
    grad_k, grad_v = _send_home(ring, parked, grad_template)
    return grad_q.reshape(q.shape).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Exact attention of this rank's q over every rank's k and v, by a ring over ``group``."""

    @staticmethod
    @own_precision
    def forward(ctx, q, k, v, ring: Ring):
        out, lse = ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    @once_differentiable
    @own_precision
    def backward(ctx, grad_output):
        q, k, v, out, lse = ctx.saved_tensors
        return *ring_backward(q, k, v, out, lse, grad_output, ctx.ring), None


def _send_home(ring: Ring, parked: dict, template):
    """Each block's dk, dv go from where its travel ended back to their owner, in one batch of P2P."""
    ops, received, group, rank = [], None, ring.group, ring.rank
    for source, grads in parked.items():
        if source != rank:
            record(active_recorder(), "send", ring.name, "backward", grads, ring.size)
            ops.append(dist.P2POp(dist.isend, grads.contiguous(), dist.get_global_rank(group, source), group))
    last = (rank + hops(ring.blocks.needed, rank)) % ring.size
    if last != rank:
        received = torch.empty_like(template)
        ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, last), group))
    _wait(dist.batch_isend_irecv(ops) if ops else [], ring)
    return received if received is not None else parked[rank]
