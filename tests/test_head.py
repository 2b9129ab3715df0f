"""cpshard's LM head against the models' own: the known transforms, and the check that finds the others."""

import pytest
import torch

from cpshard.layouts.layout import HEAD_TRANSFORMS
from cpshard.loss.head import head_matches, own_logits
from cpshard.parallel.mesh import make_mesh
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model

HEADS = [
    ("llama", {}, True),
    ("gemma3_text", {"final_logit_softcapping": 2.0}, True),
    ("granite", {"logits_scaling": 3.0}, True),
    ("qwen3_moe", {"output_router_logits": True}, True),
    ("llama", {"tie_word_embeddings": True}, True),
    (
        "cohere",
        {"logit_scale": 0.5},
        False,
    ),  # Cohere multiplies its logits by logit_scale: unknown to cpshard
]


@pytest.mark.parametrize("model_type,options,known", HEADS)
def test_own_logits_are_the_models_where_the_check_says_so(model_type, options, known):
    model = tiny_model(model_type, **options)
    params = params_of(model)
    ids = torch.randint(3, 128, (1, 6))
    hidden = model.get_decoder()(input_ids=ids).last_hidden_state
    expected = model(input_ids=ids, output_router_logits=False).logits
    assert head_matches(model, params, HEAD_TRANSFORMS, "model") is known
    assert torch.allclose(own_logits(model, params, hidden, HEAD_TRANSFORMS), expected, atol=1e-6) is known
    assert model.get_decoder() is not None and type(model.get_decoder()).__name__.endswith(
        "Model"
    )  # put back


def run_unknown_head():
    """On each rank of a cp=2 group: parity with logits=True, and the error logits=False raises."""
    model = tiny_model("cohere", logit_scale=0.5)
    batch, mesh = tiny_batch(model.config.vocab_size, 2, 9), make_mesh(cp=2)
    parity = check_parity(model, batch, mesh, make_cp_forward(model))
    try:
        make_cp_forward(model, logits=False)(params_of(model), batch, mesh)
    except ValueError as error:
        return parity, str(error)
    return parity, None


def test_a_head_cpshard_does_not_know_serves_logits_true_and_refuses_logits_false(ranks2):
    for parity, error in ranks2.run(run_unknown_head):
        assert not failing_rows([parity]) and parity.comm_bytes > 0, (parity.diffs, parity.scales)
        assert (
            error
            and "CohereForCausalLM's LM head gives other logits" in error
            and "with logits=True" in error
        ), error


@pytest.mark.parametrize(
    "model_type, decoder, dtype",
    [
        ("dory", "model", torch.float32),
        ("falcon_h1", "model", torch.float32),
        ("electra", "electra", torch.float32),
        ("blt", "model", torch.bfloat16),
    ],
)
def test_a_head_that_is_more_than_its_projection_is_not_cpshards(model_type, decoder, dtype):
    """Dory's head scales by a parameter of its own (1 at first: the logits agree, its gradient would be
    lost), FalconH1's forward reads its decoder's multiplier, ELECTRA's runs prediction layers first, BLT's
    casts bf16 logits to fp32: the check says no, without raising, and the model's own head runs
    (``logits=True``)."""
    model = tiny_model(model_type, dtype=dtype)
    assert head_matches(model, params_of(model), HEAD_TRANSFORMS, decoder) is False
