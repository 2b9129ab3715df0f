"""Differentiable collectives over one process group, each reported to :mod:`cpshard.comms`.

These call torch's functional collectives directly: DTensor's ``redistribute`` falls back to
an all-gather of the whole tensor on CPU process groups, which the hot path cannot afford.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cpshard.comms import active_log, record


def _exchange(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, log, name: str, phase: str) -> torch.Tensor:
    """Send chunk ``i`` of ``scatter_dim`` to rank ``i``; concatenate what arrives along ``gather_dim``."""
    size = dist.get_world_size(group)
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()
    record(log, "all_to_all", name, phase, send, size)
    received = funcol.wait_tensor(funcol.all_to_all_single(send, None, None, group))
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group, name):
        ctx.dims, ctx.group, ctx.name, ctx.log = (scatter_dim, gather_dim), group, name, active_log()
        return _exchange(x, scatter_dim, gather_dim, group, ctx.log, name, "forward")

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, scatter_dim, ctx.group, ctx.log, ctx.name, "backward"), None, None, None, None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, group, name: str = "") -> torch.Tensor:
    """Split ``scatter_dim`` over the group and gather ``gather_dim`` from it: one all-to-all each way."""
    if x.shape[scatter_dim] % dist.get_world_size(group):
        raise ValueError(
            f"{name or 'all_to_all'}: dimension {scatter_dim} of shape {tuple(x.shape)} does not divide "
            f"over {dist.get_world_size(group)} ranks"
        )
    return _AllToAll.apply(x, scatter_dim, gather_dim, group, name)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: each rank's share of a replicated result."""

    @staticmethod
    def forward(ctx, x, group, name):
        out = x.detach().clone().contiguous()
        record(active_log(), "all_reduce", name, "forward", out, dist.get_world_size(group))
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def sum_over_group(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """The sum of ``x`` over the group on every rank; the gradient flows to each rank's own term."""
    return _SumOverGroup.apply(x, group, name)


def all_reduce_flat(tensors: list[torch.Tensor], group, name: str = "") -> list[torch.Tensor]:
    """Sum many tensors over the group in one collective per dtype (a bucket, not one per tensor)."""
    size = dist.get_world_size(group)
    result: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        record(active_log(), "all_reduce", name, "backward", flat, size)
        dist.all_reduce(flat, group=group)
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            result[i] = piece.view_as(tensors[i])
    return result


def all_gather_rows(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """Every rank's ``x`` stacked along a new dim 0 (not differentiable; for checks)."""
    size = dist.get_world_size(group)
    out = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    record(active_log(), "all_gather", name, "forward", x, size)
    dist.all_gather_single(out, x.contiguous().reshape(-1), group=group)
    return out.view(size, *x.shape)
