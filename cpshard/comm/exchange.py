"""Differentiable all-to-alls over one process group, each reported to :mod:`cpshard.comm.record`: the
even one that moves a tensor from one split dimension to another (Ulysses' exchanges, the recurrent layers'
head splits), eager or compiled, also several tensors in one collective (q, k and v; a kernel's inputs), and
the uneven one of rows (expert dispatch). Each one's backward is the same exchange reversed.

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
    ~0.5 ms a call on CPU, 8 calls a step for 2 layers), the functional one under torch.compile,
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


def _exchange_together(
    xs: list[torch.Tensor], scatter_dim: int, gather_dim: int, group, recorder, name: str, phase: str
) -> list[torch.Tensor]:
    """:func:`_exchange` of several tensors of one dtype that move alike, in one all-to-all: what goes to
    rank ``i`` of each tensor travels in one message (one collective's latency, not one a tensor; the
    same bytes). Each tensor is copied once, into its place in the one buffer sent, as :func:`_exchange`
    copies it into the order it sends; what arrives is seen per tensor as :func:`_exchange` sees it."""
    if len(xs) == 1:
        return [_exchange(xs[0], scatter_dim, gather_dim, group, recorder, name, phase)]
    size = dist.get_world_size(group)
    dims = [(scatter_dim % x.dim(), gather_dim % x.dim()) for x in xs]
    chunked = [x.unflatten(scatter, (size, -1)).movedim(scatter, 0) for x, (scatter, _) in zip(xs, dims)]
    counts = [part[0].numel() for part in chunked]
    send = xs[0].new_empty(size, sum(counts))
    for part, place in zip(chunked, send.split(counts, dim=1)):
        place.view(part.shape).copy_(part)
    record(recorder, "all_to_all", name, phase, send, size)
    received = _all_to_all_single(send, group, name)
    del send  # sent: not held beside what arrived and its copies
    return [
        place.view(part.shape).movedim(0, gather).flatten(gather, gather + 1)
        for part, place, (_, gather) in zip(chunked, received.split(counts, dim=1), dims)
    ]


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


class _ExchangeTogether(torch.autograd.Function):
    """:func:`_exchange_together`, whose backward is the same exchange reversed, of the gradients of the
    inputs that need one (in one all-to-all again)."""

    @staticmethod
    def forward(ctx, there: tuple, group, name, *xs):
        ctx.back, ctx.group, ctx.name, ctx.recorder = there[::-1], group, name, active_recorder()
        return tuple(_exchange_together(list(xs), *there, group, ctx.recorder, name, "forward"))

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        needed = ctx.needs_input_grad[3:]
        wanted = [grad for grad, need in zip(grads, needed) if need]
        moved = iter(_exchange_together(wanted, *ctx.back, ctx.group, ctx.recorder, ctx.name, "backward"))
        return None, None, None, *(next(moved) if need else None for need in needed)


@torch.library.custom_op("cpshard::exchange", mutates_args=())
def _channel_exchange(
    xs: list[torch.Tensor],
    scatter_dim: int,
    gather_dim: int,
    ranks: int,
    channel: Channel,
    axis: str,
    name: str,
    phase: str,
) -> list[torch.Tensor]:
    """:func:`_exchange_together` as compiled code calls it: opaque to torch.compile, run on the channel's
    group, recorded under the channel's module path when it runs. Its results are contiguous, as its fake
    says, and several do not share the buffer they arrived in (an op's outputs may not share storage)."""
    group, path = channel.groups[axis], channel.path
    moved = _exchange_together(xs, scatter_dim, gather_dim, group, channel.recorder, f"{path}{name}", phase)
    alone = len(moved) == 1
    return [
        x.contiguous() if alone or x._base is None else x.clone(memory_format=torch.contiguous_format)
        for x in moved
    ]


@_channel_exchange.register_fake
def _(xs, scatter_dim, gather_dim, ranks, channel, axis, name, phase):
    return [x.new_empty(_moved_shape(x.shape, scatter_dim, gather_dim, ranks)) for x in xs]


def _moved_shape(shape, scatter_dim: int, gather_dim: int, ranks: int) -> list:
    shape = list(shape)
    shape[scatter_dim % len(shape)] //= ranks
    shape[gather_dim % len(shape)] *= ranks
    return shape


def _save_exchange(ctx, inputs, output):
    ctx.args = inputs[1:]
    ctx.made = [(x.shape, x.dtype, x.device) for x in output]


def _exchange_back(ctx, grads):
    scatter_dim, gather_dim, ranks, channel, axis, name, _ = ctx.args
    grads = [  # an output that nothing read has no gradient: it sends zeros, as the eager exchange does
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad
        for grad, (shape, dtype, device) in zip(grads, ctx.made)
    ]
    back = _channel_exchange(grads, gather_dim, scatter_dim, ranks, channel, axis, name, "backward")
    return back, *([None] * len(ctx.args))


_channel_exchange.register_autograd(_exchange_back, setup_context=_save_exchange)


def _check_divides(x: torch.Tensor, scatter_dim: int, group, name: str) -> None:
    if x.shape[scatter_dim] % group.size():
        raise ValueError(
            f"{name or 'all_to_all'}: dimension {scatter_dim} of shape {tuple(x.shape)} does not divide "
            f"over {group.size()} ranks"
        )


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group, name: str = "", donate: bool = False
) -> torch.Tensor:
    """Split ``scatter_dim`` over the group and gather ``gather_dim`` from it: one all-to-all each way.
    ``group`` is a process group, or a :class:`TracedGroup` inside a compiled layer. ``donate``: the caller
    reads ``x`` no more, and the result may take its storage (eager only; the backward never donates)."""
    _check_divides(x, scatter_dim, group, name)
    if isinstance(group, TracedGroup):
        return _channel_exchange(
            [x], scatter_dim, gather_dim, group.size(), group.channel, group.axis, name, "forward"
        )[0]
    there, back = (scatter_dim, gather_dim), (gather_dim, scatter_dim)
    return _Exchange.apply(x, _exchange, there, back, group, name, donate)


def all_to_all_together(
    xs: tuple[torch.Tensor, ...], scatter_dim: int, gather_dim: int, group, name: str = ""
) -> tuple[torch.Tensor, ...]:
    """:func:`all_to_all` of several tensors at once: one all-to-all each way for those of each dtype
    (Ulysses' q, k and v; a linear-attention kernel's inputs), the same bytes as one each."""
    for x in xs:
        _check_divides(x, scatter_dim, group, name)
    moved = {}
    for dtype in dict.fromkeys(x.dtype for x in xs):
        places = [i for i, x in enumerate(xs) if x.dtype == dtype]
        alike = [xs[i] for i in places]
        moved.update(zip(places, _of_one_dtype(alike, scatter_dim, gather_dim, group, name)))
    return tuple(moved[i] for i in range(len(xs)))


def collectives_together(xs) -> int:
    """How many all-to-alls :func:`all_to_all_together` launches each way for ``xs`` (``None`` skipped): one
    for each dtype among them."""
    return len({x.dtype for x in xs if x is not None})


def _of_one_dtype(xs: list, scatter_dim: int, gather_dim: int, group, name: str) -> tuple:
    if isinstance(group, TracedGroup):
        return tuple(
            _channel_exchange(
                xs, scatter_dim, gather_dim, group.size(), group.channel, group.axis, name, "forward"
            )
        )
    return _ExchangeTogether.apply((scatter_dim, gather_dim), group, name, *xs)


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
