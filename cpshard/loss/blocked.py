"""The loss without the logits: the LM head and cross-entropy, a block of tokens at a time.

Each block's logits are computed, consumed and dropped, so a rank never holds its whole
``[L/cp, vocab]`` logits. Each block's gradients are computed in the forward, right after its
loss, while its logits exist (as Liger's fused linear cross-entropy does): the backward only
scales them, so no block's logits are computed twice, as recomputing under checkpointing would.
Per-token log-probabilities, whose gradient is a vector known only in the backward, are
checkpointed block by block instead. The head is the model's own weights, with the model's own
logit transforms (Gemma's final softcap, Granite's scaling) read from its config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cpshard.loss.cross_entropy import cross_entropy_sum, token_log_probs
from cpshard.loss.statistics import token_statistics
from cpshard.spec.sequence import row_blocks

#: logits per block: 2^24 fp32 values (64 MiB) at most, whatever the vocabulary
BLOCK_ELEMENTS = 1 << 24


def _blocks(hidden, weight, block_elements: int | None) -> list[slice]:
    """The token blocks: by default each block's logits are no bigger than the head's weight (a block of
    as many tokens as the hidden size, so its matmul outweighs adding its share to the weight's gradient)
    nor than :data:`BLOCK_ELEMENTS`, so that the loss holds less than the layers do per token."""
    budget = min(BLOCK_ELEMENTS, weight.numel()) if block_elements is None else block_elements
    return row_blocks(hidden.shape[1], hidden.shape[0] * weight.shape[0], budget)


def _block_loss(hidden, labels, weight, bias, transform):
    return cross_entropy_sum(transform(F.linear(hidden, weight, bias)), labels)


class _BlockedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, transform, parts: list[slice]):
        wanted = [need and x is not None for x, need in zip((hidden, weight, bias), ctx.needs_input_grad)]
        grads = [torch.zeros_like(x) if want else None for x, want in zip((hidden, weight, bias), wanted)]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for part in parts:
            with torch.enable_grad():
                leaves = [
                    None if x is None else x.detach().requires_grad_(want)
                    for x, want in zip((hidden[:, part], weight, bias), wanted)
                ]
                loss = _block_loss(leaves[0], labels[:, part], leaves[1], leaves[2], transform)
                if any(wanted):
                    block_grads = iter(
                        torch.autograd.grad(loss, [x for x, want in zip(leaves, wanted) if want])
                    )
                    if wanted[0]:
                        grads[0][:, part] = next(block_grads)
                    for i in (1, 2):
                        if wanted[i]:
                            grads[i] += next(block_grads)
            total += loss.detach()
        ctx.grads = grads
        return total

    @staticmethod
    def backward(ctx, grad):
        grads = [None if g is None else g * grad.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return *grads, None, None, None


def blocked_loss_sum(
    hidden, labels, weight, bias, transform, block_elements: int | None = None
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden`` ``[B, S, D]`` against ``labels`` ``[B, S]``, block by block;
    ``transform`` is what the LM head does to its logits after the projection."""
    parts = _blocks(hidden, weight, block_elements)
    return _BlockedHeadLoss.apply(hidden, weight, bias, labels, transform, parts)


def _block_log_probs(hidden, weight, bias, labels, transform):
    return token_log_probs(transform(F.linear(hidden, weight, bias)), labels)


def blocked_token_log_probs(
    hidden, labels, weight, bias, transform, block_elements: int | None = None
) -> torch.Tensor:
    """The log-probability of each of ``labels`` ``[B, S]`` (0 where ignored) from ``hidden`` ``[B, S, D]``,
    block by block. Their gradient is known only in the backward, so each block's logits are computed
    again there (checkpointed), one block at a time: the head's matmul twice, never the whole logits."""
    parts = _blocks(hidden, weight, block_elements)
    blocks = [
        checkpoint(
            _block_log_probs, hidden[:, part], weight, bias, labels[:, part], transform, use_reentrant=False
        )
        for part in parts
    ]
    return torch.cat(blocks, dim=1)


@torch.no_grad()
def blocked_token_statistics(
    hidden, labels, weight, bias, transform, names: tuple[str, ...], block_elements: int | None = None
) -> dict[str, torch.Tensor]:
    """:func:`~cpshard.loss.statistics.token_statistics` from ``hidden`` ``[B, S, D]``, block by block: one
    more pass of the head's matmul, without gradient, never the whole logits."""
    blocks = [
        token_statistics(transform(F.linear(hidden[:, part], weight, bias)), labels[:, part], names)
        for part in _blocks(hidden, weight, block_elements)
    ]
    return {name: torch.cat([block[name] for block in blocks], dim=1) for name in names}
