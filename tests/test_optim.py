"""Functional AdamW: torch's AdamW step for step, inputs untouched."""

import optree
import torch

from cpshard.optim import AdamState, adamw_init, adamw_update


def test_adamw_matches_torch_and_changes_nothing_in_place():
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    reference = {name: torch.nn.Parameter(value.clone()) for name, value in params.items()}
    torch_adamw = torch.optim.AdamW(reference.values(), lr=0.1, weight_decay=0.01)
    state, before = adamw_init(params), optree.tree_map(torch.clone, params)
    for _ in range(3):
        grads = {name: torch.randn_like(value) for name, value in params.items()}
        for name, p in reference.items():
            p.grad = grads[name].clone()
        torch_adamw.step()
        new, state = adamw_update(params, grads, state, lr=0.1, weight_decay=0.01)
        assert all(torch.equal(params[n], before[n]) for n in params), "adamw_update changed its input"
        params, before = new, optree.tree_map(torch.clone, new)
    assert isinstance(state, AdamState) and state.step == 3
    for name, p in reference.items():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-6, atol=1e-6)
