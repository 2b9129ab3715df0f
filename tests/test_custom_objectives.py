"""examples/custom_objectives.py: each objective under cp=2 (DTensors, backward()) against the same function
on one process's plain tensors, loss and every gradient; and its training loop runs."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model

PATH = Path(__file__).parents[1] / "examples" / "custom_objectives.py"
VOCAB = 130


def _example():
    spec = importlib.util.spec_from_file_location("custom_objectives", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _token_logprobs(model, params: dict, batch: dict) -> torch.Tensor:
    """One process: log p(next label) per position, 0 where ignored."""
    logits = torch.func.functional_call(model, params, (), {**batch, "use_cache": False}).logits
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    picked = logits.log_softmax(-1).gather(-1, shifted.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(shifted != -100, picked, 0.0)


def _objective(example, name: str, logprobs, reference, place, batch):
    """The example's objective ``name`` on token log-probabilities; ``place`` puts per-token tensors alike."""
    mask = example.label_mask(batch["labels"])
    if name == "weighted":
        return example.weighted_token_loss(logprobs, place(mask * torch.linspace(0.2, 2.0, mask.shape[1])))
    if name == "dpo":
        return example.dpo_loss(logprobs, reference, beta=0.5)
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9))  # ratios far from 1: clipped
    old = reference.detach() + place(0.3 * noise)
    rewards = torch.tensor([1.0, 0.0, 0.3, 0.9])
    advantages = example.group_advantages(rewards, 2)[:, None].expand(-1, mask.shape[1])
    return example.grpo_loss(logprobs, old, place(advantages.contiguous()), place(mask))


def run_objective(name: str, forward: dict):
    example = _example()
    mesh = cpshard.make_mesh(cp=2)
    model, twin = tiny_model("llama", vocab_size=VOCAB), tiny_model("llama", vocab_size=VOCAB)
    batch = tiny_batch(VOCAB, 4, 13, pad="right", seed=3)
    cp_forward = cpshard.make_cp_forward(model, token_logprobs=True, **forward)
    params = cpshard.params_of(model)
    other = tiny_model(
        "llama", seed=1, vocab_size=VOCAB
    )  # DPO's reference: other weights, the same on every rank
    frozen = {n: p.detach() for n, p in cpshard.params_of(other).items()}
    with torch.no_grad():
        reference = cp_forward(frozen, batch, mesh).token_logprobs
    loss = _objective(
        example,
        name,
        cp_forward(params, batch, mesh).token_logprobs,
        reference,
        lambda t: cpshard.shard_like_logits(t, mesh),
        batch,
    )
    loss.backward()

    leaves = {n: p.detach().requires_grad_(True) for n, p in cpshard.params_of(twin).items()}
    with torch.no_grad():
        ref_reference = _token_logprobs(twin, frozen, batch)
    ref_loss = _objective(
        example, name, _token_logprobs(twin, leaves, batch), ref_reference, lambda t: t, batch
    )
    ref_grads = dict(zip(leaves, torch.autograd.grad(ref_loss, list(leaves.values()))))
    scale = max(g.abs().max().item() for g in ref_grads.values())
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grads": max((p.grad - ref_grads[n]).abs().max().item() for n, p in params.items()) / scale,
    }


@pytest.mark.parametrize("forward", [dict(), dict(logits=False, implementation="ring")], ids=str)
@pytest.mark.parametrize("name", ["weighted", "dpo", "grpo"])
def test_objective_is_one_process(ranks2, name, forward):
    for rank, checks in enumerate(ranks2.run(run_objective, name, forward)):
        assert max(checks.values()) <= 1e-5, (rank, checks)


def run_training():
    return _example().train(steps=2, seq=24)


def test_the_training_loop_runs(ranks2):
    first, second = ranks2.run(run_training)
    assert first == second and all(torch.isfinite(torch.tensor(v)) for v in first.values()), first
