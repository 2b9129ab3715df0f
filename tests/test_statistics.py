"""The per-token statistics of the next-token distribution (cpshard.loss.statistics) against their
definitions, a block of rows at a time and a block of tokens at a time through the head."""

import pytest
import torch

from cpshard.loss.blocked import blocked_token_statistics
from cpshard.loss.statistics import STATISTICS, check_statistics, token_statistics


def reference_statistics(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """Each statistic from its definition on the whole logits, 0 (False) where the label is ignored."""
    log_p = logits.float().log_softmax(-1)
    valid = labels != -100
    values = {
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "top1": logits.argmax(-1) == labels,
        "mean_logit": logits.float().mean(-1),
        "log_sum_sq_probs": (log_p.exp() ** 2).sum(-1).log(),
    }
    return {name: torch.where(valid, value, False) for name, value in values.items()}


def _case(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 9, 17, generator=generator) * 3
    labels = torch.randint(0, 17, (2, 9), generator=generator)
    labels[0, :3] = -100
    labels[1, 4] = logits[1, 4].argmax()  # at least one top-1 hit
    logits[1, 5, :2] = logits[1, 5].max() + 1  # a tie for the maximum: the first index is the argmax
    labels[1, 5] = 1
    return logits, labels


@pytest.mark.parametrize("block_elements", [17, 3 * 17, 1 << 19], ids=["row", "three rows", "all"])
def test_statistics_are_their_definitions_block_by_block(block_elements):
    logits, labels = _case()
    got = token_statistics(logits, labels, tuple(STATISTICS), block_elements)
    expected = reference_statistics(logits, labels)
    assert got["top1"].dtype == torch.bool and torch.equal(got["top1"], expected["top1"])
    assert bool(got["top1"][1, 4]) and not bool(got["top1"][1, 5])  # tie: index 0 comes first
    for name in ("entropy", "mean_logit", "log_sum_sq_probs"):
        assert torch.allclose(got[name], expected[name], atol=1e-5), name
        assert bool((got[name][0, :3] == 0).all()), name


def test_through_the_head_a_block_of_tokens_at_a_time_is_the_same():
    generator = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 9, 8, generator=generator), torch.randn(17, 8, generator=generator)
    labels = _case()[1]
    scale = 0.5  # a logit transform, as a head's softcap or scaling
    logits = torch.nn.functional.linear(hidden, weight) * scale
    blocked = blocked_token_statistics(
        hidden, labels, weight, None, lambda x: x * scale, ("entropy", "top1"), 2 * 17
    )
    whole = token_statistics(logits, labels, ("entropy", "top1"))
    assert torch.equal(blocked["top1"], whole["top1"])
    assert torch.allclose(blocked["entropy"], whole["entropy"], atol=1e-6)


def test_unknown_statistics_are_named():
    assert check_statistics("entropy") == ("entropy",)
    with pytest.raises(ValueError, match=r"unknown \['accuracy'\]; choose from entropy, top1"):
        check_statistics(("entropy", "accuracy"))
