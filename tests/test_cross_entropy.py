"""The blocked cross-entropy against torch's: loss and logit gradients, ignored labels, bf16 logits,
blocks that do not divide the rows, and how many buffers of the logits' size a step makes."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cpshard.loss.cross_entropy import IGNORE_INDEX, cross_entropy_sum, token_log_probs

VOCAB = 50


def _torch_loss(logits, labels):
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def _loss_and_grad(loss_fn, logits, labels, scale: float = 1.0):
    leaf = logits.detach().clone().requires_grad_(True)
    loss = loss_fn(leaf, labels)
    (loss * scale).backward()
    return loss.detach(), leaf.grad


def _case(seed: int, ignored: float, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = (4 * torch.randn(3, 17, VOCAB, generator=generator)).to(dtype)
    labels = torch.randint(0, VOCAB, (3, 17), generator=generator)
    labels[torch.rand(3, 17, generator=generator) < ignored] = IGNORE_INDEX
    return logits, labels


@pytest.mark.parametrize(
    "block_rows", [1, 2, 5, 51, 1000]
)  # 51 rows in all: one block, blocks that do not divide
@pytest.mark.parametrize("ignored", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(block_rows, ignored, dtype):
    logits, labels = _case(int(ignored * 10) + block_rows, ignored, dtype)
    ours, our_grad = _loss_and_grad(
        lambda x, y: cross_entropy_sum(x, y, block_rows * VOCAB), logits, labels, scale=0.7
    )
    theirs, their_grad = _loss_and_grad(_torch_loss, logits, labels, scale=0.7)
    assert our_grad.dtype == dtype
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-5), (ours, theirs)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradient is rounded to bf16 either way
    assert (our_grad.float() - their_grad.float()).abs().max() <= tolerance
    if ignored == 1.0:
        assert ours == 0 and not our_grad.any()


class _LogitsSizedBuffers(TorchDispatchMode):
    """The storages (and one tensor of each) of at least ``nbytes`` bytes, other than ``existing``'s,
    that the ops inside the block create."""

    def __init__(self, nbytes: int, existing: torch.Tensor):
        super().__init__()
        self.nbytes, self.seen, self.made = nbytes, {existing.untyped_storage().data_ptr()}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            storage = t.untyped_storage() if isinstance(t, torch.Tensor) else None
            if (
                storage is not None
                and storage.nbytes() >= self.nbytes
                and storage.data_ptr() not in self.seen
            ):
                self.seen.add(storage.data_ptr())
                self.made.append(
                    (func.overloadpacket.__name__, t)
                )  # kept alive: no later buffer reuses its address
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_buffer_of_the_logits_size(dtype):
    """torch's cross-entropy makes at least three (log-probs, nll's gradient, the logits' gradient; bf16 adds
    the fp32 copy and the casts back); this one makes the gradient only."""
    logits, labels = _case(0, 0.3, dtype)
    counts = []
    for loss_fn in (lambda x, y: cross_entropy_sum(x, y, 4 * VOCAB), _torch_loss):
        leaf = logits.detach().clone().requires_grad_(True)
        with _LogitsSizedBuffers(logits.numel() * logits.element_size(), leaf) as counter:
            loss_fn(leaf, labels).backward()
        counts.append(len(counter.made))
    assert counts[0] == 1 and counts[1] >= 3, counts


@pytest.mark.parametrize("block_rows", [1, 5, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_log_probs_match_torch_with_any_upstream_gradient(block_rows, dtype):
    logits, labels = _case(block_rows, 0.3, dtype)
    weights = torch.randn(labels.shape, generator=torch.Generator().manual_seed(3))

    def theirs_fn(x, y):
        picked = x.float().log_softmax(-1).gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return torch.where(y != IGNORE_INDEX, picked, 0.0)

    results = []
    for fn in (lambda x, y: token_log_probs(x, y, block_rows * VOCAB), theirs_fn):
        leaf = logits.detach().clone().requires_grad_(True)
        values = fn(leaf, labels)
        (values * weights).sum().backward()
        results.append((values.detach(), leaf.grad))
    (ours, our_grad), (theirs, their_grad) = results
    assert ours.shape == labels.shape and not ours[labels == IGNORE_INDEX].any()
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-5)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    assert our_grad.dtype == dtype and (our_grad.float() - their_grad.float()).abs().max() <= tolerance


def test_a_second_backward_through_the_early_gradient_is_refused():
    """fp32 logits' gradient is taken in the forward and scaled in place by the backward: a second backward
    (``retain_graph=True``) would scale it twice, so it is an error, not a wrong gradient."""
    logits, labels = _case(1, 0.3)
    leaf = logits.requires_grad_(True)
    loss = cross_entropy_sum(leaf, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="takes one backward"):
        loss.backward()
