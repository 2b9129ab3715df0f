"""Ring attention as a compiled layer calls it: one custom op forward, one backward, opaque to torch.compile.

The ring's schedule (point-to-point sends, block masks derived from the mask's values, a plan that skips
hidden blocks) cannot be traced, and need not be: the ops run :func:`ring_forward` and
:func:`ring_backward` when the layer runs, on the :class:`Channel`'s group, with the blocks of the running
call, exactly as :class:`RingAttention` does in eager mode.
"""

from __future__ import annotations

import torch

from cpshard.attention.blocks import call_blocks
from cpshard.attention.ring import Ring, accumulation, ring_backward, ring_forward
from cpshard.comm.channel import Channel, TracedGroup
from cpshard.precision import autocast_off


def _ring_of(mask, scale: float, softcap, uniform_rows: bool, channel: Channel, axis: str, name: str) -> Ring:
    """The ring call the ops' arguments describe, with the blocks of the running call."""
    blocks = call_blocks(channel.call, mask, uniform_rows)
    return Ring(blocks, scale, softcap, channel.groups[axis], channel.path + name)


def _ring_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    uniform_rows: bool,
    channel: Channel,
    axis: str,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(output, out, lse)``: the output in q's shape and dtype, and the results the backward needs, in the
    ring's :func:`accumulation` type;
    contiguous, as the fake says (inductor checks the strides; ``out`` follows q's, a transposed view)."""
    with autocast_off():  # the op's body runs under the caller's autocast (as RingAttention's own_precision)
        out, lse = ring_forward(q, k, v, _ring_of(mask, scale, softcap, uniform_rows, channel, axis, name))
    output = out.reshape(q.shape).to(q.dtype, memory_format=torch.contiguous_format, copy=True)
    return output, out.contiguous(), lse.contiguous()


_ring = torch.library.custom_op("cpshard::ring_attention", _ring_forward, mutates_args=())
#: the backward takes its own tensors (the output's gradient, the forward's ``out`` and ``lse``), then the
#: forward's arguments (their schema the forward's, inferred from its annotations), and gives dq, dk, dv
_FORWARD_ARGUMENTS = torch.library.infer_schema(_ring_forward, mutates_args=()).split(" -> ")[0]
_BACKWARD_SCHEMA = "(Tensor grad, Tensor out, Tensor lse, " + _FORWARD_ARGUMENTS.removeprefix("(")
_BACKWARD_SCHEMA += " -> (Tensor, Tensor, Tensor)"


@_ring.register_fake
def _(q, k, v, *config):
    batch, heads, rows, dim = q.shape
    grouped = (batch, k.shape[1], heads // k.shape[1], rows)
    return (
        q.new_empty(q.shape),
        q.new_empty((*grouped, dim), dtype=accumulation(q.dtype)),
        q.new_empty(grouped, dtype=accumulation(q.dtype)),
    )


@torch.library.custom_op("cpshard::ring_attention_backward", mutates_args=(), schema=_BACKWARD_SCHEMA)
def _ring_back(grad, out, lse, q, k, v, mask, *config):
    ring = _ring_of(mask, *config)
    with autocast_off():
        grad_q, grad_k, grad_v = ring_backward(q, k, v, out, lse, grad, ring)
    # contiguous, as the fake says; dk and dv may be views of one buffer, and an op's outputs may not alias
    return grad_q.contiguous(), *(
        grad.clone(memory_format=torch.contiguous_format) for grad in (grad_k, grad_v)
    )


@_ring_back.register_fake
def _(grad, out, lse, q, k, v, *config):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output):
    q, k, v, mask, *ctx.config = inputs
    ctx.save_for_backward(q, k, v, output[1], output[2], mask)


def _backward(ctx, grad, _out, _lse):
    q, k, v, out, lse, mask = ctx.saved_tensors
    return *_ring_back(grad, out, lse, q, k, v, mask, *ctx.config), None, *(None for _ in ctx.config)


_ring.register_autograd(_backward, setup_context=_save)


def traced_ring(q, k, v, mask, scale: float, softcap, uniform_rows: bool, group: TracedGroup, name: str):
    """This rank's q over every rank's k and v on the ring of ``group`` (q's shape and dtype)."""
    return _ring(q, k, v, mask, scale, softcap, uniform_rows, group.channel, group.axis, name)[0]
