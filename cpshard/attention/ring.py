"""Ring attention: q stays on its rank, k and v travel around the ring, results merge by log-sum-exp.

The math lives in small pure functions over one block (a q slice against one k/v slice), in
fp32: torch's fused CPU flash-attention kernel (it returns the log-sum-exp and takes fewer kv
heads) where it applies, explicit softmax math where it cannot (softcapping, rows that must
attend evenly); :class:`RingAttention` runs the schedule forward and backward (dk and dv travel with k
and v, as in the standard ring backward). Every rank knows the whole mask, so every rank
knows which blocks are needed at all: a hidden block is neither computed nor, where no later
rank on the ring needs it, sent.

Shapes: q ``[B, Hq, Sq, D]``, k and v ``[B, Hkv, Sk, D]`` (Hq a multiple of Hkv), block masks
``[B or 1, 1, Sq, Sk]`` booleans (True: may attend).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpshard.comm.record import active_recorder, record
from cpshard.spec.masks import additive_mask

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- block math


def grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[B, Hq, S, D]`` as ``[B, Hkv, G, S, D]``: the G q heads that share each kv head."""
    batch, heads, length, dim = q.shape
    return q.reshape(batch, kv_heads, heads // kv_heads, length, dim)


def block_scores(qg, k, allowed, scale: float, softcap: float | None, uniform=None):
    """Masked scores ``[B, Hkv, G, Sq, Sk]`` (-inf where hidden) and the softcap's tanh (or None).

    Rows marked ``uniform`` score 0 everywhere they may look: eager attention's value for a row
    whose every key is masked (its gradient still flows as eager's does)."""
    raw = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.float()) * scale
    capped = None
    if softcap:
        capped = torch.tanh(raw / softcap)
        raw = capped * softcap
    if uniform is not None:
        raw = raw.masked_fill(uniform[:, :, None, :, None], 0.0)
    return raw.masked_fill(~allowed.unsqueeze(2), NEG_INF), capped


def safe(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that sees no key) replaced by 0, so that exp(s - lse) is 0, not NaN."""
    return lse.masked_fill(torch.isinf(lse), 0.0)


def _fused(softcap, uniform, device) -> bool:
    """Whether torch's CPU flash kernel computes this block: plain scaled softmax, on the CPU."""
    return softcap is None and uniform is None and device.type == "cpu"


def _flash_attention(qg, k, v, allowed, scale: float):
    """The fused kernel on one block; its lse of a row that sees nothing (which it reports as 0) set
    to -inf."""
    batch, kv_heads, groups, rows, dim = qg.shape
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg.reshape(batch, kv_heads * groups, rows, dim),
        k.float(),
        v.float(),
        0.0,
        False,
        attn_mask=additive_mask(allowed, torch.float32),
        scale=scale,
    )
    lse = lse.reshape(batch, kv_heads, groups, rows).masked_fill(~allowed.any(-1).unsqueeze(2), NEG_INF)
    return out.reshape(qg.shape), lse


def _flash_grads(qg, k, v, allowed, lse, out, grad_out, scale: float):
    batch, kv_heads, groups, rows, dim = qg.shape
    ungrouped = (batch, kv_heads * groups, rows)
    grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.reshape(*ungrouped, dim),
        qg.reshape(*ungrouped, dim),
        k.float(),
        v.float(),
        out.reshape(*ungrouped, dim),
        safe(lse).reshape(ungrouped),
        0.0,
        False,
        attn_mask=additive_mask(allowed, torch.float32),
        scale=scale,
    )
    return grad_q.reshape(qg.shape), grad_k, grad_v


