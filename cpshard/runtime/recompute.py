"""Activation checkpointing under cp: the recompute runs inside the cp call that made the forward.

transformers' checkpointed layers re-run their ``forward`` during the backward, after
``cp_forward`` has returned, so the attention function would find no running call and attend
over the local slice alone: wrong gradients of the right shape. For the length of each call,
every checkpointing module's checkpoint function is wrapped so that the function it recomputes
enters the call again; the collectives then re-run in the backward, in the same order on every rank.

The recompute also needs the call's parameters: cp_forward runs the model under
``torch.func.functional_call``, whose parameters are back to the module's own by the time the backward
recomputes, and a layer reads its weights from the module. So the module's parameters of the forward
enter each checkpoint as inputs and are put back on the module for the recompute (without them a
functional training loop would get the gradients of the stale weights the module holds).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

from torch import nn
from torch.nn.utils.stateless import _reparametrize_module

from cpshard.call import CallPlan, running

_FUNC = "_gradient_checkpointing_func"


def _in_call(call: CallPlan, module: nn.Module, names: tuple[str, ...], fn, count: int, *inputs, **kwargs):
    """``fn`` on the first ``count`` inputs, inside ``call``, with the rest of the inputs as ``module``'s
    parameters ``names``."""
    with running(call), _reparametrize_module(module, dict(zip(names, inputs[count:]))):
        return fn(*inputs[:count], **kwargs)


def checkpoint_in_call(checkpoint, call: CallPlan, module: nn.Module, fn, *args, **kwargs):
    """``checkpoint(fn, *args, **kwargs)`` whose recompute runs inside ``call`` with the parameters ``module``
    holds now (the call's)."""
    names = tuple(name for name, _ in module.named_parameters())
    values = tuple(value for _, value in module.named_parameters())
    return checkpoint(partial(_in_call, call, module, names, fn, len(args)), *args, *values, **kwargs)


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
        setattr(module, _FUNC, partial(checkpoint_in_call, getattr(module, _FUNC), call, module))
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                delattr(module, _FUNC)
            else:
                setattr(module, _FUNC, own)
