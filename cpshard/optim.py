"""A functional AdamW over parameter pytrees: new params and state out, nothing changed in place."""

from __future__ import annotations

from typing import NamedTuple

import optree
import torch


class AdamState(NamedTuple):
    """AdamW's state: the step count and the first and second moments, pytrees like the params."""

    step: int
    mu: dict
    nu: dict


def adamw_init(params: dict) -> AdamState:
    """Zero moments shaped like ``params``."""
    return AdamState(0, optree.tree_map(torch.zeros_like, params), optree.tree_map(torch.zeros_like, params))


@torch.no_grad()
def adamw_update(params, grads, state: AdamState, *, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01):
    """One AdamW step over pytrees: new params and a new state, nothing changed in place."""
    step = state.step + 1
    mu = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    mu_hat, nu_hat = 1 - b1**step, 1 - b2**step

    def move(p, m, v):
        return p * (1 - lr * weight_decay) - lr * (m / mu_hat) / ((v / nu_hat).sqrt() + eps)

    return optree.tree_map(move, params, mu, nu), AdamState(step, mu, nu)
