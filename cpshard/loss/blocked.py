"""The LM head and cross-entropy, a block of tokens at a time.

Without the logits (``logits=False``), each block's logits are computed, consumed and dropped, so a
rank never holds its whole ``[L/cp, vocab]`` logits. Each block's gradients are computed in the forward,
right after its loss, while its logits exist (as Liger's fused linear cross-entropy does): the backward only
scales them, so no block's logits are computed twice, as recomputing under checkpointing would.
Per-token log-probabilities, whose gradient is a vector known only in the backward, are
checkpointed block by block instead. The head is the model's own weights, with the model's own
logit transforms (Gemma's final softcap, Granite's scaling) read from its config.

With the logits, the caller holds them whole anyway; what the loss would keep beside them is their
softmax, or their gradient, the head's backward's input (:mod:`cpshard.loss.cross_entropy` keeps one
buffer of their size). :func:`logits_and_token_log_probs` keeps none: its backward computes each block's
softmax again from the logits and runs the head's backward on that block, so a gradient of the whole
logits never exists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from cpshard.loss.cross_entropy import cross_entropy_sum, log_probs_gradient, targets, token_log_probs
from cpshard.loss.statistics import token_statistics
from cpshard.precision import autocast_inputs, own_precision
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
    @own_precision
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
    @once_differentiable
    @own_precision
    def backward(ctx, grad):
        grads = [None if g is None else g * grad.to(g.dtype) for g in ctx.grads]
        ctx.grads = None
        return *grads, None, None, None


def blocked_loss_sum(
    hidden, labels, weight, bias, transform, block_elements: int | None = None
) -> torch.Tensor:
    """Summed cross-entropy of ``hidden`` ``[B, S, D]`` against ``labels`` ``[B, S]``, block by block;
    ``transform`` is what the LM head does to its logits after the projection. Under autocast the head's
    inputs are cast as its projection would cast them (:mod:`cpshard.precision`)."""
    parts = _blocks(hidden, weight, block_elements)
    return _BlockedHeadLoss.apply(*autocast_inputs(hidden, weight, bias), labels, transform, parts)


def _add_head_grads(grads: list, part: slice, logit_grad, hidden, weight) -> None:
    """The head's backward on one block of tokens, from the gradient of its logits before the transforms:
    the hidden states' at the block's tokens, the weight's and the bias's added over the blocks."""
    if grads[0] is not None:
        into = grads[0][:, part]
        if into.is_contiguous():  # one sequence: the block's rows are written in place
            torch.matmul(logit_grad, weight, out=into)
        else:
            into.copy_(logit_grad @ weight)
    rows = logit_grad.flatten(0, -2)
    if grads[1] is not None:
        grads[1].addmm_(rows.T, hidden[:, part].flatten(0, -2))
    if grads[2] is not None:
        grads[2] += rows.sum(0)


class _HeadLogProbs(torch.autograd.Function):
    @staticmethod
    @own_precision
    def forward(ctx, hidden, weight, bias, labels, transform, parts: list[slice]):
        ctx.set_materialize_grads(False)
        projected = F.linear(hidden, weight, bias)
        logits = transform(projected)
        picked = token_log_probs(logits, labels)  # no gradient here: nothing of the logits' size is kept
        ctx.save_for_backward(hidden, weight, bias, logits, labels)
        ctx.transform, ctx.parts, ctx.transformed = transform, parts, logits is not projected
        return logits, picked

    @staticmethod
    @once_differentiable
    @own_precision
    def backward(ctx, grad_logits, grad_picked):
        hidden, weight, bias, logits, labels = ctx.saved_tensors
        target, valid = targets(labels)
        grads = [
            None if not need or x is None else torch.empty_like(x) if x is hidden else torch.zeros_like(x)
            for x, need in zip((hidden, weight, bias), ctx.needs_input_grad)
        ]  # every token is in a block: the hidden states' gradient is written whole
        for part in ctx.parts:
            block = None
            if grad_picked is not None:  # the log-probabilities' gradient, rounded to the logits' dtype once
                block = log_probs_gradient(
                    logits[:, part], target[:, part], valid[:, part], grad_picked[:, part]
                )
                block = block.to(logits.dtype)
            if grad_logits is not None:
                block = grad_logits[:, part] if block is None else block.add_(grad_logits[:, part])
            if ctx.transformed:  # through the transforms, on the block's projection computed again
                with torch.enable_grad():
                    leaf = F.linear(hidden[:, part], weight, bias).requires_grad_(True)
                    block = torch.autograd.grad(ctx.transform(leaf), leaf, block)[0]
            _add_head_grads(grads, part, block, hidden, weight)
        return *grads, None, None, None


def logits_and_token_log_probs(
    hidden, labels, weight, bias, transform, block_elements: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, log p(label) per token)`` of ``hidden`` ``[B, S, D]`` against ``labels`` ``[B, S]`` (0
    where ignored): the logits whole, as the model's head gives them, and autograd keeps nothing of their
    size beside them (the backward runs a block of tokens at a time, as :func:`blocked_loss_sum` does,
    and computes each block's softmax again: one more log-softmax over the logits)."""
    parts = _blocks(hidden, weight, block_elements)
    return _HeadLogProbs.apply(*autocast_inputs(hidden, weight, bias), labels, transform, parts)


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
