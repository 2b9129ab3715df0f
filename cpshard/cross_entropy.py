"""Summed token cross-entropy in fp32 that holds the ``[tokens, vocab]`` logits' size twice, not four times.

``F.cross_entropy`` keeps the log-probabilities for its backward, which then builds the gradient of
those (mostly zeros) and the gradient of the logits: with the logits, four buffers of their size at
the backward's peak, where long sequences spend most of their memory. Here the forward keeps the
logits and one log-sum-exp per token, and the backward writes ``softmax - one_hot`` into one buffer.
"""

from __future__ import annotations

import torch

from cpshard.batch import IGNORE_INDEX


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        target = torch.where(valid, labels, 0).unsqueeze(-1)
        lse = torch.logsumexp(logits, dim=-1)
        losses = lse - logits.gather(-1, target).squeeze(-1)
        ctx.save_for_backward(logits, lse, target, valid)
        return torch.where(valid, losses, 0.0).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, target, valid = ctx.saved_tensors
        probs = (logits - lse.unsqueeze(-1)).exp_()  # the one buffer of the logits' size
        probs.scatter_add_(-1, target, torch.full_like(target, -1, dtype=probs.dtype))
        return probs.mul_((valid * grad).unsqueeze(-1).to(probs.dtype)), None


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")`` over ``[..., V]`` logits."""
    return _CrossEntropySum.apply(logits.float().flatten(0, -2), labels.flatten())
