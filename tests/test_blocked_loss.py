"""The loss a block of tokens at a time: equal to the whole-logits loss, value and gradients, for each
logit transform."""

import weakref
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cpshard.layouts.layout import HEAD_TRANSFORMS
from cpshard.loss.blocked import blocked_loss_sum, blocked_token_log_probs, logits_and_token_log_probs
from cpshard.loss.cross_entropy import cross_entropy_sum
from cpshard.loss.head import transform_logits


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "config",
    [SimpleNamespace(), SimpleNamespace(final_logit_softcapping=3.0), SimpleNamespace(logits_scaling=4.0)],
)
def test_blocks_give_the_whole_loss_and_gradients(config, with_bias):
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
    blocked = blocked_loss_sum(
        hidden, labels, weight, bias, transform, block_elements=2 * 50 * 3
    )  # 3 tokens a block
    got = torch.autograd.grad(0.3 * blocked, leaves)
    torch.testing.assert_close(blocked, whole)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    with torch.no_grad():  # the loss alone: no gradients computed on the way
        torch.testing.assert_close(
            blocked_loss_sum(hidden, labels, weight, bias, transform, block_elements=300), whole
        )


class _LargestBuffer(TorchDispatchMode):
    """The most elements of any tensor the ops inside the block create."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize(
    "config", [SimpleNamespace(), SimpleNamespace(final_logit_softcapping=3.0)], ids=["plain", "softcap"]
)
def test_token_log_probs_block_by_block_with_exact_gradients(config):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 13, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (2, 13), generator=generator)
    labels[:, ::4] = -100
    upstream = torch.randn(2, 13, generator=generator)  # any function of them: a per-token gradient
    transform = partial(transform_logits, config=config, transforms=HEAD_TRANSFORMS)
    logits = transform(F.linear(hidden, weight))
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    whole = torch.where(labels != -100, picked, 0.0)
    want = torch.autograd.grad((whole * upstream).sum(), (hidden, weight))
    with _LargestBuffer() as largest:  # 3 tokens a block: never the whole [2, 13, 50] logits
        blocked = blocked_token_log_probs(hidden, labels, weight, None, transform, block_elements=2 * 50 * 3)
        got = torch.autograd.grad((blocked * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(blocked, whole)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert largest.largest <= max(2 * 50 * 3, weight.numel()) < logits.numel(), largest.largest


def test_default_blocks_hold_no_more_logits_than_the_head_weight():
    """By default a block holds as many tokens as the hidden size (here 8 of 40), exactly."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 40, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (1, 40), generator=generator)
    transform = partial(transform_logits, config=SimpleNamespace(), transforms=HEAD_TRANSFORMS)
    whole = F.cross_entropy(F.linear(hidden, weight).flatten(0, 1), labels.flatten(), reduction="sum")
    with _LargestBuffer() as largest:
        blocked = blocked_loss_sum(hidden, labels, weight, None, transform)
        got = torch.autograd.grad(blocked, [hidden, weight])
    torch.testing.assert_close(blocked, whole)
    for g, w in zip(got, torch.autograd.grad(whole, [hidden, weight])):
        torch.testing.assert_close(g, w)
    assert largest.largest == weight.numel()  # [8 tokens, 50] logits, never [40, 50]


class _AliveOfSize(TorchDispatchMode):
    """Weak references to the storages of at least ``numel`` elements the ops inside the block create."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.made.append(weakref.ref(t.untyped_storage()))
        return out

    def alive(self) -> int:
        return len({ref().data_ptr() for ref in self.made if ref() is not None})


#: objectives of (the summed log-probabilities, per-token log-probabilities, logits)
OBJECTIVES = {
    "loss": lambda picked, logits: -0.3 * picked.sum(),
    "per token": lambda picked, logits: (picked * torch.linspace(-1, 2, picked.shape[1])).sum(),
    "logits": lambda picked, logits: (logits**2).sum() * 1e-2,
    "loss and logits": lambda picked, logits: -picked.sum() + logits[:, -1].logsumexp(-1).sum(),
}


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize(
    "config", [SimpleNamespace(), SimpleNamespace(final_logit_softcapping=3.0)], ids=["plain", "softcap"]
)
def test_logits_and_log_probs_give_the_head_and_every_gradient(config, batch, objective):
    """``logits_and_token_log_probs`` (the loss beside ``logits=True``): the head's logits and the label's
    log-probabilities, and the gradients of any objective of them, through a bias, with rows of several
    sequences (a block is then not contiguous); a second backward (``retain_graph``) gives them again."""
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(batch, 13, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    bias = torch.randn(50, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (batch, 13), generator=generator)
    labels[:, ::4] = -100
    transform = partial(transform_logits, config=config, transforms=HEAD_TRANSFORMS)
    logits = transform(F.linear(hidden, weight, bias))
    picked = logits.log_softmax(-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(labels != -100, picked, 0.0)
    want = torch.autograd.grad(OBJECTIVES[objective](picked, logits), (hidden, weight, bias))
    got_logits, got_picked = logits_and_token_log_probs(hidden, labels, weight, bias, transform, 150)
    torch.testing.assert_close(got_logits, logits)
    torch.testing.assert_close(got_picked, picked)
    value = OBJECTIVES[objective](got_picked, got_logits)
    for _ in range(2):
        got = torch.autograd.grad(value, (hidden, weight, bias), retain_graph=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)


def test_logits_and_log_probs_keep_nothing_of_the_logits_size_but_the_logits():
    """After the forward, of the tensors of the logits' size only the logits live: no softmax and no
    gradient of the logits wait for the backward, where the head and cross-entropy keep one of them."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(1, 64, 8, generator=generator, requires_grad=True)
    weight = torch.randn(50, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (1, 64), generator=generator)
    transform = partial(transform_logits, config=SimpleNamespace(), transforms=HEAD_TRANSFORMS)
    with _AliveOfSize(64 * 50) as made:
        logits, picked = logits_and_token_log_probs(hidden, labels, weight, None, transform)
    assert made.alive() == 1 and logits.numel() == 64 * 50 and picked.grad_fn is not None
    with _AliveOfSize(64 * 50) as made:  # the head and cross-entropy as they were, the logits held
        whole_logits = F.linear(hidden, weight)
        whole = cross_entropy_sum(whole_logits, labels)
    assert made.alive() == 2 and whole.grad_fn is not None  # the logits and their softmax
