"""``value_and_grad``: the loss and gradients of a cp forward, already reduced over the mesh."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from cpshard.comm.collectives import all_reduce_flat
from cpshard.parallel.mesh import TOKEN_DIMS, group_over
from cpshard.parallel.placement import REPLICA_DIMS


def value_and_grad(cp_forward):
    """``fn(params, batch, mesh) -> (CPOutput, grads)``, grads with the keys of ``params``.

    Each rank differentiates its own share of the loss; one bucketed all-reduce over every
    dimension that holds different tokens then gives each rank the whole gradient. DTensor
    parameters get DTensor gradients with their placements (see :func:`sum_over_tokens`).
    """

    def run(params: dict, batch: dict, mesh):
        leaves = {name: value.detach().requires_grad_(True) for name, value in params.items()}
        output = cp_forward(leaves, batch, mesh)
        if output.loss is None:
            raise ValueError("value_and_grad needs a loss: give the batch labels or shift_labels")
        grads = torch.autograd.grad(output.loss, list(leaves.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves.values(), grads)]
        return output, dict(zip(leaves, sum_over_tokens(grads, mesh)))

    return run


def sum_over_tokens(grads: list, mesh) -> list:
    """Each rank's share of the gradients summed over the ranks that hold other tokens.

    Plain gradients sum over every such dimension here. Sharded ones (``cpshard.parallelize``) were
    summed over ``fsdp x cp`` by the reduce-scatter of their parameters' gather, and sum over
    ``dp_replicate`` here, shard by shard."""
    result = list(grads)
    for sharded, dims in ((False, TOKEN_DIMS), (True, REPLICA_DIMS)):
        picked = [i for i, g in enumerate(grads) if isinstance(g, DTensor) == sharded]
        group = group_over(mesh, dims) if picked else None
        if group is None:
            continue
        summed = all_reduce_flat(
            [grads[i].to_local() if sharded else grads[i] for i in picked], group, name="gradients"
        )
        for i, local in zip(picked, summed):
            g = grads[i]
            result[i] = (
                DTensor.from_local(
                    local, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
                )
                if sharded
                else local
            )
    return result
