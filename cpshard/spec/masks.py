"""Attention masks as values: a mask of allowed and hidden keys, in the additive form a kernel adds to its
scores. One helper for the three places that need it (Ulysses' sdpa, the ring's blocks, the rewritten
families), which differ only in the value a hidden key gets."""

from __future__ import annotations

import torch


def additive_mask(mask: torch.Tensor, dtype: torch.dtype, hidden: float = float("-inf")) -> torch.Tensor:
    """A boolean mask (True where a key is allowed) as additive floats of ``dtype``: 0 where allowed,
    ``hidden`` elsewhere (sdpa's own conversion takes -inf; transformers' masks take the dtype's minimum).
    A float mask is additive already and comes back as it is."""
    if mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask.logical_not(), hidden)
