"""Differentiable sums, gathers and shares of rows over one process group, each reported to
:mod:`cpshard.comm.record` (the all-to-alls: :mod:`cpshard.comm.exchange`).

These call torch's collectives directly: DTensor's ``redistribute`` falls back to an all-gather of the
whole tensor on CPU process groups, which the hot path cannot afford.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from cpshard.comm.arrival import arriving
from cpshard.comm.carrier import carried
from cpshard.comm.record import active_recorder, expect, record


def _summed(x: torch.Tensor, group, recorder, name: str, phase: str) -> torch.Tensor:
    out = carried(x.detach(), group).clone().contiguous()
    record(recorder, "all_reduce", name, phase, out, dist.get_world_size(group))
    with arriving("all_reduce", name, group):
        dist.all_reduce(out, group=group)
    return out.to(x.device)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the identity: each rank's share of a replicated result."""

    @staticmethod
    def forward(ctx, x, group, name):
        return _summed(x, group, active_recorder(), name, "forward")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return grad, None, None


def sum_over_group(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """The sum of ``x`` over the group on every rank; the gradient flows to each rank's own term."""
    return _SumOverGroup.apply(x, group, name)


class _SumGradsOverGroup(torch.autograd.Function):
    """The identity whose backward all-reduces (sums): a replicated input that each rank uses in part."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.group, ctx.name, ctx.recorder = group, name, active_recorder()
        return x.view_as(x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _summed(grad, ctx.group, ctx.recorder, ctx.name, "backward"), None, None


def sum_grads_over_group(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """``x`` as it is; its gradient summed over the group (each rank's part of the computation adds
    its term)."""
    return _SumGradsOverGroup.apply(x, group, name)


def _all_reduce_buckets(tensors: list[torch.Tensor], group, recorder, name: str) -> list[torch.Tensor]:
    """Sum many tensors over the group in one collective per dtype (a bucket, not one per tensor)."""
    size = dist.get_world_size(group)
    result: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(index)
    for indices in by_dtype.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        record(recorder, "all_reduce", name, "backward", flat, size)
        with arriving("all_reduce", name, group):
            dist.all_reduce(flat, group=group)
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            result[i] = piece.view_as(tensors[i])
    return result


class _SumManyGradsOverGroup(torch.autograd.Function):
    """The identity on many tensors; the backward sums their gradients over the group, a bucket per dtype
    (with ``reached``, none to a tensor that no rank's backward reached: :func:`_reached_sums`)."""

    @staticmethod
    def forward(ctx, group, name, reached, *xs):
        ctx.set_materialize_grads(False)  # a gradient that did not come is None, not zeros
        ctx.group, ctx.name, ctx.recorder, ctx.reached = group, name, active_recorder(), reached
        ctx.like = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        given, like = [grads[i] for i in wanted], [ctx.like[i] for i in wanted]
        if ctx.reached:
            summed = _reached_sums(given, like, ctx.group, ctx.recorder, ctx.name)
        else:
            summed = _all_reduce_buckets(_filled(given, like), ctx.group, ctx.recorder, ctx.name)
        by_index = dict(zip(wanted, summed))
        return (None, None, None, *(by_index.get(i) for i in range(len(grads))))


def _filled(grads: list, like: list[tuple]) -> list[torch.Tensor]:
    """``grads`` with zeros of their ``like`` (a shape, dtype and device) where a gradient did not come."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
        for grad, (shape, dtype, device) in zip(grads, like)
    ]


def _reached_flags(grads: list, like: torch.Tensor) -> torch.Tensor:
    """1 where this rank's backward reached a tensor (its gradient came), else 0, in ``like``'s dtype and
    device: summed over the ranks beside the gradients, the count of ranks that reached each one."""
    return torch.tensor([grad is not None for grad in grads], dtype=like.dtype, device=like.device)


def _kept_where_reached(summed: list[torch.Tensor], counts: torch.Tensor) -> list:
    """``summed`` with None where the count of ranks that reached a tensor is 0 (read on the host: a
    gradient or None is decided per tensor, so a GPU backward waits for the count once)."""
    return [total if anywhere else None for total, anywhere in zip(summed, (counts != 0).tolist())]


def _reached_sums(grads: list, like: list[tuple], group, recorder, name: str) -> list:
    """``grads`` summed over the group (None where this rank's backward did not reach a tensor: zeros of its
    ``like``, a shape, dtype and device, in the sum), and None where no rank's reached it: one process's
    autograd leaves such a parameter's ``.grad`` None (DeepSeek-V3.2's indexer, reached by no loss), and an
    optimizer skips it, where a zero gradient would be decayed (AdamW) or move its momentum. Whether each
    rank reached each tensor rides in the first gradient's bucket, one element each: no collective more."""
    if not grads:
        return []
    filled = _filled(grads, like)
    *summed, counts = _all_reduce_buckets([*filled, _reached_flags(grads, filled[0])], group, recorder, name)
    return _kept_where_reached(summed, counts)


def sum_many_grads_over_group(
    xs: list[torch.Tensor], group, name: str = "", reached: bool = False
) -> list[torch.Tensor]:
    """``xs`` as they are; their gradients summed over the group in one all-reduce per dtype, once every
    gradient is in (the backward of :func:`sum_grads_over_group` for many tensors at once). ``reached``
    (parameters): none to a tensor that no rank's backward reached (:func:`_reached_sums`), else zeros."""
    return list(_SumManyGradsOverGroup.apply(group, name, reached, *xs))


def sum_now_over_group(tensors: list[torch.Tensor], group, name: str = "") -> list[torch.Tensor]:
    """``tensors`` summed over the group now (not differentiable), one all-reduce per dtype: gradients
    reduced after the backward, as a data-parallel step reduces them."""
    return _all_reduce_buckets(tensors, group, active_recorder(), name)


def all_gather_rows(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """Every rank's ``x`` stacked along a new dim 0, on ``x``'s device (not differentiable; for checks: a
    CPU row crosses an NCCL-only group on the accelerator, :mod:`cpshard.comm.carrier`)."""
    size = dist.get_world_size(group)
    every = _all_gathered(carried(x, group), group, active_recorder(), name, "forward")
    return every.view(size, *x.shape).to(x.device)


def _all_gathered(x: torch.Tensor, group, recorder, name: str, phase: str) -> torch.Tensor:
    """Every rank's ``x``, flat and in rank order (``[size * x.numel()]``): one all-gather, recorded."""
    size = dist.get_world_size(group)
    record(recorder, "all_gather", name, phase, x, size)
    out = torch.empty(size * x.numel(), dtype=x.dtype, device=x.device)
    with arriving("all_gather", name, group):
        dist.all_gather_single(out, x.contiguous().reshape(-1), group=group)
    return out


def _reduce_scattered(x: torch.Tensor, group, recorder, name: str, phase: str) -> torch.Tensor:
    """This rank's block (the ``rank``-th of ``size`` equal ones, flat) of ``x`` summed over the group: one
    reduce-scatter, recorded."""
    size = dist.get_world_size(group)
    record(recorder, "reduce_scatter", name, phase, x, size)
    out = torch.empty(x.numel() // size, dtype=x.dtype, device=x.device)
    with arriving("reduce_scatter", name, group):
        dist.reduce_scatter_single(out, x.contiguous().reshape(-1), group=group)
    return out


def _rows_of(rank: int, rows: int, chunk: int) -> int:
    """How many of ``rows`` rank ``rank`` holds when they are cut in chunks of ``chunk`` (as
    ``torch.chunk`` cuts)."""
    return min(chunk, max(0, rows - rank * chunk))


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` as a ``[rows, everything else]`` matrix, zero rows appended."""
    width = math.prod(x.shape[1:])
    return F.pad(x.reshape(x.shape[0], width), (0, 0, 0, rows - x.shape[0]))


class _GatherShards(torch.autograd.Function):
    """All-gather of dim-0 shards into whole tensors; backward: the reduce-scatter of their gradients (with
    ``reached``, none to a tensor that no rank's backward reached, as :func:`_reached_sums` decides it). A
    shard that takes no gradient (a frozen weight: LoRA's base model) gives a whole tensor that takes none
    either, so the backward neither computes its gradient nor reduce-scatters it."""

    @staticmethod
    def forward(ctx, group, name, reached, rows, *shards):
        ctx.set_materialize_grads(False)  # a gradient that did not come is None, not zeros
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        chunks = [-(-n // size) for n in rows]
        for shard, n, chunk in zip(shards, rows, chunks):
            if shard.shape[0] != _rows_of(rank, n, chunk):
                raise ValueError(
                    f"{name}: rank {rank} of {size} holds {shard.shape[0]} of {n} rows; a dim-0 shard cut as "
                    f"torch.chunk cuts holds {_rows_of(rank, n, chunk)}"
                )
        ctx.group, ctx.name, ctx.recorder, ctx.chunks = group, name, active_recorder(), chunks
        ctx.local_rows, ctx.reached = [shard.shape[0] for shard in shards], reached
        ctx.like = [((n, *s.shape[1:]), s.dtype, s.device) for s, n in zip(shards, rows)]
        ctx.trained = ctx.needs_input_grad[4:]
        flat = torch.cat([_padded(shard, chunk).reshape(-1) for shard, chunk in zip(shards, chunks)])
        out = _all_gathered(flat, group, ctx.recorder, name, "forward")
        pieces = out.view(size, -1).split([c * math.prod(s.shape[1:]) for c, s in zip(chunks, shards)], dim=1)
        whole = tuple(
            torch.cat([piece[r].view(c, *s.shape[1:])[: _rows_of(r, n, c)] for r in range(size)])
            for piece, s, n, c in zip(pieces, shards, rows, chunks)
        )
        ctx.mark_non_differentiable(*(w for w, trained in zip(whole, ctx.trained) if not trained))
        return whole

    @staticmethod
    @once_differentiable
    def backward(ctx, *given):
        trained = [i for i, need in enumerate(ctx.trained) if need]  # the others' gradients are None
        given, like = [given[i] for i in trained], [ctx.like[i] for i in trained]
        chunks, local_rows = [ctx.chunks[i] for i in trained], [ctx.local_rows[i] for i in trained]
        size, grads = dist.get_world_size(ctx.group), _filled(given, like)
        blocks = [_padded(g, size * c).view(size, -1) for g, c in zip(grads, chunks)]
        widths = [c * math.prod(g.shape[1:]) for c, g in zip(chunks, grads)]
        if ctx.reached:  # whether this rank reached each tensor, in every rank's block: the sum says how many
            blocks.append(_reached_flags(given, grads[0]).expand(size, -1))
            widths.append(len(grads))
        out = _reduce_scattered(torch.cat(blocks, dim=1), ctx.group, ctx.recorder, ctx.name, "backward")
        pieces = out.split(widths)
        local = [p.view(c, *g.shape[1:])[:n] for p, g, c, n in zip(pieces, grads, chunks, local_rows)]
        summed = iter(_kept_where_reached(local, pieces[-1]) if ctx.reached else local)
        every = (next(summed) if need else None for need in ctx.trained)
        return (None, None, None, None, *every)


def all_gather_shards(
    shards: list[torch.Tensor], rows: list[int], group, name: str = "", reached: bool = False
) -> list[torch.Tensor]:
    """Whole tensors from each rank's dim-0 shard (``rows``: their whole dim-0 sizes), in one all-gather;
    the gradients come back reduce-scattered, each rank's rows summed over the group. One dtype only.
    ``reached`` (parameters): none to a tensor that no rank's backward reached, as :func:`_reached_sums`
    decides it (one element per tensor in each rank's block), else zeros."""
    if len({s.dtype for s in shards}) > 1:
        raise ValueError(
            f"{name or 'all_gather_shards'}: one dtype per call, got {sorted({str(s.dtype) for s in shards})}"
        )
    return list(_GatherShards.apply(group, name, reached, tuple(rows), *shards))


def gathered(
    parts: list[torch.Tensor], dim: int, group, path: str, name: str, gradient: bool = True
) -> list[torch.Tensor]:
    """Every rank's ``parts`` (each the same shape on every rank) concatenated along ``dim`` in rank order,
    in one all-gather (:func:`all_gather_shards`, named ``name``); the bytes declared for the module ``path``
    (:func:`cpshard.debug.trace_comms`), with ``gradient`` the reduce-scatter of their gradients too."""
    size = dist.get_world_size(group)
    # parts of mixed types (under autocast: keys in fp32 after their rotary embedding, values in bf16) travel
    # in the widest, a lossless cast, and each comes back in its own
    wide = functools.reduce(torch.promote_types, [part.dtype for part in parts])
    rows = [part.movedim(dim, 0).to(wide).contiguous() for part in parts]
    nbytes = sum(row.numel() * row.element_size() for row in rows)
    expect(path, "all_gather", "forward", 1, nbytes)
    if gradient:
        expect(path, "reduce_scatter", "backward", 1, nbytes * size)
    whole = all_gather_shards(rows, [row.shape[0] * size for row in rows], group, name)
    return [x.movedim(0, dim).to(part.dtype) for x, part in zip(whole, parts)]


class _ScatterSums(torch.autograd.Function):
    """This rank's dim-0 block of the sum over the group of every rank's whole tensor (reduce-scatter);
    backward: the blocks' gradients all-gathered whole (each rank's tensor reached every block)."""

    @staticmethod
    def forward(ctx, x, group, name):
        size = dist.get_world_size(group)
        if x.shape[0] % size:
            raise ValueError(f"{name}: {x.shape[0]} rows do not split into {size} equal blocks")
        ctx.group, ctx.name, ctx.recorder = group, name, active_recorder()
        out = _reduce_scattered(x, group, ctx.recorder, name, "forward")
        return out.view(x.shape[0] // size, *x.shape[1:])

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        out = _all_gathered(grad, ctx.group, ctx.recorder, ctx.name, "backward")
        return out.view(size * grad.shape[0], *grad.shape[1:]), None, None


def scatter_sums(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """This rank's block of dim 0 (``torch.chunk``'s, equal blocks) of the sum of ``x`` over the group, in
    one reduce-scatter: partial sums made whole and cut at once (the row-wise layer of Megatron's sequence
    parallelism); the gradient comes back all-gathered. The inverse of :func:`all_gather_shards`."""
    return _ScatterSums.apply(x, group, name)


def share_bounds(rows: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)``: rank ``rank``'s share of ``rows`` rows cut in ``size`` shares as ``torch.chunk``
    cuts (the last shares may be short or empty)."""
    chunk = -(-rows // size)
    start = min(rows, rank * chunk)
    return start, start + _rows_of(rank, rows, chunk)


def _gather_shares(x: torch.Tensor, rows: int, group, recorder, name: str, phase: str) -> torch.Tensor:
    """Every rank's share (:func:`share_bounds`) of ``rows`` rows, back in rank order: one all-gather of
    the shares padded to the largest."""
    size, chunk = dist.get_world_size(group), -(-rows // dist.get_world_size(group))
    out = _all_gathered(_padded(x, chunk), group, recorder, name, phase)
    pieces = out.view(size, chunk, -1)
    return torch.cat([pieces[r, : _rows_of(r, rows, chunk)] for r in range(size)]).view(rows, *x.shape[1:])


class _ShareRows(torch.autograd.Function):
    """This rank's share of a replicated tensor's rows; backward: every rank's share of the gradient
    gathered (each rank's share alone reached the loss through this rank)."""

    @staticmethod
    def forward(ctx, x, group, name):
        ctx.rows, ctx.group, ctx.name, ctx.recorder = x.shape[0], group, name, active_recorder()
        start, stop = share_bounds(x.shape[0], dist.get_world_size(group), dist.get_rank(group))
        return x[start:stop].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return _gather_shares(grad, ctx.rows, ctx.group, ctx.recorder, ctx.name, "backward"), None, None


class _GatherShares(torch.autograd.Function):
    """Every rank's share of the rows, whole on every rank; backward: this rank's share of the (replicated)
    gradient."""

    @staticmethod
    def forward(ctx, x, rows, group, name):
        ctx.bounds = share_bounds(rows, dist.get_world_size(group), dist.get_rank(group))
        return _gather_shares(x, rows, group, active_recorder(), name, "forward")

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        start, stop = ctx.bounds
        return grad[start:stop], None, None, None


def share_rows(x: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """This rank's share (:func:`share_bounds`) of the rows of ``x``, which every rank of ``group`` holds
    alike; the gradient of the whole comes back gathered from every rank's share."""
    return _ShareRows.apply(x, group, name)


def gather_shares(x: torch.Tensor, rows: int, group, name: str = "") -> torch.Tensor:
    """The ``rows`` rows whose shares (:func:`share_bounds`) the ranks of ``group`` hold, on every rank;
    the inverse of :func:`share_rows` (its gradient must be the same on every rank: each keeps its
    share)."""
    return _GatherShares.apply(x, rows, group, name)
