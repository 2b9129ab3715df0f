"""ProphetNet's causal LM under cp, against its own code run in one process (a second model on the same
weights that cpshard never touched): loss (every predict stream's), logits and every gradient, at cp 2 and 4,
plain and left- and right-padded, on lengths cp does not divide, with one, two and three streams. Its streams
are cut where they enter the first layer and its n-stream attention runs whole on the gathered streams, at
the real length (:mod:`cpshard.recurrent.prophetnet`); its bytes a layer are the analytic ones; what it does
not serve (label smoothing, per-token results, per-layer outputs, generation, a changed release of its code)
is refused, by name, on every rank.
"""

import importlib

import pytest

import cpshard
from cpshard.comm.record import recording
from cpshard.recurrent.prophetnet import WRITTEN_AGAINST
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model


def failing_against_own_code(cp: int, lengths=(11, 13), embeds=False, **overrides) -> list[str]:
    """cp on a prepared ProphetNet against its own code, plain, left- and right-padded, at each of
    ``lengths`` (``embeds``: embeddings in place of token ids)."""
    mesh = cpshard.make_mesh(cp=cp)
    own, prepared = (tiny_model("prophetnet", attn_implementation="auto", **overrides) for _ in range(2))
    cp_forward = cpshard.make_cp_forward(prepared)
    width = own.config.hidden_size if embeds else None
    rows = []
    for length in lengths:
        for pad in (None, "left", "right"):
            batch = tiny_batch(own.config.vocab_size, 2, length, pad=pad, embeds_dim=width)
            found = failing_rows([check_parity(own, batch, mesh, cp_forward)])
            rows += [f"L={length} pad={pad}: {row}" for row in found]
    return rows


def test_prophetnet_is_exact_at_cp2(ranks2):
    assert ranks2.run(failing_against_own_code, 2) == [[], []]


def test_prophetnet_is_exact_at_cp4(ranks4):
    assert ranks4.run(failing_against_own_code, 4) == [[]] * 4


def test_prophetnet_is_exact_from_embeddings(ranks2):
    assert ranks2.run(failing_against_own_code, 2, (11,), True) == [[], []]


def test_any_count_of_heads_is_exact(ranks4):
    """Two heads over four ranks: the attention runs whole, on every head, so cp need not divide them."""
    assert ranks4.run(failing_against_own_code, 4, (11,), num_decoder_attention_heads=2) == [[]] * 4


@pytest.mark.parametrize("overrides", [{"ngram": 1}, {"ngram": 3}, {"disable_ngram_loss": True}])
def test_every_count_of_streams_is_exact(ranks2, overrides):
    """One stream (no ``logits_ngram``), three, and the further streams' loss turned off."""
    assert ranks2.run(failing_against_own_code, 2, (11,), **overrides) == [[], []]


def bytes_per_layer(cp: int, length: int) -> tuple[dict, int]:
    """Each layer's recorded bytes on this rank, by op, and the analytic figure: the rank's rows of every
    stream all-gathered forward, the whole streams' gradient reduce-scattered backward."""
    model = tiny_model("prophetnet", attn_implementation="auto")
    batch = tiny_batch(model.config.vocab_size, 2, length)
    cp_forward = cpshard.make_cp_forward(model)
    with recording() as log:
        cpshard.value_and_grad(cp_forward)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=cp))
    recorded = {}
    for event in log.events:
        if event.name.startswith("prophetnet.decoder.layers.0.self_attn"):
            recorded[event.op] = recorded.get(event.op, 0) + event.nbytes
    config = model.config
    rows = 2 * (1 + config.ngram) * (-(-length // cp)) * config.hidden_size * 4  # fp32
    return recorded, rows


def test_bytes_a_layer_are_the_analytic_ones(ranks2):
    for recorded, rows in ranks2.run(bytes_per_layer, 2, 64):
        assert recorded == {"all_gather": rows, "reduce_scatter": 2 * rows}, (recorded, rows)


def refusal(make: dict, overrides: dict) -> str:
    try:
        cpshard.make_cp_forward(tiny_model("prophetnet", attn_implementation="auto", **overrides), **make)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "make, overrides, says",
    [
        ({}, {"eps": 0.1}, "eps=0.1"),
        ({"logits": False}, {}, "logits=False"),
        ({"token_logprobs": True}, {}, "token_logprobs=True"),
        ({"token_statistics": ("entropy",)}, {}, "token_statistics"),
    ],
)
def test_what_it_does_not_serve_is_refused_on_every_rank(ranks2, make, overrides, says):
    for message in ranks2.run(refusal, make, overrides):
        assert says in message, message


def call_refusal(overrides: dict) -> str:
    model = tiny_model("prophetnet", attn_implementation="auto", **overrides)
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    try:
        cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    except ValueError as error:
        return str(error)
    return "no error"


def test_per_layer_outputs_are_refused_on_every_rank(ranks2):
    """The decoder's per-layer hidden states would be the ranks' rows in a tensor of the whole length."""
    for message in ranks2.run(call_refusal, {"output_hidden_states": True}):
        assert "output_hidden_states" in message, message


def _changed(*args, **kwargs):
    raise AssertionError("the refusal comes before any run")


@pytest.mark.parametrize("piece", list(WRITTEN_AGAINST[1]))
def test_a_change_in_the_code_the_hooks_follow_is_refused(monkeypatch, piece):
    """The decoder that builds the streams, masks and buckets, the layer and FFN, the attention, the causal
    LM's head and loss: any of them changed is refused at setup, by name."""
    owner, name = piece.split(".")
    monkeypatch.setattr(getattr(importlib.import_module(WRITTEN_AGAINST[0]), owner), name, _changed)
    with pytest.raises(cpshard.LayoutError, match="ProphetNet"):
        cpshard.make_cp_forward(tiny_model("prophetnet", attn_implementation="auto"))
