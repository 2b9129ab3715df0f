"""Bloom, GPT-Neo, MPT and XGLM: their attention, rewritten to go through transformers' registry, is exact
under cp against the family's own code run in one process (a second model on the same weights that cpshard
never touched): loss, logits and every gradient, on plain and left-padded batches; so is Falcon, whose own
code calls the registry since transformers 5.25, its ALiBi folded into the mask. ALiBi (Bloom, MPT,
Falcon-RW and multi-query Falcon), GPT-Neo's local window, Falcon's multi-query, grouped (new architecture)
and multi-head k/v, MPT's masked_fill and XGLM's clamp; ring serves the rotary Falcon and refuses ALiBi and
the window with a clear error on every rank. The classics whose own code is plain attention (OpenAI GPT with
its -1e4 for later keys, GPT-NeoX-Japanese, MegatronBERT, RemBERT, RoFormer's rotary, TrOCR, BigBird's
original_full) are exact alike (XLM as a causal LM: tests/test_xlm.py); the attention cpshard does not
rewrite is refused with what it is.
"""

import copy

import pytest
import torch
from transformers.models.mvp.modeling_mvp import MvpDecoder

import cpshard
from cpshard.layouts.derive import derive_layout
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.family_attention import rewrite, rewritten
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model

#: (model type, attention implementation, config overrides)
VARIANTS = [
    ("bloom", "eager", {}),
    ("mpt", "eager", {}),
    ("mpt", "eager", {"attn_config": {"clip_qkv": 0.5}}),
    ("falcon", "sdpa", {}),  # multi-query, rotary
    ("falcon", "eager", {}),
    ("falcon", "sdpa", {"alibi": True, "multi_query": False}),  # Falcon-RW
    ("falcon", "eager", {"alibi": True}),
    ("falcon", "sdpa", {"alibi": True}),  # multi-query with ALiBi: refused before 5.25, exact since
    ("falcon", "sdpa", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    ("gpt_neo", "eager", {}),  # a global and a local layer, window 4
    ("xglm", "eager", {}),
    ("openai-gpt", "eager", {}),  # a later key's score -1e4 whatever q·k, then the padding mask
    ("gpt_neox_japanese", "eager", {}),
    ("megatron-bert", "eager", {}),
    ("rembert", "eager", {}),
    ("roformer", "eager", {}),  # rotary inside its attention
    ("roformer", "eager", {"rotary_value": True}),  # on v too
    ("trocr", "eager", {}),
    ("big_bird", "eager", {"attention_type": "original_full"}),  # block_sparse: not causal, refused
    ("mvp", "eager", {}),
]
IDS = [f"{t}-{impl}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for t, impl, o in VARIANTS]


def failing_against_own_code(
    model_type, implementation, overrides, cp_implementation, compile=False
) -> list[str]:
    """cp on a prepared model against the family's own attention (a fresh model on the same seed)."""
    mesh = cpshard.make_mesh(cp=2)
    own = tiny_model(model_type, attn_implementation=implementation, **overrides)
    prepared = tiny_model(model_type, attn_implementation=implementation, **overrides)
    cp_forward = cpshard.make_cp_forward(prepared, implementation=cp_implementation, compile=compile)
    rows = []
    for pad in (None, "left"):
        batch = tiny_batch(own.config.vocab_size, 2, 11, pad=pad)
        rows += [f"pad={pad}: {row}" for row in failing_rows([check_parity(own, batch, mesh, cp_forward)])]
    return rows


@pytest.mark.parametrize("model_type, implementation, overrides", VARIANTS, ids=IDS)
def test_rewritten_attention_is_exact_under_ulysses(ranks2, model_type, implementation, overrides):
    result = ranks2.run(failing_against_own_code, model_type, implementation, overrides, "ulysses")
    assert result == [[], []]


@pytest.mark.parametrize("model_type", ["bloom", "gpt_neo", "mpt"])
def test_rewritten_attention_compiles_per_layer(ranks2, model_type):
    """A compiled cp layer's mask holds the real keys only (fewer than its queries): ALiBi and the window
    are cut to them."""
    assert ranks2.run(failing_against_own_code, model_type, "eager", {}, "ulysses", "aot_eager") == [[], []]


def test_ring_serves_rotary_falcon(ranks2):
    assert ranks2.run(failing_against_own_code, "falcon", "sdpa", {}, "ring") == [[], []]


@pytest.mark.parametrize("model_type", ["gpt_neox_japanese", "megatron-bert", "roformer"])
def test_ring_serves_rewritten_attention_that_adds_the_mask_alone(ranks2, model_type):
    assert ranks2.run(failing_against_own_code, model_type, "eager", {}, "ring") == [[], []]


def refusal(model_type: str, implementation: str, overrides: dict) -> str:
    try:
        failing_against_own_code(model_type, implementation, overrides, "ring")
    except ValueError as error:
        return str(error)
    return "no error"


#: Falcon: ALiBi in its mask; OpenAI GPT: a later key's -1e4 in its mask
RING_REFUSED = [("bloom", {}), ("gpt_neo", {}), ("falcon", {"alibi": True}), ("openai-gpt", {})]


@pytest.mark.parametrize("model_type, overrides", RING_REFUSED)
def test_ring_refuses_alibi_and_windows_on_every_rank(ranks2, model_type, overrides):
    messages = ranks2.run(refusal, model_type, "eager", overrides)
    assert all("implementation='ulysses'" in message for message in messages), messages
    assert not any("Some module mixes tokens" in message for message in messages)  # the refusal as it is


NOT_REWRITTEN = [
    ("big_bird", "block-sparse"),
    ("xlnet", "two-stream"),
    ("reformer", "served by its layout file"),
    ("cpmant", "not causal"),
    ("git", "needs pixel_values"),
]


@pytest.mark.parametrize("model_type, reason", NOT_REWRITTEN)
def test_attention_cpshard_does_not_rewrite_is_refused_with_its_reason(model_type, reason):
    with pytest.raises(LayoutError, match=reason):
        derive_layout(tiny_model(model_type, attn_implementation="auto"))


def test_mvp_prompts_are_refused():
    """MVP's prompts are keys before the sequence's inside attention, which cp's attention would not see
    (its decoder's, with ``use_prompt``; the causal LM's decoder has none)."""
    config = tiny_model("mvp", attn_implementation="eager").config
    decoder = MvpDecoder(config, use_prompt=True)
    for module in decoder.modules():
        if rewritten(module):
            rewrite(module, config)
    with pytest.raises(ValueError, match="use_prompt=False"):
        decoder(input_ids=tiny_batch(config.vocab_size, 1, 5)["input_ids"])


def test_the_rewrite_follows_a_deep_copy():
    model = tiny_model("bloom", attn_implementation="eager")
    cpshard.make_cp_forward(model)
    clone = copy.deepcopy(model)
    attention = clone.transformer.h[0].self_attention
    assert rewritten(attention) and attention.forward.args[0] is attention


@pytest.mark.parametrize(
    "model_type", ["mpt", "openai-gpt", "gpt_neox_japanese", "megatron-bert", "roformer", "xlm"]
)
def test_a_rewritten_model_outside_cp_gives_its_own_results(model_type):
    own = tiny_model(model_type, attn_implementation="eager")
    other = copy.deepcopy(own)
    for module in other.modules():
        if rewritten(module):
            rewrite(module, other.config)
    batch = tiny_batch(own.config.vocab_size, 2, 11, pad="left")
    expected, got = own(**batch, output_attentions=True), other(**batch, output_attentions=True)
    expected.loss.backward()
    got.loss.backward()
    assert (expected.logits - got.logits).abs().max() < 1e-5
    assert len(got.attentions) == len(expected.attentions)
    for want, have in zip(expected.attentions, got.attentions):
        assert (want - have).abs().max() < 1e-6
    for (name, a), b in zip(own.named_parameters(), other.parameters()):
        if a.grad is None or b.grad is None:  # a part the loss does not reach (BERT's pooler)
            assert a.grad is b.grad, name
            continue
        assert (a.grad - b.grad).abs().max() <= 1e-5 * a.grad.abs().max(), name


def generated(model_type: str, overrides: dict) -> object:
    """cp=2 greedy tokens against the family's own ``model.generate`` (True when equal), or the error."""
    model = tiny_model(model_type, attn_implementation="auto", **overrides)
    mesh = cpshard.make_mesh(cp=2)
    prompt = tiny_batch(model.config.vocab_size, 2, 13, pad="left")
    batch = {"input_ids": prompt["input_ids"], "attention_mask": prompt["attention_mask"]}
    expected = model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=0)
    try:
        tokens = cpshard.generate(model, batch, mesh, max_new_tokens=12)
    except ValueError as error:
        return str(error)
    return bool((tokens == expected).all())


def test_rotary_falcon_generates_as_its_own_code(ranks2):
    assert ranks2.run(generated, "falcon", {}) == [True, True]


@pytest.mark.parametrize(
    "model_type, words",
    [
        ("bloom", "adds ALiBi to its attention scores"),
        ("gpt_neo", "adds a local window to its attention scores"),
        ("hrm_text", "does not serve HRM's decoder"),
    ],
)
def test_generation_refuses_what_its_cache_does_not_carry_on_every_rank(ranks2, model_type, words):
    messages = ranks2.run(generated, model_type, {})
    assert all(words in str(message) for message in messages), messages


@pytest.mark.parametrize("model_type", ["bloom", "gpt_neo", "mpt", "xglm"])
def test_rewritten_attention_is_as_precise_as_its_own_in_bf16(model_type):
    """MPT adds a float32 ALiBi to its scores and GPT-Neo takes float32 scores: a bf16 bias (up to -500 at
    MPT's 2048 positions) or bf16 scores would be 12x further from the float32 model."""
    reference = tiny_model(model_type, attn_implementation="eager")
    own = tiny_model(model_type, attn_implementation="eager", dtype=torch.bfloat16)
    rewritten_model = copy.deepcopy(own)
    for module in rewritten_model.modules():
        if rewritten(module):
            rewrite(module, rewritten_model.config)
    batch = tiny_batch(own.config.vocab_size, 2, 200, pad="left")
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        expected = reference(**batch).logits[real]
        errors = [(m(**batch).logits.float()[real] - expected).abs().mean() for m in (own, rewritten_model)]
    assert errors[1] <= 1.1 * errors[0], errors


def ring_outcome(pad: str | None):
    try:
        return failing_rows([check_parity(*_ring_xglm(pad))])
    except ValueError as error:
        return str(error)


def _ring_xglm(pad):
    own = tiny_model("xglm", attn_implementation="eager")
    prepared = tiny_model("xglm", attn_implementation="eager")
    batch = tiny_batch(own.config.vocab_size, 2, 11, pad=pad)
    return own, batch, cpshard.make_mesh(cp=2), cpshard.make_cp_forward(prepared, implementation="ring")


def test_ring_serves_xglm_and_refuses_rows_that_see_no_key(ranks2):
    """XGLM clamps hidden scores (half a gradient on the tie); the ring adds the mask instead, which differs
    only in a row that sees no key: exact without one, refused on every rank with one."""
    assert ranks2.run(ring_outcome, None) == [[], []]
    assert all("sees no key (left padding)" in str(m) for m in ranks2.run(ring_outcome, "left"))
