"""Label-token counts: the loss's normaliser, and the count that gradient accumulation divides by.

The loss of a batch is its token-loss sum over a count of label tokens: by default this batch's
own, over every dp group. Under gradient accumulation the batch carries ``num_items_in_batch``,
the count over every micro-batch of the optimizer step (:func:`count_label_tokens`), so that
gradients summed over the micro-batches are those of the whole step.
"""

from __future__ import annotations

import torch

from cpshard.comm.collectives import sum_over_group
from cpshard.comm.record import serving
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.parallel.mesh import DATA_AXES, group_over
from cpshard.runtime.batch import WHOLE_KEYS, BatchError, shifted_labels, validate


def label_count(shift_labels: torch.Tensor) -> torch.Tensor:
    """The label tokens that count in the loss: those not ignored."""
    return (shift_labels != IGNORE_INDEX).sum()


def count_label_tokens(micro_batches, mesh) -> torch.Tensor:
    """The label tokens of every micro-batch of an optimizer step over every dp group: the batches'
    ``num_items_in_batch``. Each rank passes its own dp group's micro-batches; every rank calls it."""
    total = torch.zeros((), dtype=torch.int64)
    for batch in micro_batches:
        validate(batch, whole=WHOLE_KEYS)  # the labels alone are read
        labels = batch.get("shift_labels")
        if labels is None and batch.get("labels") is not None:
            labels = shifted_labels(batch["labels"])
        if labels is None:
            raise BatchError("count_label_tokens: a micro-batch has neither labels nor shift_labels")
        total = total + label_count(labels)  # on the labels' device
    group = group_over(mesh, DATA_AXES)
    if group is None:
        return total
    with serving("other"):
        return sum_over_group(total, group, name="token count")


def loss_normaliser(shift_labels: torch.Tensor, num_items, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_tokens, divisor)``: this batch's label tokens over every dp group, and what the token-loss
    sum is divided by: ``num_items`` when given (the same on every rank, and at least ``num_tokens``, or
    every rank raises), else ``num_tokens``."""
    counts = label_count(shift_labels).reshape(1)
    if num_items is not None:
        items = int(num_items)
        counts = torch.tensor([int(counts), items, items * items], dtype=torch.int64, device=counts.device)
    group = group_over(mesh, DATA_AXES)
    if group is not None:
        with serving("other"):
            counts = sum_over_group(counts, group, name="token count")
    num_tokens = counts[0]
    if num_items is None:
        return num_tokens, num_tokens.clamp(min=1)
    groups = 1 if group is None else group.size()
    total, squares = int(counts[1]), int(counts[2])
    if total * total != groups * squares:  # the same test on every rank: equal only when all values are
        raise BatchError(
            "num_items_in_batch differs across the dp groups; it is one count for the whole optimizer step: "
            "give every rank cpshard.count_label_tokens(micro_batches, mesh)"
        )
    if items < int(num_tokens):
        raise BatchError(
            f"num_items_in_batch={items} is fewer than this batch's own {int(num_tokens)} label tokens; it "
            "counts every micro-batch of the optimizer step: cpshard.count_label_tokens(micro_batches, mesh)"
        )
    return num_tokens, torch.tensor(float(items))
