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

``make_cp_forward(attention_recompute=True)`` also checkpoints each layer's attention module on its own
(:class:`RecomputedForward`), nested in the layer's checkpoint: the layer's backward then holds the
attention's activations only while it runs the attention's backward, not through the MLP's.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils.checkpoint import checkpoint

from cpshard.call import CallPlan, current_call, running

_FUNC = "_gradient_checkpointing_func"


def _in_call(
    call: CallPlan | None, module: nn.Module, names: tuple[str, ...], fn, count: int, *inputs, **kwargs
):
    """``fn`` on the first ``count`` inputs, inside ``call``, with the rest of the inputs as ``module``'s
    parameters ``names``, and the checkpoints nested in ``module`` wrapped as in the forward (a recompute
    runs after :func:`recompute_in` has ended: a nested checkpoint must take the inputs it took then)."""
    with running(call), _reparametrize_module(module, dict(zip(names, inputs[count:]))), recompute_in(module):
        return fn(*inputs[:count], **kwargs)


def checkpoint_in_call(checkpoint, call: CallPlan | None, module: nn.Module, fn, *args, **kwargs):
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


def _checkpoint_in_running_call(checkpoint, module: nn.Module, fn, *args, **kwargs):
    """``checkpoint_in_call`` in the call running ``module``'s forward now: a call nested in the cp call
    (BLT's global transformer runs in one of its patches' length), or none (what cp runs whole inside one)."""
    return checkpoint_in_call(checkpoint, current_call(), module, fn, *args, **kwargs)


def _in_running_call(function) -> bool:
    """Whether a module's checkpoint function is :func:`recompute_in`'s wrapper."""
    return isinstance(function, partial) and function.func is _checkpoint_in_running_call


@contextmanager
def recompute_in(model: nn.Module):
    """While the block runs, checkpointed modules recompute inside the call that ran their forward;
    afterwards, as they were (modules wrapped already, by an enclosing block, stay as they are)."""
    patched = [
        (module, module.__dict__.get(_FUNC))
        for module in checkpointing_modules(model)
        if not _in_running_call(getattr(module, _FUNC))
    ]
    for module, _ in patched:
        setattr(module, _FUNC, partial(_checkpoint_in_running_call, getattr(module, _FUNC), module))
    try:
        yield
    finally:
        for module, own in patched:
            if own is None:
                delattr(module, _FUNC)
            else:
                setattr(module, _FUNC, own)


class OwnForward:
    """A module's instance ``forward`` that cpshard puts over the module's own (kept as ``own_forward``)."""

    def __init__(self, module: nn.Module, own_forward):
        self.module, self.own_forward = module, own_forward


def install_forward(modules: list[nn.Module], kind: type[OwnForward]) -> None:
    """Give each module the forward ``kind`` (replacing one cpshard installed before, never nesting it)."""
    for module in modules:
        installed = module.__dict__.get("forward")
        own = installed.own_forward if isinstance(installed, OwnForward) else module.forward
        module.forward = kind(module, own)


def _keywords_last(fn, keys: tuple[str, ...], rest: dict, count: int, *inputs):
    return fn(*inputs[:count], **dict(zip(keys, inputs[count:])), **rest)


class RecomputedForward(OwnForward):
    """An attention module's forward under a checkpoint of its own, inside a call of a cp forward made with
    ``attention_recompute=True``; the module's own forward everywhere else. Its tensor keywords enter the
    checkpoint as inputs: a checkpoint holds keywords as they are, so the layer's own checkpoint would
    otherwise keep the attention's input of every layer alive from the forward to the backward."""

    def __call__(self, *args, **kwargs):
        call = current_call()
        if call is None or not call.attention_recompute or not torch.is_grad_enabled():
            return self.own_forward(*args, **kwargs)
        keys = tuple(key for key, value in kwargs.items() if isinstance(value, torch.Tensor))
        rest = {key: value for key, value in kwargs.items() if key not in keys}
        fn = partial(_keywords_last, self.own_forward, keys, rest, len(args))
        inputs = (*args, *(kwargs[key] for key in keys))
        return checkpoint_in_call(checkpoint, call, self.module, fn, *inputs, use_reentrant=False)


class UndifferentiatedForward(OwnForward):
    """A module's forward without autograd inside a cp call: for a module whose output carries no gradient
    (DeepSeek-V4's lightning indexer returns the integer indices of a top-k), whose intermediate tensors
    autograd would otherwise keep for a backward that never reaches them; the same values. The module's own
    forward everywhere else."""

    def __call__(self, *args, **kwargs):
        if current_call() is None:
            return self.own_forward(*args, **kwargs)
        with torch.no_grad():
            return self.own_forward(*args, **kwargs)
