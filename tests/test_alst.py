"""The ALST peer (DeepSpeed's ulysses_sp stack) gives one process's loss and gradients (fp32)."""

import pytest
import torch.distributed as dist

from cpshard.bench import baselines
from cpshard.parallel.mesh import make_mesh
from cpshard.runtime.forward import params_of
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)


def worst_difference(length: int) -> tuple[float, float]:
    """On a rank: the largest relative difference of ALST's loss and gradients from one process's."""
    from cpshard.bench.alst import alst_step

    mesh = make_mesh(cp=dist.get_world_size())
    model, batch = tiny_model("llama", **SIZES), tiny_batch(64, 1, length)
    # as many label tokens on each rank (the last is ignored): ALST's LM head gradient is a mean of means
    batch["labels"][:, 1] = -100
    params = params_of(model)
    step = alst_step(tiny_model("llama", **SIZES))
    step(params, batch, mesh)  # twice: nothing of the first step stays in the second
    loss, grads = step(params, batch, mesh)
    want_loss, _, want_grads = reference(model, params, batch)
    worst = max(float((grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max()) for n in params)
    return float((loss - want_loss).abs() / want_loss), worst


def test_alst_is_one_process(ranks2):
    if baselines.missing("alst"):
        pytest.skip(baselines.missing("alst"))
    for loss, grads in ranks2.run(worst_difference, 96):  # 48 tokens a rank: two tiles of the MLP
        assert loss < 1e-5 and grads < 1e-5
