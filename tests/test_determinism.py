"""The same cp step twice gives bit-identical loss, logits and gradients (torch.equal, not a tolerance)."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model


def _step(model, forward: dict, batch: dict):
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    output, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model, **forward))(
        cpshard.params_of(model), batch, mesh
    )
    return output.loss, output.logits.to_local(), grads


def run_twice(forward: dict):
    """Two steps on one model and batch (left padding and packed documents); which parts are bit-identical."""
    model = tiny_model("gemma3_text", sliding_window=5)  # mixed sliding and full layers
    batch = tiny_batch(model.config.vocab_size, 3, 21, pad="left", packed=True)
    (loss, logits, grads), (loss2, logits2, grads2) = (
        _step(model, forward, batch),
        _step(model, forward, batch),
    )
    return {
        "loss": torch.equal(loss, loss2),
        "logits": torch.equal(logits, logits2),
        "gradients": sorted(grads) == sorted(grads2) and all(torch.equal(grads[n], grads2[n]) for n in grads),
    }


@pytest.mark.parametrize(
    "cp, implementation", [(2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring"), (4, "hybrid")]
)
def test_the_same_step_twice_is_bit_identical(ranks2, ranks4, cp, implementation):
    for same in {2: ranks2, 4: ranks4}[cp].run(run_twice, dict(implementation=implementation)):
        assert all(same.values()), same
