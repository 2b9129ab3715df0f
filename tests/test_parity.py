"""The parity check itself: rows per tensor group, and it does catch a broken layout."""

import cpshard
from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.spec.notation import Spec
from cpshard.tools.parity import check_parity, tensor_group
from cpshard.tools.tiny import tiny_batch, tiny_model


def test_tensor_groups():
    assert tensor_group("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert tensor_group("model.layers.0.input_layernorm.weight") == "model.layers.0.input_layernorm"
    assert tensor_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert tensor_group("lm_head.weight") == "lm_head"


def run_with_attention_left_local():
    """A layout that cuts the sequence but never moves q, k, v: each rank attends within its slice."""
    stay = (Spec("b h s@cp d"), Spec("b h s@cp d"))
    broken = DECODER.with_rows(name="broken", qkv=stay, attn_output=(Spec("b s h@cp d"), Spec("b s h@cp d")))
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 12)
    return check_parity(model, batch, cpshard.make_mesh(cp=2), cpshard.make_cp_forward(model, layout=broken))


def test_parity_catches_a_broken_layout(ranks2):
    for parity in ranks2.run(run_with_attention_left_local):
        assert parity.diffs["logits"] > 1e-2 and parity.diffs["loss"] > 1e-4
        assert parity.diffs["grad model.layers.0.self_attn"] > 1e-3
