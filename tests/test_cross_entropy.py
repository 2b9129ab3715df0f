"""The fused cross-entropy against torch's: loss and logit gradients, ignored labels, bf16 logits."""

import pytest
import torch
import torch.nn.functional as F

from cpshard.batch import IGNORE_INDEX
from cpshard.cross_entropy import cross_entropy_sum


def _both(logits: torch.Tensor, labels: torch.Tensor, scale: float = 1.0):
    results = []
    for loss_fn in (
        cross_entropy_sum,
        lambda x, y: F.cross_entropy(x.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"),
    ):
        leaf = logits.detach().clone().requires_grad_(True)
        loss = loss_fn(leaf, labels)
        (loss * scale).backward()
        results.append((loss.detach(), leaf.grad))
    return results


@pytest.mark.parametrize("ignored", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(ignored, dtype):
    generator = torch.Generator().manual_seed(int(ignored * 10))
    logits = (4 * torch.randn(3, 17, 50, generator=generator)).to(dtype)
    labels = torch.randint(0, 50, (3, 17), generator=generator)
    labels[torch.rand(3, 17, generator=generator) < ignored] = IGNORE_INDEX
    (ours, our_grad), (theirs, their_grad) = _both(logits, labels, scale=0.7)
    assert our_grad.dtype == dtype
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-5), (ours, theirs)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16 either way
    assert (our_grad.float() - their_grad.float()).abs().max() <= tolerance
    if ignored == 1.0:
        assert ours == 0 and not our_grad.any()
