"""Token log-probabilities and their summed cross-entropy in fp32, a few rows at a time, allocating one
buffer of the logits' size.

``F.cross_entropy`` keeps the log-probabilities for its backward, which then builds the gradient of
those (mostly zeros) and the gradient of the logits: three fresh buffers of the logits' size (five
for half-precision logits: their fp32 copy, and the gradient cast back). At long sequences they are
most of a step's peak memory; at short ones the first touch of each (its page faults) costs more time
than the arithmetic on it. Here the forward takes the log-softmax of a block of rows at a time, in a
cache-sized scratch, and, for fp32 logits that want a gradient, writes the softmax (the exponential of
that same log-softmax, as torch's backward takes it) into the one gradient buffer while the block is in
cache; the backward turns it into ``(softmax - one_hot)`` times the upstream gradient in place, rounded
as torch's backward rounds it (a second pass over the logits for the softmax would cost a quarter of the
loss's time). Half-precision logits are
kept instead and their gradient is computed in the backward, in fp32, and rounded once.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from cpshard.spec.sequence import row_blocks

#: the label transformers ignores in the loss
IGNORE_INDEX = -100

#: fp32 values per block of rows: 2^19 (2 MiB), which stays in cache between the passes over it
BLOCK_ELEMENTS = 1 << 19


def _gradient(probs: torch.Tensor, target: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(softmax - one_hot) * scale`` of a block, in place in ``probs`` (the softmax): ``scale`` times each
    probability, less ``scale`` at the target, rounded as torch's log-softmax backward rounds it."""
    return probs.mul_(scale).scatter_add_(-1, target, -scale)


def _scale(valid: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Each row's factor of ``softmax - one_hot``: d log p(target) / d logits = one_hot - softmax."""
    return (valid * -grad).unsqueeze(-1).float()


def targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, valid)``: each row's label as an index ``[..., 1]`` (0 where ignored), and whether it
    counts."""
    valid = labels != IGNORE_INDEX
    return torch.where(valid, labels, 0).unsqueeze(-1), valid


def log_probs_gradient(
    logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, grad: torch.Tensor
) -> torch.Tensor:
    """The gradient of a block's token log-probabilities (``grad`` the upstream one per row) with respect
    to its logits, in fp32: their softmax computed again (the exponential of the log-softmax, as torch's
    backward takes it), then ``(one_hot - softmax) * grad`` where the row counts."""
    return _gradient(torch.log_softmax(logits.float(), dim=-1).exp_(), target, _scale(valid, grad))


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, block_elements: int) -> torch.Tensor:
        target, valid = targets(labels)
        picked = torch.empty(target.shape, dtype=torch.float32, device=logits.device)  # log p(target) per row
        # fp32 logits: their softmax kept now (the exponential of the log-softmax, as torch's backward takes
        # it); other dtypes keep the logits and round their gradient once, in the backward
        early = ctx.needs_input_grad[0] and logits.dtype == torch.float32
        probs = torch.empty_like(logits) if early else None  # the one buffer of the logits' size
        blocks = row_blocks(logits.shape[0], logits.shape[1], block_elements)
        for rows in blocks:
            log_probs = torch.log_softmax(logits[rows].float(), dim=-1)
            picked[rows] = torch.gather(log_probs, -1, target[rows])
            if early:
                probs[rows] = log_probs.exp_()
        ctx.save_for_backward(probs if early else logits, target, valid)
        ctx.early, ctx.blocks, ctx.spent = early, blocks, False
        return torch.where(valid, picked.squeeze(-1), 0.0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        if ctx.spent and ctx.early:
            raise RuntimeError(
                "cpshard's cross-entropy takes one backward: its logits' gradient is written over their "
                "softmax; run the forward again for another backward instead of retain_graph=True"
            )
        ctx.spent = True
        saved, target, valid = ctx.saved_tensors
        if ctx.early:
            return _gradient(saved, target, _scale(valid, grad)), None, None
        out = torch.empty_like(saved)  # the one buffer of the logits' size
        for rows in ctx.blocks:
            out[rows] = log_probs_gradient(saved[rows], target[rows], valid[rows], grad[rows])
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
