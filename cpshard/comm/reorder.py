"""Moving tokens between sequence orders: one all-to-all with uneven splits, differentiable.

Used to undo the head-tail order before the LM head, so that logits come out as contiguous
chunks (what DTensor's ``Shard(1)`` means) at the cost of moving hidden states, not logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd.function import once_differentiable

from cpshard.comm.record import active_recorder, record
from cpshard.spec.sequence import chunk_positions, exchange_plan, positions


def _move(x, dim, send, receive, out_len: int, group, recorder, name, phase):
    """Send ``x``'s entries ``send[p]`` (along ``dim``) to peer p; place what p sends at ``receive[p]``
    of an ``out_len`` result (entries nobody sends stay 0: padding has no gradient)."""
    send, receive = [idx.to(x.device) for idx in send], [idx.to(x.device) for idx in receive]
    outgoing = torch.cat([x.index_select(dim, idx) for idx in send], dim=dim).movedim(dim, 0).contiguous()
    record(recorder, "all_to_all", name, phase, outgoing, dist.get_world_size(group))
    incoming = funcol.wait_tensor(
        funcol.all_to_all_single(outgoing, [len(i) for i in receive], [len(i) for i in send], group)
    )
    moved = x.movedim(dim, 0)
    out = moved.new_zeros((out_len, *moved.shape[1:]))
    out.index_copy_(0, torch.cat(receive), incoming)
    return out.movedim(0, dim)


class _Reorder(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, send, receive, group, name):
        ctx.config, ctx.recorder, ctx.src_len = (
            (dim, send, receive, group, name),
            active_recorder(),
            x.shape[dim],
        )
        out_len = sum(len(indices) for indices in receive)
        return _move(x, dim, send, receive, out_len, group, ctx.recorder, name, "forward")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        dim, send, receive, group, name = ctx.config
        return _move(grad, dim, receive, send, ctx.src_len, group, ctx.recorder, name, "backward"), *(
            [None] * 5
        )


def reorder(x: torch.Tensor, dim: int, src: list, dst: list, group, name: str = "") -> torch.Tensor:
    """This rank's entries along ``dim``, held at positions ``src[rank]``, as those of ``dst[rank]`` (every
    position of ``dst`` is in some ``src``): one all-to-all with uneven splits."""
    send, receive = exchange_plan(src, dst, dist.get_rank(group))
    return _Reorder.apply(x, dim, send, receive, group, name)


def to_chunks(x: torch.Tensor, dim: int, order: str, padded_length: int, length: int, group, name: str = ""):
    """This rank's tokens, held in ``order`` over a padded sequence, as DTensor chunks of the real
    ``length`` tokens (see :func:`cpshard.spec.sequence.chunk_positions`); padding is dropped."""
    size = dist.get_world_size(group)
    src = [positions(order, padded_length, size, r) for r in range(size)]
    dst = [chunk_positions(length, size, r) for r in range(size)]
    return reorder(x, dim, src, dst, group, name)