def block_attention(qg, k, v, allowed, scale: float, softcap: float | None, uniform=None):
    """One block: its output ``[B, Hkv, G, Sq, D]`` and log-sum-exp ``[B, Hkv, G, Sq]`` (fp32)."""
    if _fused(softcap, uniform, qg.device):
        return _flash_attention(qg, k, v, allowed, scale)
    scores, _ = block_scores(qg, k, allowed, scale, softcap, uniform)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - safe(lse).unsqueeze(-1))
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float()), lse


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial softmax results over disjoint keys as one; rows with no key stay 0, never NaN."""
    lse = torch.logaddexp(lse_a, lse_b)
    base = safe(lse)
    weight_a, weight_b = torch.exp(lse_a - base), torch.exp(lse_b - base)
    return out_a * weight_a.unsqueeze(-1) + out_b * weight_b.unsqueeze(-1), lse


def block_grads(
    qg, k, v, allowed, lse, out, grad_out, delta, scale: float, softcap: float | None, uniform=None
):
    """The block's share of dq, and its dk and dv, given the merged ``out`` and ``lse`` and
    ``delta = rowsum(dO * O)``."""
    if _fused(softcap, uniform, qg.device):
        return _flash_grads(qg, k, v, allowed, lse, out, grad_out, scale)
    scores, capped = block_scores(qg, k, allowed, scale, softcap, uniform)
    probs = torch.exp(scores - safe(lse).unsqueeze(-1))
    grad_v = torch.einsum("bhgqk,bhgqd->bhkd", probs, grad_out)
    grad_scores = probs * (torch.einsum("bhgqd,bhkd->bhgqk", grad_out, v.float()) - delta.unsqueeze(-1))
    if capped is not None:
        grad_scores = grad_scores * (1 - capped * capped)
    grad_q = torch.einsum("bhgqk,bhkd->bhgqd", grad_scores, k.float()) * scale
    grad_k = torch.einsum("bhgqk,bhgqd->bhkd", grad_scores, qg) * scale
    return grad_q, grad_k, grad_v


def _rows(uniform, rows: slice):
    return None if uniform is None else uniform[..., rows]


def tiled_attention(out, lse, qg, k, v, allowed, scale, softcap, uniform, tiles: list) -> None:
    """Merge one block into ``out`` and ``lse`` (in place), tile by tile (``tiles``: the block's needed
    ``(rows, cols)`` slices, :func:`cpshard.attention.blocks.tiles`)."""
    for rows, cols in tiles:
        part = block_attention(
            qg[..., rows, :],
            k[:, :, cols],
            v[:, :, cols],
            allowed[..., rows, cols],
            scale,
            softcap,
            _rows(uniform, rows),
        )
        out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], *part)


def tiled_grads(
    grad_q, grad_kv, qg, k, v, allowed, lse, out, grad_out, delta, scale, softcap, uniform, tiles: list
):
    """Add one block's dq into ``grad_q`` and its dk, dv into ``grad_kv`` (in place), tile by tile."""
    for rows, cols in tiles:
        dq, dk, dv = block_grads(
            qg[..., rows, :],
            k[:, :, cols],
            v[:, :, cols],
            allowed[..., rows, cols],
            lse[..., rows],
            out[..., rows, :],
            grad_out[..., rows, :],
            delta[..., rows],
            scale,
            softcap,
            _rows(uniform, rows),
        )
        grad_q[..., rows, :] += dq
        grad_kv[0][:, :, cols] += dk
        grad_kv[1][:, :, cols] += dv


# ----------------------------------------------------------------------------- schedule


def hops(needed: list[list[bool]], source: int) -> int:
    """How far block ``source`` travels along the ring: up to the last rank after it that needs it."""
    size = len(needed)
    return max((step for step in range(1, size) if needed[(source + step) % size][source]), default=0)


def _exchange(
    send: torch.Tensor | None, to: int, recv_like: torch.Tensor | None, source: int, group, name, phase
):
    """Post a send and/or a receive on the ring; returns (requests, receive buffer)."""
    ops, buffer = [], None
    if send is not None:
        record(active_recorder(), "send", name, phase, send, dist.get_world_size(group))
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, to), group))
    if recv_like is not None:
        buffer = torch.empty_like(recv_like)
        ops.append(dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, source), group))
    return (dist.batch_isend_irecv(ops) if ops else []), buffer


def _wait(requests) -> None:
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


