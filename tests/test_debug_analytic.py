"""The layout arithmetic behind explain, and the aligned tables every debug view prints."""

from types import SimpleNamespace

import pytest
import torch

from cpshard.debug.analytic import attention_paths, attention_steps, collectives, cut_steps, step
from cpshard.debug.table import table, table_of
from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.layouts.derive import derive_layout
from cpshard.spec.notation import Spec
from cpshard.tools.tiny import tiny_model

LAYOUT = DECODER.with_rows(name="test")
CONFIG = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=256)


def test_attention_bytes_per_token_with_kv_heads_repeated():
    q, k, v, out = attention_steps(CONFIG, LAYOUT, {"cp": 4}, torch.bfloat16)
    # bf16 = 2 bytes; 2 kv heads over cp=4 are repeated twice: 4 kv heads reach the all-to-all
    assert [(s.tensor, s.collectives, s.bytes_per_token) for s in (q, k, v, out)] == [
        ("q", 1, 8 * 32 * 2),
        ("k", 1, 4 * 32 * 2),
        ("v", 1, 4 * 32 * 2),
        ("out", 1, 8 * 32 * 2),
    ]
    assert q.describe() == "all_to_all over cp"
    assert collectives((q, k, v, out)) == 2  # q, k and v in one all-to-all
    with pytest.raises(ValueError, match="not divisible by cp=3"):
        attention_steps(CONFIG, LAYOUT, {"cp": 3}, torch.float32)


def test_cuts_are_free_and_unknown_sizes_stay_unknown():
    assert [
        (s.tensor, s.describe(), s.bytes_per_token)
        for s in cut_steps(CONFIG, LAYOUT, {"cp": 2}, torch.float32)
    ] == [
        ("hidden_states", "slice over cp", 0),
        ("position_embeddings", "slice over cp", 0),
        ("position_ids", "slice over cp", 0),
    ]
    # an all-to-all over a dim whose size nobody gave: no number rather than a wrong one
    moved = step("x", Spec("b s@cp e"), Spec("b s e@cp"), {}, LAYOUT, {"cp": 2}, 4)
    assert moved.collectives == 1 and moved.bytes_per_token is None
    assert (
        step("x", Spec("b s@cp e"), Spec("b s e@cp"), {"e": 6}, LAYOUT, {"cp": 2}, 4).bytes_per_token == 6 * 4
    )


def test_attention_paths_in_layer_order():
    model = tiny_model("llama", num_hidden_layers=11)
    paths = attention_paths(model, LAYOUT)
    assert paths == [f"model.layers.{i}.self_attn" for i in range(11)]


def test_attention_paths_leave_out_recurrent_mixers_of_the_same_name():
    minimax = tiny_model("minimax")  # layer 1's self_attn is lightning attention
    assert minimax.config.layer_types == ["full_attention", "linear_attention"]
    assert attention_paths(minimax, derive_layout(minimax)) == ["model.layers.0.self_attn"]


def test_table_aligns_and_right_justifies():
    text = table([("a", 1), ("long name", 1234)], header=("name", "n"), right=frozenset({1}))
    assert text.splitlines() == ["name          n", "---------  ----", "a             1", "long name  1234"]
    assert table([]) == ""


def test_table_of_puts_each_header_over_its_cells():
    columns = (("name", lambda r: r[0]), ("n", lambda r: r[1]), ("note", lambda r: r[2]))
    text = table_of([("a", 1, "x"), ("long name", 1234, "yy")], columns, text=frozenset({"name", "note"}))
    assert text.splitlines() == [
        "name          n  note",
        "---------  ----  ----",
        "a             1  x",
        "long name  1234  yy",
    ]
