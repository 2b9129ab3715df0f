"""Differentiable all-to-alls over one process group, each reported to :mod:`cpshard.comm.record`: the
even one that moves a tensor from one split dimension to another (Ulysses' exchanges, the recurrent layers'
head splits), eager or compiled, and the uneven one of rows (expert dispatch). Each one's backward is the
same exchange reversed.

These call torch's collectives directly: DTensor's ``redistribute`` falls back to an all-gather of the
whole tensor on CPU process groups, which the hot path cannot afford.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.autograd.function import once_differentiable

from cpshard.comm.arrival import arriving
from cpshard.comm.channel import Channel, TracedGroup
from cpshard.comm.record import active_recorder, record


def _all_to_all_single(send: torch.Tensor, group, name: str = "") -> torch.Tensor:
    """What arrives for ``send``, whose equal chunks of dim 0 go to the ranks in turn: torch's c10d
    collective when eager (the functional one costs a custom operator's dispatch and a wrapper tensor,
    ~0.5 ms a call on CPU, 16 calls a step for 2 layers), the functional one under torch.compile,
    which traces it."""
    if torch.compiler.is_compiling():
        return funcol.wait_tensor(funcol.all_to_all_single(send, None, None, group))
    received = torch.empty_like(send)
    with arriving("all_to_all", name, group):
        dist.all_to_all_single(received, send, group=group)
    return received


def _exchange(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    group,
    recorder,
    name: str,
    phase: str,
    donate: bool = False,
) -> torch.Tensor:
    """Send chunk ``i`` of ``scatter_dim`` to rank ``i``; concatenate what arrives along ``gather_dim``.
    ``donate``: nothing reads ``x`` afterwards, so what arrives is put in place in ``x``'s storage (sent by
    then), not in a third buffer beside ``x`` and what arrived (see :func:`_into_donated`)."""
    size, scatter_dim, gather_dim = dist.get_world_size(group), scatter_dim % x.dim(), gather_dim % x.dim()
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()  # a view when x allows
    record(recorder, "all_to_all", name, phase, send, size)
    received = _all_to_all_single(send, group, name)
    arrived = received.movedim(0, gather_dim)
    if donate and x.is_contiguous() and not arrived.is_contiguous():
        return _into_donated(x, arrived, arrived.shape[:gather_dim] + (-1,) + arrived.shape[gather_dim + 2 :])
    return arrived.flatten(gather_dim, gather_dim + 1)  # copies only where it must


def _into_donated(x: torch.Tensor, arrived: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``arrived`` copied into the storage of ``x`` (as many elements, contiguous) and seen as ``shape``:
    a tensor of its own, not a view (the caller may modify it in place). The copy goes through ``x``,
    whose version it bumps: were ``x`` saved for a backward after all, that backward raises, never reads
    the values overwritten."""
    x.detach().view(arrived.shape).copy_(arrived)
    return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), x.view(shape).shape)


class _Exchange(torch.autograd.Function):
    """An exchange whose backward is the same exchange reversed: what went to rank i comes back from it
    (``donate``, which the forward passes on, never: a gradient may be another node's too)."""

    @staticmethod
    def forward(ctx, x, exchange, there: tuple, back: tuple, group, name, donate: bool = False):
        ctx.exchange, ctx.back, ctx.group, ctx.name, ctx.recorder = (
            exchange,
            back,
            group,
            name,
            active_recorder(),
        )
        donated = {"donate": True} if donate else {}  # _exchange_rows takes no donate
        return exchange(x, *there, group, ctx.recorder, name, "forward", **donated)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        return (
            ctx.exchange(grad, *ctx.back, ctx.group, ctx.recorder, ctx.name, "backward"),
            *[None] * 6,
        )


@torch.library.custom_op("cpshard::exchange", mutates_args=())
def _channel_exchange(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    ranks: int,
    channel: Channel,
    axis: str,
    name: str,
    phase: str,
) -> torch.Tensor:
    """:func:`_exchange` as compiled code calls it: opaque to torch.compile, run on the channel's group,
    recorded under the channel's module path when it runs."""
    group, path = channel.groups[axis], channel.path
    return _exchange(x, scatter_dim, gather_dim, group, channel.recorder, f"{path}{name}", phase).contiguous()


@_channel_exchange.register_fake
def _(x, scatter_dim, gather_dim, ranks, channel, axis, name, phase):
    shape = list(x.shape)
    shape[scatter_dim % x.dim()] //= ranks
    shape[gather_dim % x.dim()] *= ranks
    return x.new_empty(shape)


def _save_exchange(ctx, inputs, output):
    ctx.args = inputs[1:]


def _exchange_back(ctx, grad):
    scatter_dim, gather_dim, ranks, channel, axis, name, _ = ctx.args
    back = _channel_exchange(grad, gather_dim, scatter_dim, ranks, channel, axis, name, "backward")
    return back, *([None] * len(ctx.args))


_channel_exchange.register_autograd(_exchange_back, setup_context=_save_exchange)


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group, name: str = "", donate: bool = False
) -> torch.Tensor:
    """Split ``scatter_dim`` over the group and gather ``gather_dim`` from it: one all-to-all each way.
    ``group`` is a process group, or a :class:`TracedGroup` inside a compiled layer. ``donate``: the caller
    reads ``x`` no more, and the result may take its storage (eager only; the backward never donates)."""
    if x.shape[scatter_dim] % group.size():
        raise ValueError(
            f"{name or 'all_to_all'}: dimension {scatter_dim} of shape {tuple(x.shape)} does not divide "
            f"over {group.size()} ranks"
        )
    if isinstance(group, TracedGroup):
        return _channel_exchange(
            x, scatter_dim, gather_dim, group.size(), group.channel, group.axis, name, "forward"
        )
    there, back = (scatter_dim, gather_dim), (gather_dim, scatter_dim)
    return _Exchange.apply(x, _exchange, there, back, group, name, donate)


def _exchange_rows(
    x: torch.Tensor, send: list[int], receive: list[int], group, recorder, name: str, phase: str
) -> torch.Tensor:
    """Rows ``[sum(send[:i]), sum(send[:i+1]))`` of ``x`` go to rank ``i``; what arrives is stacked
    in rank order."""
    x = x.contiguous()
    record(recorder, "all_to_all", name, phase, x, dist.get_world_size(group))
    return funcol.wait_tensor(funcol.all_to_all_single(x, receive, send, group))


def all_to_all_rows(
    x: torch.Tensor, send: list[int], receive: list[int], group, name: str = ""
) -> torch.Tensor:
    """Uneven all-to-all of dim-0 rows: ``send[i]`` rows to rank ``i``, ``receive[i]`` rows from it
    (both sides must agree: exchange the counts first). The backward sends the gradients back the same
    way reversed."""
    size = dist.get_world_size(group)
    if len(send) != size or len(receive) != size or sum(send) != x.shape[0]:
        raise ValueError(
            f"{name or 'all_to_all_rows'}: {x.shape[0]} rows split as send={send}, receive={receive} "
            f"over {size} ranks; each needs one count per rank and send must add up to the rows"
        )
    send, receive = list(send), list(receive)
    return _Exchange.apply(x, _exchange_rows, (send, receive), (receive, send), group, name)
