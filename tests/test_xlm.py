"""XLM as a causal LM (``config.causal=True``) under cp, against its own code run in one process (a second
model on the same weights that cpshard never touched): loss, logits and every gradient, at cp 2 and 4, plain
and left-padded, on lengths cp does not divide, with Ulysses, ring and hybrid. Its attention is rewritten
onto the registry (:mod:`cpshard.layouts.family_attention`) and the sequence is cut where it enters its
model (:mod:`cpshard.recurrent.xlm`); XLM as a masked LM (``causal=False``), a changed release of its code and
generation are refused, by name.
"""

import importlib

import pytest

import cpshard
from cpshard.layouts.family_attention import WRITTEN_AGAINST
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model


def failing_against_own_code(
    cp: int, implementation: str, lengths=(11, 13), embeds=False, options: dict | None = None
) -> list[str]:
    """cp on a prepared XLM against its own code, plain and left-padded, at each of ``lengths``
    (``options``: make_cp_forward's)."""
    mesh = cpshard.make_mesh(cp=cp)
    own, prepared = (tiny_model("xlm", attn_implementation="auto") for _ in range(2))
    cp_forward = cpshard.make_cp_forward(prepared, implementation=implementation, **(options or {}))
    width = own.config.emb_dim if embeds else None
    rows = []
    for length in lengths:
        for pad in (None, "left"):
            batch = tiny_batch(own.config.vocab_size, 2, length, pad=pad, embeds_dim=width)
            found = failing_rows([check_parity(own, batch, mesh, cp_forward)])
            rows += [f"L={length} pad={pad}: {row}" for row in found]
    return rows


@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_causal_xlm_is_exact_at_cp2(ranks2, implementation):
    assert ranks2.run(failing_against_own_code, 2, implementation) == [[], []]


@pytest.mark.parametrize("implementation", ["ulysses", "ring", "hybrid"])
def test_causal_xlm_is_exact_at_cp4(ranks4, implementation):
    assert ranks4.run(failing_against_own_code, 4, implementation) == [[]] * 4


def test_causal_xlm_is_exact_from_embeddings(ranks2):
    """Embeddings in place of token ids: the model takes every position as real (no ids to count)."""
    assert ranks2.run(failing_against_own_code, 2, "ulysses", (11,), True) == [[], []]


def test_causal_xlm_recomputes_its_attention_exactly(ranks2):
    """attention_recompute=True runs each attention again in the backward: XLM's model makes a cache in every
    forward, which a recompute found holding its own keys (twice the keys: torch's CheckpointError)."""
    options = {"attention_recompute": True}
    assert ranks2.run(failing_against_own_code, 2, "ulysses", (11,), False, options) == [[], []]


def refusal(overrides: dict) -> str:
    try:
        cpshard.make_cp_forward(tiny_model("xlm", attn_implementation="auto", **overrides))
    except ValueError as error:
        return str(error)
    return "no error"


def test_xlm_as_a_masked_lm_is_refused_on_every_rank(ranks2):
    for message in ranks2.run(refusal, {"causal": False}):
        assert "masked LM" in message and "config.causal=True" in message, message


def _changed(*args, **kwargs):
    raise AssertionError("the refusal comes before any run")


@pytest.mark.parametrize("piece", list(WRITTEN_AGAINST["MultiHeadAttention"][1]))
def test_a_change_in_the_code_the_cut_follows_is_refused(monkeypatch, piece):
    """The attention, the model's loop and masks, its FFN (per position) and its head's loss (labels read
    as shifted): any of them changed is refused at setup, by name."""
    module = importlib.import_module(WRITTEN_AGAINST["MultiHeadAttention"][0])
    owner, _, name = piece.rpartition(".")
    if not owner and isinstance(getattr(module, name), type):  # a class: its forward changed
        owner, name = name, "forward"
    target = getattr(module, owner) if owner else module
    monkeypatch.setattr(target, name, _changed)
    with pytest.raises(cpshard.LayoutError, match="MultiHeadAttention"):
        cpshard.make_cp_forward(tiny_model("xlm", attn_implementation="auto"))
