"""value_and_grad: gradients already reduced, whatever requires_grad says, over cp and dp."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model


def run_requires_grad_does_not_matter():
    model = tiny_model("qwen3")
    batch = tiny_batch(model.config.vocab_size, 2, 9, pad="right")
    grad_fn = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    mesh = cpshard.make_mesh(cp=2)
    frozen = {name: p.detach() for name, p in cpshard.params_of(model).items()}
    _, from_frozen = grad_fn(frozen, batch, mesh)
    _, from_live = grad_fn(cpshard.params_of(model), batch, mesh)
    assert list(from_frozen) == list(frozen)
    return {name: torch.equal(from_frozen[name], from_live[name]) for name in frozen}, from_frozen


def test_requires_grad_does_not_matter_and_ranks_agree(ranks2):
    (same0, grads0), (same1, grads1) = ranks2.run(run_requires_grad_does_not_matter)
    assert all(same0.values()) and all(same1.values())
    assert all(torch.equal(grads0[name], grads1[name]) for name in grads0), "ranks hold different gradients"


def run_without_labels():
    model = tiny_model("llama")
    batch = {"input_ids": tiny_batch(model.config.vocab_size, 1, 6)["input_ids"]}
    cp_forward = cpshard.make_cp_forward(model)
    output = cp_forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    assert output.loss is None and output.logits is not None
    cpshard.value_and_grad(cp_forward)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))


def test_value_and_grad_without_labels_says_what_is_missing(ranks2):
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(run_without_labels)
    assert sorted(caught.value.failures) == [0, 1]
    assert "give the batch labels or shift_labels" in caught.value.failures[0].message


def run_data_parallel_batches():
    """dp_replicate=2 x cp=2: each dp group its own batch; the loss is that of one process over both."""
    model = tiny_model("mistral", sliding_window=4)
    batches = [tiny_batch(model.config.vocab_size, 2, 11, pad="left", seed=seed) for seed in (1, 2)]
    batches[1]["labels"][:, :6] = -100  # different token counts: a mean of means would be wrong
    mesh = cpshard.make_mesh(dp_replicate=2, cp=2)
    mine = batches[mesh.get_local_rank("dp_replicate")]
    output, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(
        cpshard.params_of(model), mine, mesh
    )
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    ref_loss, _, ref_grads = reference(model, cpshard.params_of(model), whole)
    count = int((whole["labels"][:, 1:] != -100).sum())
    worst = max((grads[name] - ref_grads[name]).abs().max().item() for name in grads)
    return (
        abs(output.loss.item() - ref_loss.item()),
        worst,
        output.num_tokens.item() == count,
        dist.get_rank(),
    )


def test_data_parallel_loss_and_gradients_are_one_process_over_all_batches(ranks4):
    for loss_diff, grad_diff, count_ok, rank in ranks4.run(run_data_parallel_batches):
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5 and count_ok, (rank, loss_diff, grad_diff)
