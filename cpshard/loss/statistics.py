"""Per-token statistics of the next-token distribution, for metrics: fp32, without gradient.

What preference and fine-tuning trainers log beside the loss (TRL's entropy, token accuracy, mean logit
and the WPO weights' ``log sum p^2``), computed from each rank's own logits, a block of rows at a time,
so that no rank holds a second buffer of its logits' size. Each is 0 (False) where the label is ignored.
"""

from __future__ import annotations

import torch

from cpshard.loss.cross_entropy import BLOCK_ELEMENTS, IGNORE_INDEX
from cpshard.spec.sequence import row_blocks


def _entropy(log_probs, logits, target):
    return -(log_probs.exp() * log_probs).sum(-1)


def _top1(log_probs, logits, target):
    return logits.argmax(-1) == target  # the first maximum, as torch.argmax breaks ties


def _mean_logit(log_probs, logits, target):
    return logits.mean(-1)


def _log_sum_sq_probs(log_probs, logits, target):
    return torch.logsumexp(2 * log_probs, dim=-1)


#: each statistic of a row's fp32 ``(log_probs, logits, target)``
STATISTICS = {
    "entropy": _entropy,
    "top1": _top1,
    "mean_logit": _mean_logit,
    "log_sum_sq_probs": _log_sum_sq_probs,
}


def check_statistics(names) -> tuple[str, ...]:
    """``names`` as a tuple, each one of :data:`STATISTICS`."""
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [name for name in names if name not in STATISTICS]
    if unknown:
        raise ValueError(f"token_statistics: unknown {unknown}; choose from {', '.join(STATISTICS)}")
    return names


@torch.no_grad()
def token_statistics(
    logits: torch.Tensor, labels: torch.Tensor, names: tuple[str, ...], block_elements: int = BLOCK_ELEMENTS
) -> dict[str, torch.Tensor]:
    """``{name: labels-shaped tensor}`` from ``[..., V]`` logits; ``top1`` is boolean, the others fp32."""
    flat, flat_labels = logits.flatten(0, -2), labels.flatten()
    valid = flat_labels != IGNORE_INDEX
    target = torch.where(valid, flat_labels, 0)
    dtypes = {name: torch.bool if name == "top1" else torch.float32 for name in names}
    out = {name: torch.zeros(target.shape, dtype=dtype, device=flat.device) for name, dtype in dtypes.items()}
    for rows in row_blocks(flat.shape[0], flat.shape[1], block_elements):
        block = flat[rows].float()
        log_probs = torch.log_softmax(block, dim=-1)
        for name in names:
            out[name][rows] = STATISTICS[name](log_probs, block, target[rows])
    return {name: torch.where(valid, value, False).view(labels.shape) for name, value in out.items()}
