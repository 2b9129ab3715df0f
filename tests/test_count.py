"""Gradient accumulation: num_items_in_batch from count_label_tokens makes summed micro-batch gradients the
whole step's, against one process on the concatenated batch; a wrong count is an error on every rank."""

import pytest
import torch
from torch.distributed.tensor import DTensor

import cpshard
from cpshard.runtime.batch import BatchError, validate
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

VOCAB = 130


def _micro_batches(count: int, seed: int) -> list[dict]:
    """``count`` micro-batches of 2 rows whose label-token counts all differ."""
    batches = [tiny_batch(VOCAB, 2, 13, pad="right", seed=seed * 10 + i) for i in range(count)]
    for i, batch in enumerate(batches):
        batch["labels"][:, : 2 * i + 1] = -100
    return batches


def run_accumulation(sizes: dict, steps: int):
    mesh = cpshard.make_mesh(**sizes)
    model, twin = tiny_model("llama", vocab_size=VOCAB), tiny_model("llama", vocab_size=VOCAB)
    groups = sizes.get("fsdp", 1)
    every = [_micro_batches(steps, seed) for seed in range(groups)]
    mine = every[mesh.get_local_rank("fsdp") if groups > 1 else 0]
    if groups > 1:
        cpshard.parallelize(model, mesh)
    params = cpshard.params_of(model)
    cp_forward = cpshard.make_cp_forward(model)
    num_items = cpshard.count_label_tokens(mine, mesh)
    total = torch.zeros(())
    for batch in mine:  # the loop of the README: backward per micro-batch, gradients accumulate
        output = cp_forward(params, {**batch, "num_items_in_batch": num_items}, mesh)
        output.loss.backward()
        total += output.loss.detach()
    whole = {key: torch.cat([b[key] for group in every for b in group]) for key in mine[0]}
    ref_loss, _, ref_grads = reference(twin, cpshard.params_of(twin), whole)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in params.items()}
    scale = max(g.abs().max().item() for g in ref_grads.values())
    return {
        "count": (int(num_items), int((whole["labels"][:, 1:] != -100).sum())),
        "loss": abs(total.item() - ref_loss.item()) / ref_loss.item(),
        "grads": max((grads[n] - ref_grads[n]).abs().max().item() for n in grads) / scale,
    }


@pytest.mark.parametrize("steps", [2, 3])
def test_accumulated_gradients_are_the_whole_steps_cp2(ranks2, steps):
    for rank, checks in enumerate(ranks2.run(run_accumulation, dict(cp=2), steps)):
        assert checks["count"][0] == checks["count"][1], (rank, checks)
        assert max(checks["loss"], checks["grads"]) <= 1e-5, (rank, checks)


@pytest.mark.parametrize("steps", [2, 3])
def test_accumulated_gradients_are_the_whole_steps_fsdp2xcp2(ranks4, steps):
    for rank, checks in enumerate(ranks4.run(run_accumulation, dict(fsdp=2, cp=2), steps)):
        assert checks["count"][0] == checks["count"][1], (rank, checks)
        assert max(checks["loss"], checks["grads"]) <= 1e-5, (rank, checks)


def run_wrong_count(kind: str):
    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    model = tiny_model("llama", vocab_size=VOCAB)
    batch = _micro_batches(1, mesh.get_local_rank("fsdp"))[0]
    count = {"differs": 100 + mesh.get_local_rank("fsdp"), "too-small": torch.tensor(3)}[kind]
    cpshard.make_cp_forward(model)(cpshard.params_of(model), {**batch, "num_items_in_batch": count}, mesh)


@pytest.mark.parametrize(
    "kind, message",
    [("differs", "differs across the dp groups"), ("too-small", "is fewer than this batch's own")],
)
def test_a_wrong_count_is_an_error_on_every_rank(ranks4, kind, message):
    with pytest.raises(cpshard.RankError) as caught:
        ranks4.run(run_wrong_count, kind)
    assert sorted(caught.value.failures) == [0, 1, 2, 3]
    assert all(message in failure.message for failure in caught.value.failures.values())


@pytest.mark.parametrize("count", [0, 2.0, torch.tensor([3]), torch.tensor(3.0), "3"])
def test_a_count_that_is_not_a_positive_integer_is_refused(count):
    batch = {"input_ids": torch.ones(1, 4, dtype=torch.long), "num_items_in_batch": count}
    with pytest.raises(BatchError, match="must be a positive integer"):
        validate(batch)
