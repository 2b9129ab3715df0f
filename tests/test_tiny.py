"""Tiny models and batches: deterministic, and shaped as each option says."""

import pytest
import torch

from cpshard.tools.tiny import tiny_batch, tiny_config, tiny_model
from cpshard.tools.tiny_sizes import SMALL


def test_models_are_deterministic_per_seed():
    one, two, other = tiny_model("llama", seed=3), tiny_model("llama", seed=3), tiny_model("llama", seed=4)
    for (name, a), (_, b), (_, _c) in zip(
        one.named_parameters(), two.named_parameters(), other.named_parameters()
    ):
        assert torch.equal(a, b), name
    assert not torch.equal(one.lm_head.weight, other.lm_head.weight)


def test_unknown_model_type_is_named():
    with pytest.raises(ValueError, match="unknown model type 'no_such_model'"):
        tiny_model("no_such_model")


def test_a_composite_configs_parts_are_tiny_and_sized_by_a_dict():
    config = tiny_config("gemma3", text_config=dict(num_hidden_layers=3))
    text, vision = config.text_config, config.vision_config
    assert (text.model_type, text.hidden_size, text.num_hidden_layers) == ("gemma3_text", 64, 3)
    assert (vision.hidden_size, vision.num_hidden_layers) == (
        SMALL["hidden_size"],
        SMALL["num_hidden_layers"],
    )
    assert sum(p.numel() for p in tiny_model("gemma3").parameters()) < 1_000_000


def test_a_causal_lm_of_one_part_is_built_from_that_part():
    model = tiny_model("musicgen")  # MusicGen's causal LM is its decoder: MusicgenConfig holds three parts
    assert model.config.model_type == "musicgen_decoder" and model.config.hidden_size == SMALL["hidden_size"]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_differs_per_row_and_masks_labels(side):
    batch = tiny_batch(50, 4, 12, pad=side)
    mask = batch["attention_mask"]
    assert len({int(row.sum()) for row in mask}) > 1, "every row padded alike"
    assert torch.equal(batch["labels"] == -100, mask == 0)
    padded_end = mask[:, 0] if side == "left" else mask[:, -1]
    assert (padded_end == 0).any() and (mask.sum(1) > 0).all()


def test_packed_positions_restart_at_zero():
    positions = tiny_batch(50, 3, 20, packed=True)["position_ids"]
    steps = positions[:, 1:] - positions[:, :-1]
    assert ((steps == 1) | (positions[:, 1:] == 0)).all() and (positions[:, 1:] == 0).any()


def test_embeds_and_shift_labels():
    batch = tiny_batch(50, 2, 7, embeds_dim=16, shift=True)
    assert set(batch) == {"inputs_embeds", "shift_labels"} and batch["inputs_embeds"].shape == (2, 7, 16)


def test_the_default_attention_is_sdpa_where_the_model_has_it_else_eager():
    assert tiny_model("llama").config._attn_implementation == "sdpa"
    assert tiny_model("reformer").config._attn_implementation == "eager"  # no sdpa in transformers 5.25
