"""The halo of a short causal convolution under cp: the last positions of the rank before.

A convolution of width ``K`` at a slice's first position reads the ``K - 1`` positions before it, which
the previous rank holds. Each rank sends its last ``K - 1`` positions one step along the sequence (rank 0
receives zeros, the model's own left padding) and, in the backward, their gradient one step back. The
ranks of the cp group hold the sequence in contiguous order, rank r before rank r + 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from cpshard.comm.arrival import arriving
from cpshard.comm.record import active_recorder, expect, record


def _shift(x: torch.Tensor, group, step: int, recorder, name: str, phase: str) -> torch.Tensor:
    """Every rank's ``x`` moved ``step`` (+1 or -1) ranks along the group; zeros where none comes in."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ops, received = [], torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if 0 <= rank + step < size:
        record(recorder, "send", name, phase, x, size)
        ops.append(dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, rank + step), group))
    if 0 <= rank - step < size:
        ops.append(dist.P2POp(dist.irecv, received, dist.get_global_rank(group, rank - step), group))
    with arriving("send", name, group):
        for request in dist.batch_isend_irecv(ops) if ops else []:
            request.wait()
    return received


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tail, group, name):
        ctx.group, ctx.name, ctx.recorder = group, name, active_recorder()
        return _shift(tail, group, 1, ctx.recorder, name, "forward")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _shift(grad, ctx.group, -1, ctx.recorder, ctx.name, "backward"), None, None


def with_halo(x: torch.Tensor, width: int, group, name: str = "") -> torch.Tensor:
    """``x`` ``[..., T]`` (this rank's positions, last dim) with the previous rank's last ``width``
    positions in front: ``[..., width + T]``; differentiable (the halo's gradient goes back to its rank)."""
    if x.shape[-1] < width:
        raise ValueError(
            f"{name}: a cp rank holds {x.shape[-1]} positions, fewer than the {width} its convolution reads "
            f"before each one; use sequences of at least {width} tokens per cp rank"
        )
    return torch.cat([_Halo.apply(x[..., x.shape[-1] - width :], group, name), x], dim=-1)


def declare_halo(module: str, halo: torch.Tensor, group) -> None:
    """Declare the halo's analytic bytes for ``module`` (:func:`cpshard.debug.trace_comms`): ``halo``
    (``[..., kernel - 1]``) sent one rank on in the forward, its gradient one rank back in the backward."""
    nbytes, size, rank = halo.numel() * halo.element_size(), dist.get_world_size(group), dist.get_rank(group)
    for phase in ("forward",) * (rank < size - 1) + ("backward",) * (rank > 0):
        expect(module, "send", phase, 1, nbytes)
