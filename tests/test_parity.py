"""The parity check itself: rows per tensor group, and it does catch a broken layout."""

from dataclasses import replace

import pytest
import torch

import cpshard
from cpshard.tools.parity import (
    WIDER,
    beyond_own_rounding,
    check_parity,
    failing_rows,
    float64_distances,
    tensor_group,
    widened,
)
from cpshard.tools.tiny import tiny_batch, tiny_model


def test_tensor_groups():
    assert tensor_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert tensor_group("model.layers.0.input_layernorm.weight") == "model.layers.0.input_layernorm"
    assert tensor_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert tensor_group("lm_head.weight") == "lm_head"


def run_with_a_wrong_forward():
    """A cp forward whose loss is off by 1 % (a broken layout is refused by the probe before it runs, so
    parity is shown a wrong result directly): the loss and every gradient differ."""
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 12)
    cp_forward = cpshard.make_cp_forward(model)

    def wrong(params, batch, mesh):
        output = cp_forward(params, batch, mesh)
        return replace(output, loss=output.loss * 1.01)

    return check_parity(model, batch, cpshard.make_mesh(cp=2), wrong)


def test_parity_catches_a_wrong_forward(ranks2):
    for parity in ranks2.run(run_with_a_wrong_forward):
        assert parity.diffs["loss"] > 1e-3 * parity.scales["loss"]
        assert (
            parity.diffs["grad model.layers.0.self_attn"]
            > 1e-3 * parity.scales["grad model.layers.0.self_attn"]
        )
        assert parity.diffs["logits"] <= 1e-5


def rows_beyond_rounding_of_a_wrong_cp_run(dtype: torch.dtype, rtol: float) -> dict:
    """A cp run that loses the padding mask (its gradients wrong on the padded rows) against the rounding
    allowance (in float64 for fp32, in fp32 for bf16): its rows stay failing; the right run's rows pass at
    ``rtol`` before the allowance is asked."""
    model = tiny_model("llama", attn_implementation="auto", dtype=dtype)
    batch, mesh = tiny_batch(model.config.vocab_size, 2, 11, pad="left"), cpshard.make_mesh(cp=2)
    right = cpshard.make_cp_forward(model)
    rows = failing_rows([check_parity(model, batch, mesh, _unpadded(right, batch))], rtol)
    twin = tiny_model("llama", attn_implementation="auto", dtype=dtype)
    wrong_in_float64 = _unpadded(cpshard.make_cp_forward(widened(tiny_model("llama"), WIDER[dtype])), batch)
    params = cpshard.params_of(model)
    return {
        "right": failing_rows([check_parity(model, batch, mesh, right)], rtol),
        "wrong": rows,
        "beyond rounding": beyond_own_rounding(
            twin, model, params, batch, mesh, _unpadded(right, batch), rows
        ),
        "beyond, cp in float64 too": float64_distances(
            twin, model, params, batch, mesh, _unpadded(right, batch), wrong_in_float64
        ).beyond(rows),
    }


def _unpadded(cp_forward, batch: dict):
    """``cp_forward`` on ``batch`` without its padding mask, whatever batch it is given."""
    unpadded = {key: value for key, value in batch.items() if key != "attention_mask"}
    return type(
        "Unpadded", (), {"__call__": lambda self, params, _, mesh: cp_forward(params, unpadded, mesh)}
    )()


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)], ids=["fp32", "bf16"])
def test_the_rounding_allowance_keeps_a_wrong_cp_run_wrong(ranks2, dtype, rtol):
    for result in ranks2.run(rows_beyond_rounding_of_a_wrong_cp_run, dtype, rtol):
        grads = [row for row in result["wrong"] if row.startswith("grad ")]
        assert result["right"] == [] and grads, result
        assert result["beyond rounding"] == result["wrong"], result
        assert result["beyond, cp in float64 too"] == result["wrong"], result


def parity_of_placed_params() -> str:
    model = tiny_model("llama")
    mesh = cpshard.make_mesh(cp=1, fsdp=2)
    cp_forward = cpshard.make_cp_forward(cpshard.parallelize(model, mesh))
    try:
        check_parity(model, tiny_batch(model.config.vocab_size, 2, 12), mesh, cp_forward)
    except ValueError as error:
        return str(error)
    return "no error"


def test_parameters_placed_on_a_mesh_are_refused(ranks2):
    """Parallelized parameters failed inside the plain model's embedding ("mixed torch.Tensor and DTensor"),
    reported as the model's own failure."""
    for message in ranks2.run(parity_of_placed_params):
        assert message.startswith(
            "check_parity compares cp with the plain model run on this process alone, which parameters "
            "placed on a mesh cannot run ("
        ), message
        assert "e.g. 'model.embed_tokens.weight'" in message, message
