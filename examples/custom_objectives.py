"""Custom objectives under cp from per-token log-probabilities: a weighted-token loss, DPO over
chosen/rejected pairs and a GRPO-style clipped policy loss, trained with plain ``backward()``.

    torchrun --nproc_per_node 2 examples/custom_objectives.py
    python examples/custom_objectives.py --nprocs 2

``make_cp_forward(model, token_logprobs=True)`` gives ``out.token_logprobs``: a ``[B, L]`` DTensor
sharded on the sequence like the logits, the log-probability of each next-token label (0 where the
label is ignored). ``cpshard.shard_like_logits`` places weights, masks or advantages alike, so each
objective is a few DTensor operations; ``backward()`` then leaves one process's gradients in
``param.grad``. The same functions take plain tensors: that is how they are checked against one process.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import cpshard
from cpshard import tiny_model


def total(x: torch.Tensor) -> torch.Tensor:
    """The sum of every element, as a plain tensor (the same on every rank for a DTensor)."""
    return x.sum().full_tensor() if isinstance(x, DTensor) else x.sum()


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum over the sequence, ``[B]``, as a plain tensor."""
    return x.sum(dim=1).full_tensor() if isinstance(x, DTensor) else x.sum(dim=1)


def weighted_token_loss(token_logprobs, weights):
    """Negative log-likelihood with a weight per token (0 drops a token), over the total weight."""
    return -total(token_logprobs * weights) / total(weights)


def dpo_loss(policy_logprobs, reference_logprobs, beta: float = 0.1):
    """DPO: rows ``[0, n)`` are the chosen answers, rows ``[n, 2n)`` the rejected ones of the same prompts."""
    policy, reference = row_sums(policy_logprobs), row_sums(reference_logprobs)
    n = policy.shape[0] // 2
    margin = (policy[:n] - reference[:n]) - (policy[n:] - reference[n:])
    return -F.logsigmoid(beta * margin).mean()


def grpo_loss(token_logprobs, old_logprobs, advantages, mask, clip: float = 0.2):
    """The clipped policy-gradient loss of PPO/GRPO: per-token ratios to the sampling policy, each row's
    advantage (placed per token), averaged over the tokens of ``mask``."""
    ratio = (token_logprobs - old_logprobs).exp()
    gain = torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    return -total(gain * mask) / total(mask)


def label_mask(labels: torch.Tensor) -> torch.Tensor:
    """1.0 where a position has a next-token label (the positions ``token_logprobs`` scores), else 0.0."""
    return F.pad(labels[:, 1:] != -100, (0, 1)).float()


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO's advantages: each reward against the mean and spread of its group of samples."""
    grouped = rewards.view(-1, group)
    return ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)


def train(steps: int, seq: int) -> dict:
    mesh = cpshard.make_mesh(cp=int(os.environ["WORLD_SIZE"]))
    model = tiny_model("llama", num_hidden_layers=2)
    cp_forward = cpshard.make_cp_forward(model, logits=False, token_logprobs=True)
    params = cpshard.params_of(model)
    reference = {name: p.detach().clone() for name, p in params.items()}  # DPO's frozen reference
    optimizer = torch.optim.AdamW(params.values(), lr=1e-3)
    ids = torch.randint(3, model.config.vocab_size, (4, seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}  # the same on every rank of the cp group
    mask = label_mask(ids)
    weights = cpshard.shard_like_logits(mask * torch.linspace(0.5, 1.5, seq), mesh)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2])  # one per sampled answer, two groups of two
    advantages = cpshard.shard_like_logits(group_advantages(rewards, 2)[:, None].expand(-1, seq), mesh)
    placed_mask = cpshard.shard_like_logits(mask, mesh)
    losses = {}
    for step in range(steps):
        out = cp_forward(params, batch, mesh)
        with torch.no_grad():
            ref_logprobs = cp_forward(reference, batch, mesh).token_logprobs
        old = out.token_logprobs.detach()  # the sampling policy: this step's own, before the update
        losses = {
            "weighted": weighted_token_loss(out.token_logprobs, weights),
            "dpo": dpo_loss(out.token_logprobs, ref_logprobs),
            "grpo": grpo_loss(out.token_logprobs, old, advantages, placed_mask),
        }
        optimizer.zero_grad()
        sum(losses.values()).backward()  # gradients summed over the cp ranks: one process's
        optimizer.step()
        # every rank computes the report (its sums gather over the cp ranks); rank 0 prints it
        report = progress(out.token_logprobs.detach(), ref_logprobs, advantages * placed_mask, losses)
        if torch.distributed.get_rank() == 0:
            print(f"step {step}: {report}", flush=True)
    return {name: value.item() for name, value in losses.items()}


def progress(token_logprobs, ref_logprobs, advantages, losses: dict) -> str:
    """What shows each objective at work: the weighted loss falls; DPO's margin (chosen over rejected,
    against the reference, in nats) grows, so its loss goes to 0 fast on one random pair; GRPO's loss is 0
    on-policy by construction (ratio 1) while the advantage-weighted log-probability it pushes rises
    (``advantages``: per token, zero where no label, summed per row)."""
    policy, reference = row_sums(token_logprobs), row_sums(ref_logprobs)
    n = policy.shape[0] // 2
    margin = ((policy[:n] - reference[:n]) - (policy[n:] - reference[n:])).mean()
    weighted = total(token_logprobs * advantages) / token_logprobs.shape[0]
    return (
        f"weighted loss {losses['weighted'].item():.4f}; dpo loss {losses['dpo'].item():.4f} (margin "
        f"{margin.item():.2f} nats); grpo loss {losses['grpo'].item():+.4f} (0 on-policy; advantage-weighted "
        f"log-prob per row {weighted.item():.4f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, default=2, help="local ranks to start (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=256)
    args = parser.parse_args()
    if "RANK" in os.environ:
        train(args.steps, args.seq)
        torch.distributed.destroy_process_group()
    else:
        cpshard.launch(train, args.steps, args.seq, nprocs=args.nprocs)


if __name__ == "__main__":
    main()
