"""The bench's peers, as their users run them: each gives one process's loss and gradients (fp32), cuts the
batch as DeepSpeed's adapter does, and refuses what it cannot cut."""

import pytest
import torch
import torch.distributed as dist

from cpshard.bench import baselines
from cpshard.parallel.mesh import make_mesh
from cpshard.runtime.forward import params_of
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

SIZES = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
PEERS = ("dtensor", "deepspeed", "yunchang")


def worst_difference(name: str, length: int) -> tuple[float, float]:
    """On a rank: the largest difference of the peer's loss and gradients from one process's."""
    mesh = make_mesh(cp=dist.get_world_size())
    model, batch = tiny_model("llama", **SIZES), tiny_batch(64, 1, length)
    params = params_of(model)
    loss, grads = baselines.peer_step(name, tiny_model("llama", **SIZES))(params, batch, mesh)
    want_loss, _, want_grads = reference(model, params, batch)
    worst = max(float((grads[n] - want_grads[n]).abs().max() / want_grads[n].abs().max()) for n in params)
    return float((loss - want_loss).abs() / want_loss), worst


@pytest.mark.parametrize("name", PEERS)
def test_peer_is_one_process(ranks2, name):
    if baselines.missing(name):
        pytest.skip(baselines.missing(name))
    for loss, grads in ranks2.run(worst_difference, name, 64):
        assert loss < 1e-5 and grads < 1e-5


def test_kv_heads_repeated_when_fewer_than_ranks(ranks4):
    for loss, grads in ranks4.run(worst_difference, "dtensor", 64):  # 2 kv heads over 4 ranks
        assert loss < 1e-5 and grads < 1e-5


def test_shard_batch_cuts_after_shifting():
    batch = dict(input_ids=torch.arange(8).reshape(1, 8), labels=torch.arange(10, 18).reshape(1, 8))
    second = baselines.shard_batch(batch, 1, 2)
    assert second["input_ids"].tolist() == [[4, 5, 6, 7]] and second["position_ids"].tolist() == [
        [4, 5, 6, 7]
    ]
    assert second["shift_labels"].tolist() == [[15, 16, 17, -100]]
    assert int(baselines.label_count(batch)) == 7


@pytest.mark.parametrize(
    "batch, message",
    [
        (dict(input_ids=torch.zeros(1, 7, dtype=torch.long), labels=torch.zeros(1, 7)), "divisible by 2"),
        (
            dict(input_ids=torch.zeros(1, 8), labels=torch.zeros(1, 8), attention_mask=torch.ones(1, 8)),
            "alone",
        ),
    ],
)
def test_shard_batch_refuses_what_peers_cannot_cut(batch, message):
    with pytest.raises(ValueError, match=message):
        baselines.shard_batch(batch, 0, 2)
