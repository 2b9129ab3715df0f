"""Strict mode: an implicit DTensor redistribution planted inside cp_forward raises, naming the op
and the placements; without strict the same forward runs and gives the same loss."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model


def run_planted(strict: bool, plant: bool) -> float:
    """A decoder layer's output goes through ``sequence-split + replicated`` DTensors: DTensor must
    slice the replicated zeros to Shard(1) first, a redistribution nobody asked for (the values stay)."""
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 12)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    cp_mesh = mesh["cp"]

    def add_replicated_zeros(module, args, output):
        local = DTensor.from_local(output, cp_mesh, [Shard(1)], run_check=False)
        whole = torch.zeros(output.shape[0], output.shape[1] * cp_mesh.size(), output.shape[2])
        return (local + DTensor.from_local(whole, cp_mesh, [Replicate()], run_check=False)).to_local()

    if plant:
        model.model.layers[0].register_forward_hook(add_replicated_zeros)
    cp_forward = cpshard.make_cp_forward(model, strict=strict)
    return cp_forward(cpshard.params_of(model), batch, mesh).loss.item()


def test_strict_raises_on_a_planted_redistribution(ranks2):
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(run_planted, True, True)
    assert sorted(caught.value.failures) == [0, 1], "every rank must raise, or the others would hang"
    for failure in caught.value.failures.values():
        assert failure.kind == "RuntimeError"
        assert "Implicit redistribution" in failure.message and "aten.add.Tensor" in failure.message
        assert "S(1)" in failure.message and "(R)" in failure.message, failure.message
    assert ranks2.alive


def test_without_strict_it_runs_and_strict_has_no_false_alarm(ranks2):
    for plain, planted, strict_clean in zip(
        *(ranks2.run(run_planted, s, p) for s, p in ((False, False), (False, True), (True, False)))
    ):
        assert planted == plain == strict_clean
