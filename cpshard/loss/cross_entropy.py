"""Token log-probabilities and their summed cross-entropy in fp32, a few rows at a time, allocating one
buffer of the logits' size.

``F.cross_entropy`` keeps the log-probabilities for its backward, which then builds the gradient of
those (mostly zeros) and the gradient of the logits: three fresh buffers of the logits' size (five
for half-precision logits: their fp32 copy, and the gradient cast back). At long sequences they are
most of a step's peak memory; at short ones the first touch of each (its page faults) costs more time
than the arithmetic on it. Here
the forward takes the log-softmax of a block of rows at a time, in a cache-sized scratch, and keeps
only the logits; the backward writes ``softmax - one_hot``, scaled, into the one gradient buffer,
block by block, with torch's own softmax kernel (so it equals ``F.cross_entropy``'s gradient to an
ulp or so).
"""

from __future__ import annotations

import torch

from cpshard.spec.sequence import row_blocks

#: the label transformers ignores in the loss
IGNORE_INDEX = -100

#: fp32 values per block of rows: 2^19 (2 MiB), which stays in cache between the passes over it
BLOCK_ELEMENTS = 1 << 19


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, block_elements: int) -> torch.Tensor:
        valid = labels != IGNORE_INDEX
        target = torch.where(valid, labels, 0).unsqueeze(-1)
        picked = torch.empty(target.shape, dtype=torch.float32, device=logits.device)  # log p(target) per row
        blocks = row_blocks(logits.shape[0], logits.shape[1], block_elements)
        for rows in blocks:
            log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
            picked[rows] = torch.gather(log_probs, -1, target[rows])
        ctx.save_for_backward(logits, target, valid)
        ctx.blocks = blocks
        return torch.where(valid, picked.squeeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, target, valid = ctx.saved_tensors
        out = torch.empty_like(logits)  # the one buffer of the logits' size
        scale = (valid * -grad).unsqueeze(-1).float()  # d log p(target) / d logits = one_hot - softmax
        minus_one = torch.full(target.shape, -1.0, device=logits.device)
        for rows in ctx.blocks:
            probs = torch.softmax(logits[rows].float(), dim=-1)
            out[rows] = probs.scatter_add_(-1, target[rows], minus_one[rows]).mul_(scale[rows])
        return out, None, None


def token_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """``log_softmax(logits.float())`` at each label, 0 where it is ignored: ``labels``' shape, from
    ``[..., V]`` logits; the gradient comes back in the logits' dtype (``block_elements``: for tests)."""
    flat = _TokenLogProbs.apply(logits.flatten(0, -2), labels.flatten(), block_elements)
    return flat.view(labels.shape)


def cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")`` over ``[..., V]``
    logits: the negated sum of :func:`token_log_probs`."""
    return -token_log_probs(logits, labels, block_elements).sum()
