"""Gradients under plain autograd, and ``value_and_grad``: the loss and those gradients in one call.

Each rank differentiates its own share of the loss. The parameters enter the cp computation
through :func:`summed_in_backward`, the identity whose backward sums each gradient over the ranks
that hold other tokens (one bucketed all-reduce per dtype), so ``backward()`` or
``torch.autograd.grad`` of anything computed from a ``CPOutput`` leaves one process's gradient; the batch's
inputs that require a gradient, through :func:`inputs_summed_in_backward`, likewise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from cpshard.comm.collectives import sum_many_grads_over_group, sum_now_over_group
from cpshard.comm.record import serving
from cpshard.parallel.mesh import REPLICA_AXES, TOKEN_AXES, group_over


def summed_in_backward(params: dict, mesh) -> dict:
    """``params`` as they are, their gradients summed over the ranks that hold other tokens.

    Plain tensors sum over every such dimension here. DTensors (``cpshard.parallelize``) are summed
    over ``fsdp x cp`` by the reduce-scatter of their gather (:func:`cpshard.parallel.fsdp.gather_params`),
    so their local shards sum over ``dp_replicate`` here."""
    result = dict(params)
    for sharded, axes in ((False, TOKEN_AXES), (True, REPLICA_AXES)):
        names = [n for n, v in params.items() if isinstance(v, DTensor) == sharded and v.requires_grad]
        group = group_over(mesh, axes) if names else None
        if group is None:
            continue
        values = [params[n].to_local() if sharded else params[n] for n in names]
        with serving("replicas"):
            summed = sum_many_grads_over_group(values, group, name="gradients", reached=True)
        for name, value in zip(names, summed):
            if sharded:
                p = params[name]
                value = DTensor.from_local(
                    value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            result[name] = value
    return result


def inputs_summed_in_backward(inputs: dict, mesh) -> dict:
    """The model's inputs as they are, the gradients of those that require one (``inputs_embeds`` from a
    trainable adapter, soft prompt or vision tower outside the model) summed over cp: every cp rank holds
    the same input and its backward reaches only its tokens' share (the sequence is cut after the
    embeddings), so the sum is the one process's gradient, on every cp rank of the input's dp group."""
    names = [name for name, x in inputs.items() if isinstance(x, torch.Tensor) and x.requires_grad]
    group = group_over(mesh, ("cp",)) if names else None
    if group is None:
        return inputs
    summed = sum_many_grads_over_group([inputs[name] for name in names], group, name="input gradients")
    return {**inputs, **dict(zip(names, summed))}


def _grads_of(output, leaves: dict) -> list[torch.Tensor]:
    if output.loss is None:
        raise ValueError("value_and_grad needs a loss: give the batch labels or shift_labels")
    grads = torch.autograd.grad(output.loss, list(leaves.values()), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(leaves.values(), grads)]


@runtime_checkable
class FoldsReductions(Protocol):
    """What a cp forward may offer :func:`value_and_grad` (cpshard's own does): its reductions folded into
    the gradients' one all-reduce. ``folds_reductions(params)``: whether it can for these parameters;
    ``unreduced(params, batch, mesh)``: its output with this rank's share of the loss, whose sum over the
    ranks that hold other tokens is the call's loss (and so the shares' gradients sum to the call's). Any
    other callable ``(params, batch, mesh) -> CPOutput`` is differentiated as it is."""

    def folds_reductions(self, params: dict) -> bool: ...

    def unreduced(self, params: dict, batch: dict, mesh): ...


def value_and_grad(cp_forward):
    """``fn(params, batch, mesh) -> (CPOutput, grads)``, grads with the keys of ``params``: the gradients of
    ``output.loss`` that plain autograd gives, whatever the parameters' ``requires_grad`` says. DTensor
    parameters get DTensor gradients with their placements.

    Where the cp forward can hand over its unreduced shares (:class:`FoldsReductions`; cpshard's can for
    plain parameters), each rank differentiates its share of the loss and one all-reduce per dtype sums the
    gradients and the loss together, as a data-parallel step does, instead of one for the loss in the
    forward and one for the gradients."""
    if isinstance(cp_forward, nn.Module):
        raise TypeError(
            "value_and_grad takes a cp forward, not the model: "
            f"value_and_grad(cpshard.make_cp_forward(model)) (it was given a {type(cp_forward).__name__})"
        )

    def run(params: dict, batch: dict, mesh):
        leaves = {name: value.detach().requires_grad_(True) for name, value in params.items()}
        if not isinstance(cp_forward, FoldsReductions) or not cp_forward.folds_reductions(leaves):
            output = cp_forward(leaves, batch, mesh)
            return output, dict(zip(leaves, _grads_of(output, leaves)))
        output = cp_forward.unreduced(leaves, batch, mesh)
        grads, group = _grads_of(output, leaves), group_over(mesh, TOKEN_AXES)
        if group is not None:
            with serving("replicas"):
                *grads, loss = sum_now_over_group([*grads, output.loss.detach()], group, name="gradients")
            output = replace(output, loss=loss)
        return output, dict(zip(leaves, grads))

    return run