def ring_forward(q, k, v, blocks, scale, softcap, group, name):
    """This rank's q over every rank's k and v: ``(out, lse)``, grouped ``[B, Hkv, G, Sq, D]`` and
    ``[B, Hkv, G, Sq]``, in fp32."""
    needed = blocks.needed
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ring = ((rank + 1) % size, (rank - 1) % size)
    qg = grouped(q.float(), k.shape[1])
    out = torch.zeros_like(qg)
    lse = torch.full(qg.shape[:-1], NEG_INF, dtype=torch.float32, device=q.device)
    kv = template = torch.stack([k, v])
    for source, send_on, expect in _ring_steps(needed, rank, size):
        requests, incoming = _exchange(
            kv if send_on else None,
            ring[0],
            template if expect else None,
            ring[1],
            group,
            name,
            "forward",
        )
        if source is not None and needed[rank][source]:
            tiled_attention(
                out,
                lse,
                qg,
                kv[0],
                kv[1],
                blocks.masks[source],
                scale,
                softcap,
                blocks.uniform,
                blocks.tiles[source],
            )
        _wait(requests)
        kv = incoming
    return out, lse


def ring_backward(q, k, v, out, lse, grad_output, blocks, scale, softcap, group, name):
    """``(dq, dk, dv)`` given :func:`ring_forward`'s ``out`` and ``lse``: dk and dv travel with k and v."""
    needed = blocks.needed
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ring = ((rank + 1) % size, (rank - 1) % size)
    qg = grouped(q.float(), k.shape[1])
    grad_out = grouped(grad_output.float(), k.shape[1])
    delta = (grad_out * out).sum(-1)
    grad_q = torch.zeros_like(qg)
    kv = kv_template = torch.stack([k, v])
    grad_kv = grad_template = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
    parked: dict[int, torch.Tensor] = {}  # dk, dv of blocks whose travel ends here, by source
    for source, send_on, expect in _ring_steps(needed, rank, size):
        requests, incoming = _exchange(
            kv if send_on else None,
            ring[0],
            kv_template if expect else None,
            ring[1],
            group,
            name,
            "backward",
        )
        if source is not None and needed[rank][source]:
            grad_kv = grad_kv.clone() if grad_kv is grad_template else grad_kv
            tiled_grads(
                grad_q,
                grad_kv,
                qg,
                kv[0],
                kv[1],
                blocks.masks[source],
                lse,
                out,
                grad_out,
                delta,
                scale,
                softcap,
                blocks.uniform,
                blocks.tiles[source],
            )
        _wait(requests)
        requests, incoming_grad = _exchange(
            grad_kv if send_on else None,
            ring[0],
            grad_template if expect else None,
            ring[1],
            group,
            name,
            "backward",
        )
        _wait(requests)
        if source is not None and not send_on:
            parked[source] = grad_kv
        kv, grad_kv = incoming, incoming_grad
    grad_k, grad_v = _send_home(parked, rank, size, needed, group, name, grad_template)
    return grad_q.reshape(q.shape).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Exact attention of this rank's q over every rank's k and v, by a ring over ``group``."""

    @staticmethod
    def forward(ctx, q, k, v, blocks, scale, softcap, group, name):
        out, lse = ring_forward(q, k, v, blocks, scale, softcap, group, name)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = (blocks, scale, softcap, group, name)
        return out.reshape(q.shape).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        q, k, v, out, lse = ctx.saved_tensors
        return *ring_backward(q, k, v, out, lse, grad_output, *ctx.config), *([None] * 5)


def _send_home(parked: dict, rank: int, size: int, needed, group, name, template):
    """Each block's dk, dv go from where its travel ended back to their owner, in one batch of P2P."""
    ops, received = [], None
    for source, grads in parked.items():
        if source != rank:
            record(active_recorder(), "send", name, "backward", grads, size)
            ops.append(dist.P2POp(dist.isend, grads.contiguous(), dist.get_global_rank(group, source), group))
    last = (rank + hops(needed, rank)) % size
    if last != rank:
        received = torch.empty_like(template)
        ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, last), group))
    _wait(dist.batch_isend_irecv(ops) if ops else [])
    return received if received is not None else parked[rank]
