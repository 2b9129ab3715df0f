"""Activation checkpointing under cp: the recompute runs inside the cp call that made the forward.

transformers' checkpointed layers re-run their ``forward`` during the backward, after
``cp_forward`` has returned, so the attention function would find no running call and attend
over the local slice alone: wrong gradients of the right shape. For the length of each call,
every checkpointing module's checkpoint function is wrapped so that the function it recomputes
enters the call again; the collectives then re-run in the backward, in the same order on every rank.
The recompute also gets the call's parameters again: ``functional_call`` has put the module's own back
by then, and a recompute with them would give the gradients of other weights.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from cpshard.call import CallPlan, running

_FUNC = "_gradient_checkpointing_func"


def _in_call(call: CallPlan, module: nn.Module, tensors: dict, fn, *args, **kwargs):
    with running(call), _reparametrize_module(module, tensors):
        return fn(*args, **kwargs)


def _checkpoint_in_call(checkpoint, call: CallPlan, module: nn.Module, fn, *args, **kwargs):
    """``module``'s tensors as the forward sees them (cp_forward's ``params``, put in by functional_call)
    are put in again for the recompute: by then functional_call has given the module its own back."""
    tensors = dict(module.named_parameters(remove_duplicate=False))
    tensors.update(module.named_buffers(remove_duplicate=False))
    return checkpoint(partial(_in_call, call, module, tensors, fn), *args, **kwargs)


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
        setattr(module, _FUNC, partial(_checkpoint_in_call, getattr(module, _FUNC), call, module))
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                delattr(module, _FUNC)
            else:
                setattr(module, _FUNC, own)
