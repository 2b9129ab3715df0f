"""The next token from logits: greedy, or sampled after transformers' own warpers in ``generate``'s order.

Every rank holds the same logits bit for bit (:mod:`cpshard.attention.decode`), so a generator seeded
alike on every rank draws the same token everywhere, with no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: the arguments of ``cpshard.generate``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if not self.do_sample:
            return
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: sampling needs a temperature above 0")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise ValueError(f"top_k={self.top_k!r}: a positive integer, or None for no top-k filter")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: a probability in (0, 1], or None for no top-p filter")

    def warpers(self) -> list:
        """transformers' warpers for these settings, in the order its ``generate`` applies them."""
        warpers = []
        if self.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k is not None:
            warpers.append(TopKLogitsWarper(top_k=self.top_k))
        if self.top_p is not None and self.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=self.top_p))
        return warpers


def next_tokens(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """``[B]``: the argmax of ``logits`` ``[B, V]``, or a draw from their warped softmax (in fp32, as
    transformers' ``generate`` draws)."""
    scores = logits.float()
    if not sampling.do_sample:
        return scores.argmax(-1)
    for warper in sampling.warpers():
        scores = warper(None, scores)
    return torch.multinomial(scores.softmax(-1), 1, generator=generator).squeeze(1)
