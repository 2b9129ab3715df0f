"""``value_and_grad``: the loss and gradients of a cp forward, already reduced over the mesh."""

from __future__ import annotations

import torch

from cpshard.collectives import all_reduce_flat
from cpshard.mesh import TOKEN_DIMS, group_over


def value_and_grad(cp_forward):
    """``fn(params, batch, mesh) -> (CPOutput, grads)``, grads with the keys of ``params``.

    Each rank differentiates its own share of the loss; one bucketed all-reduce over every
    dimension that holds different tokens then gives each rank the whole gradient.
    """

    def run(params: dict, batch: dict, mesh):
        leaves = {name: value.detach().requires_grad_(True) for name, value in params.items()}
        output = cp_forward(leaves, batch, mesh)
        if output.loss is None:
            raise ValueError("value_and_grad needs a loss: give the batch labels or shift_labels")
        grads = torch.autograd.grad(output.loss, list(leaves.values()), allow_unused=True)
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(leaves.values(), grads)]
        group = group_over(mesh, TOKEN_DIMS)
        if group is not None:
            grads = all_reduce_flat(grads, group, name="gradients")
        return output, dict(zip(leaves, grads))

    return run
