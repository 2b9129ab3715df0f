"""The chunked loss: equal to the whole-logits loss, value and gradients, for each logit transform."""

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from cpshard.layouts.layout import HEAD_TRANSFORMS
from cpshard.loss.head import transform_logits
from cpshard.loss.tiled import tiled_loss_sum


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "config",
    [SimpleNamespace(), SimpleNamespace(final_logit_softcapping=3.0), SimpleNamespace(logits_scaling=4.0)],
)
def test_chunks_give_the_whole_loss_and_gradients(config, with_bias):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 13, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True) if with_bias else None
    leaves = [x for x in (hidden, weight, bias) if x is not None]
    labels = torch.randint(0, 50, (2, 13), generator=generator)
    labels[:, ::4] = -100
    transform = partial(transform_logits, config=config, transforms=HEAD_TRANSFORMS)
    logits = transform(F.linear(hidden, weight, bias))
    whole = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    want = torch.autograd.grad(0.3 * whole, leaves)
    chunked = tiled_loss_sum(
        hidden, labels, weight, bias, transform, chunk_elements=2 * 50 * 3
    )  # 3 tokens a chunk
    got = torch.autograd.grad(0.3 * chunked, leaves)
    torch.testing.assert_close(chunked, whole)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with torch.no_grad():  # the loss alone: no gradients computed on the way
        torch.testing.assert_close(
            tiled_loss_sum(hidden, labels, weight, bias, transform, chunk_elements=300), whole
        )
