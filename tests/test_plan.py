"""A call's plan: the options checked when they are made, and the sequence order chosen from the
implementation and the batch (the strategy's checks against a mesh run in tests/test_forward.py and
tests/test_parallel.py, where a mesh exists)."""

import pytest
import torch

from cpshard.runtime.plan import CPOptions, choose_order


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(implementation="flash"), "implementation='flash'; choose one of"),
        (dict(sequence_order="zigzag"), "zigzag"),
        (dict(expert_plan="scatter"), "scatter"),
        # strings from a config file read as True: logits and log-probabilities computed, unasked
        (dict(logits="no"), "logits='no' is not a bool; give True or False"),
        (dict(token_logprobs="False"), "token_logprobs='False' is not a bool"),
        (dict(attention_recompute=1), "attention_recompute=1 is not a bool"),
        (dict(strict=None), "strict=None is not a bool"),
        # ignored by every implementation but hybrid
        (
            dict(ulysses_degree=2),
            "ulysses_degree=2 sets hybrid's Ulysses group size, and implementation='auto'",
        ),
        (dict(implementation="ring", ulysses_degree=2), "implementation='ring' would ignore it"),
    ],
)
def test_bad_options_are_refused_when_made(options, says):
    with pytest.raises(ValueError, match=says):
        CPOptions(**options)


def test_options_are_a_frozen_value():
    options = CPOptions(implementation="ring", mlp_tile=64)
    with pytest.raises(AttributeError):
        options.mlp_tile = 8
    assert options == CPOptions(implementation="ring", mlp_tile=64)


WHOLE = {"input_ids": torch.zeros(1, 8, dtype=torch.long)}
PACKED = {**WHOLE, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}


@pytest.mark.parametrize(
    "asked, implementation, batch, order",
    [
        ("auto", "ulysses", PACKED, "contiguous"),  # Ulysses attends over whole sequences
        ("auto", "ring", WHOLE, "head_tail"),
        ("auto", "hybrid", PACKED, "striped"),  # packed documents: per-document causal work
        ("striped", "ring", WHOLE, "striped"),
        ("contiguous", "ulysses", WHOLE, "contiguous"),
    ],
)
def test_the_order_follows_the_implementation_and_the_batch(asked, implementation, batch, order):
    assert choose_order(asked, implementation, batch) == order


def test_ulysses_refuses_a_balanced_order():
    with pytest.raises(ValueError, match="Ulysses gathers whole sequences"):
        choose_order("head_tail", "ulysses", WHOLE)
