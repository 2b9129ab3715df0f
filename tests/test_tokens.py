"""Per-token tensors placed like the logits, and CPOutput.token_logprobs and token_statistics against one
process: values, a weighted objective's gradients, with and without logits, Ulysses and ring (head-tail
order), uneven L; and on Qwen3-Next, whose Gated DeltaNet layer passes its state between the ranks (ring
then runs contiguous)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

import cpshard
from cpshard.loss.statistics import STATISTICS, token_statistics
from cpshard.tools.tiny import tiny_batch, tiny_model

VOCAB = 130


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)


def _reference_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = _shifted(labels)
    picked = logits.log_softmax(-1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(shifted != -100, picked, 0.0)


def run_token_logprobs(sizes: dict, forward: dict, model_type: str = "llama"):
    mesh = cpshard.make_mesh(**sizes)
    model, twin = tiny_model(model_type, vocab_size=VOCAB), tiny_model(model_type, vocab_size=VOCAB)
    groups = sizes.get("fsdp", 1)  # each dp group its own batch: the objective sums over them
    batches = [tiny_batch(VOCAB, 3, 13, pad="left", seed=4 + g) for g in range(groups)]
    every_weights = torch.randn(3 * groups, 13, generator=torch.Generator().manual_seed(5))
    group = mesh.get_local_rank("fsdp") if groups > 1 else 0
    batch, weights = batches[group], every_weights[3 * group : 3 * group + 3]
    whole = {key: torch.cat([b[key] for b in batches]) for key in batch}
    if len(sizes) > 1:
        cpshard.parallelize(model, mesh)
    params = cpshard.params_of(model)
    cp_forward = cpshard.make_cp_forward(
        model, token_logprobs=True, token_statistics=tuple(STATISTICS), **forward
    )
    out = cp_forward(params, batch, mesh)
    placed = cpshard.shard_like_logits(weights, mesh)
    objective = (out.token_logprobs * placed).sum().full_tensor()  # a weighted-token loss, as DTensors
    grads = dict(zip(params, torch.autograd.grad(objective, list(params.values()))))

    leaves = {n: p.detach().requires_grad_(True) for n, p in cpshard.params_of(twin).items()}
    reference = torch.func.functional_call(twin, leaves, (), {**whole, "use_cache": False})
    ref_logprobs = _reference_logprobs(reference.logits, whole["labels"])
    ref_grads = torch.autograd.grad((ref_logprobs * every_weights).sum(), list(leaves.values()))
    ref_logprobs = ref_logprobs[3 * group : 3 * group + 3]
    rows = slice(3 * group, 3 * group + 3)
    ref_statistics = token_statistics(
        reference.logits[rows], _shifted(whole["labels"])[rows], tuple(STATISTICS)
    )
    statistics = {name: value.full_tensor() for name, value in out.token_statistics.items()}
    full = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    scale = max(g.abs().max().item() for g in ref_grads)
    got = out.token_logprobs
    return {
        "placement": (got.shape, got.placements, placed.placements) == ((3, 13), (Shard(1),), (Shard(1),)),
        "values": (got.full_tensor() - ref_logprobs).abs().max().item(),
        "loss": abs(out.loss.item() - reference.loss.item()),
        "grads": max((full[n] - r).abs().max().item() for n, r in zip(full, ref_grads)) / scale,
        "ignored are 0": bool((got.full_tensor()[:, -1] == 0).all()),
        "statistics": max(
            (statistics[n].float() - r.float()).abs().max().item() for n, r in ref_statistics.items()
        ),
        "statistics placed": all(value.placements == (Shard(1),) for value in out.token_statistics.values()),
        "logits": out.logits is not None,
    }


@pytest.mark.parametrize(
    "forward",
    [dict(), dict(logits=False), dict(implementation="ring"), dict(implementation="ring", logits=False)],
    ids=str,
)
def test_token_logprobs_are_one_process_cp2(ranks2, forward):
    for rank, checks in enumerate(ranks2.run(run_token_logprobs, dict(cp=2), forward)):
        assert checks["placement"] and checks["ignored are 0"], (rank, checks)
        assert max(checks["values"], checks["loss"], checks["grads"], checks["statistics"]) <= 1e-5, (
            rank,
            checks,
        )
        assert checks["statistics placed"], (rank, checks)
        assert checks["logits"] == forward.get("logits", True), (rank, checks)


def test_token_logprobs_are_one_process_fsdp2xcp2(ranks4):
    for rank, checks in enumerate(ranks4.run(run_token_logprobs, dict(fsdp=2, cp=2), dict(logits=False))):
        assert checks["placement"], (rank, checks)
        assert max(checks["values"], checks["loss"], checks["grads"], checks["statistics"]) <= 1e-5, (
            rank,
            checks,
        )
        assert checks["statistics placed"], (rank, checks)


def run_shard_like_logits():
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    model = tiny_model("llama", vocab_size=VOCAB)
    batch = tiny_batch(VOCAB, 2, 7, seed=2)  # 7 tokens over 2 ranks: 4 and 3
    logits = cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, mesh).logits
    labels = cpshard.shard_like_logits(batch["labels"], mesh)
    extra = cpshard.shard_like_logits(torch.arange(2 * 7 * 3.0).view(2, 7, 3), mesh)
    try:
        cpshard.shard_like_logits(torch.ones(7), mesh)
        message = ""
    except ValueError as error:
        message = str(error)
    return {
        "same local length": labels.to_local().shape[1]
        == logits.to_local().shape[1]
        == extra.to_local().shape[1],
        "whole again": torch.equal(labels.full_tensor(), batch["labels"]),
        "3-d whole again": torch.equal(extra.full_tensor(), torch.arange(2 * 7 * 3.0).view(2, 7, 3)),
        "message": "per-token tensor [B, L, ...]" in message,
    }


def test_shard_like_logits_lines_up_with_the_logits(ranks2):
    for rank, checks in enumerate(ranks2.run(run_shard_like_logits)):
        assert all(checks.values()), (rank, checks)


@pytest.mark.parametrize("forward", [dict(logits=False), dict(implementation="ring")], ids=str)
def test_token_logprobs_of_a_linear_attention_hybrid_cp2(ranks2, forward):
    for rank, checks in enumerate(ranks2.run(run_token_logprobs, dict(cp=2), forward, "qwen3_next")):
        assert checks["placement"] and checks["ignored are 0"], (rank, checks)
        assert max(checks["values"], checks["loss"], checks["grads"], checks["statistics"]) <= 1e-5, (
            rank,
            checks,
        )
        assert checks["statistics placed"], (rank, checks)
