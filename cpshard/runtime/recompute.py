"""Activation checkpointing under cp: the recompute runs inside the cp call that made the forward.

transformers' checkpointed layers re-run their ``forward`` during the backward, after
``cp_forward`` has returned, so the attention function would find no running call and attend
over the local slice alone: wrong gradients of the right shape. For the length of each call,
every checkpointing module's checkpoint function is wrapped so that the function it recomputes
enters the call again; the collectives then re-run in the backward, in the same order on every rank.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from torch import nn

from cpshard.call import CallPlan, running

_FUNC = "_gradient_checkpointing_func"


def _in_call(call: CallPlan, fn, *args, **kwargs):
    with running(call):
        return fn(*args, **kwargs)


def _checkpoint_in_call(checkpoint, call: CallPlan, fn, *args, **kwargs):
    return checkpoint(partial(_in_call, call, fn), *args, **kwargs)


def checkpointing_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose forward transformers checkpoints now (``activation_checkpointing_enable``)."""
    return [
        m
        for m in model.modules()
        if getattr(m, "gradient_checkpointing", False) and callable(getattr(m, _FUNC, None))
    ]


@contextmanager
def recompute_in(call: CallPlan, model: nn.Module):
    """While the block runs, checkpointed modules recompute inside ``call``; afterwards, as they were."""
    patched = [(module, module.__dict__.get(_FUNC)) for module in checkpointing_modules(model)]
    for module, _ in patched:
        setattr(module, _FUNC, partial(_checkpoint_in_call, getattr(module, _FUNC), call))
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                delattr(module, _FUNC)
            else:
                setattr(module, _FUNC, own)
