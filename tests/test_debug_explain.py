"""explain: the layout's choices and reasons, and each move's collective and bytes per token."""

import torch.distributed as dist

import cpshard
from cpshard.debug import explain
from cpshard.tools.tiny import tiny_model
from cpshard.tools.tiny_sizes import SMALL

F32 = 4
H, KV, HD = SMALL["num_attention_heads"], SMALL["num_key_value_heads"], SMALL["head_dim"]


def explained(model_type: str, implementation: str = "auto", **config):
    model = tiny_model(model_type, **config)
    found = explain(model, cpshard.make_mesh(cp=dist.get_world_size()), implementation=implementation)
    moves = {
        s.tensor: (str(s.src), str(s.dst), s.describe(), s.bytes_per_token)
        for s in found.cuts + found.attention
    }
    return (
        found.layout.name,
        found.implementation,
        found.kv_replication,
        moves,
        found.attention_modules,
        str(found),
    )


def test_llama_on_cp2(ranks2):
    for layout, implementation, replicas, moves, modules, text in ranks2.run(explained, "llama"):
        assert (layout, implementation, replicas) == ("llama", "ulysses", 1)
        assert modules == ("model.layers.0.self_attn", "model.layers.1.self_attn")
        assert moves == {
            "hidden_states": ("b s d", "b s@cp d", "slice over cp", 0),
            "position_embeddings": ("b s d", "b s@cp d", "slice over cp", 0),
            "position_ids": ("b s", "b s@cp", "slice over cp", 0),
            # per token a rank holds: every q head (4 x 16 floats), every kv head (2 x 16), every output head
            "q": ("b h s@cp d", "b h@cp s d", "all_to_all over cp", H * HD * F32),
            "k": ("b h s@cp d", "b h@cp s d", "all_to_all over cp", KV * HD * F32),
            "v": ("b h s@cp d", "b h@cp s d", "all_to_all over cp", KV * HD * F32),
            "out": ("b s h@cp d", "b s@cp h d", "all_to_all over cp", H * HD * F32),
        }
        per_module = 2 * H * HD * F32 + 2 * KV * HD * F32
        assert (
            "registered for model type 'llama'" in text and "num_attention_heads=4 divides over cp=2" in text
        )
        assert (
            f"per attention module: 2 collectives (q, k and v in one), {per_module:,} bytes/token forward"
            in text
        )
        assert (
            f"over 2 modules: {2 * per_module:,} bytes/token forward, {4 * per_module:,} forward and backward"
            in text
        )
        row = next(line for line in text.splitlines() if line.split()[2:3] == ["k"])
        assert row.split() == [
            "model.layers.{0..1}.self_attn",
            "(each)",
            "k",
            "b",
            "h",
            "s@cp",
            "d",
            "b",
            "h@cp",
            "s",
            "d",
            "all_to_all",
            "over",
            "cp",
            str(KV * HD * F32),
        ]


def test_generic_layout_and_heads_that_do_not_divide(ranks2):
    for layout, implementation, _, moves, _, text in ranks2.run(explained, "qwen2"):
        assert layout == "derived:qwen2" and implementation == "ulysses" and moves["q"][3] == H * HD * F32
        assert "no layout file is registered for 'qwen2'; derived from the model's structure" in text
    three_heads = dict(num_attention_heads=3, num_key_value_heads=1, hidden_size=48)
    for _, implementation, replicas, moves, _, text in ranks2.run(explained, "llama", **three_heads):
        # 3 heads over cp=2: no Ulysses degree divides both, so auto falls back to the ring
        assert implementation == "ring" and replicas is None and "q" not in moves
        assert "num_attention_heads=3 is not divisible by cp=2; k and v travel a ring of 2 ranks" in text
    for _, implementation, _, moves, _, text in ranks2.run(explained, "llama", "ulysses", **three_heads):
        assert implementation == "none" and "q" not in moves
        assert (
            "cp_forward would raise at its first call" in text
            and "num_attention_heads=3 is not divisible by cp=2" in text
        )


def explained_under_tp(model_type: str) -> tuple:
    """``model_type`` on cp=2 x tp=2: what each tp rank's heads imply."""
    found = explain(tiny_model(model_type), cpshard.make_mesh(cp=2, tp=2))
    moves = {s.tensor: s.bytes_per_token for s in found.attention}
    return found.implementation, found.kv_replication, moves, str(found)


def test_tp_splits_the_heads_that_ulysses_splits_over_cp(ranks4):
    """Each tp rank holds 2 of llama's 4 q heads and 1 of its 2 kv heads, repeated for cp=2 (the model's
    whole heads were explained before: 2 heads a rank, each kv head held once); Phi-3's derived tp plan
    leaves its fused attention whole, every head on every tp rank."""
    for implementation, replicas, moves, text in ranks4.run(explained_under_tp, "llama"):
        assert (implementation, replicas) == ("ulysses", 2)
        assert moves == {
            "q": H // 2 * HD * F32,
            "k": HD * F32 * 2,
            "v": HD * F32 * 2,
            "out": H // 2 * HD * F32,
        }
        said = "the 2 heads each tp rank holds (tp=2) divide over cp=2, so each rank attends whole sequences"
        assert f"{said} over 1 heads" in text, text
    for implementation, replicas, moves, text in ranks4.run(explained_under_tp, "phi3"):
        assert (implementation, replicas) == ("ulysses", 1)
        assert moves == {"q": H * HD * F32, "k": KV * HD * F32, "v": KV * HD * F32, "out": H * HD * F32}
        assert "num_attention_heads=4 divides over cp=2, so each rank attends whole sequences over 2" in text


def misused() -> list[str]:
    model, mesh = tiny_model("llama"), cpshard.make_mesh(cp=dist.get_world_size())
    messages = []
    for attempt in (
        lambda: explain(model, mesh, implementation="bogus"),
        lambda: explain(model, None),
        lambda: explain(model, mesh, ulysses_degree=2),
    ):
        try:
            attempt()
            messages.append("no error")
        except (TypeError, ValueError) as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_what_make_cp_forward_refuses_explain_refuses(ranks2):
    """An unknown implementation was explained as Ulysses, and no mesh failed deep inside."""
    for bogus, no_mesh, degree in ranks2.run(misused):
        assert bogus == "ValueError: implementation='bogus'; choose one of auto, ulysses, ring, hybrid", bogus
        assert no_mesh.startswith("TypeError: the mesh is NoneType None, not a DeviceMesh"), no_mesh
        assert degree.startswith("ValueError: ulysses_degree"), degree


def test_kv_heads_repeated_on_cp4(ranks4):
    for _, _, replicas, moves, _, text in ranks4.run(explained, "llama"):
        # 2 kv heads over 4 ranks: each repeated twice so that every rank gets one
        assert replicas == 2 and "each kv head repeated 2x" in text
        assert moves["k"][3] == moves["v"][3] == 2 * KV * HD * F32 and moves["q"][3] == H * HD * F32


def test_layers_sized_by_a_sub_config_of_their_own(ranks2):
    """BLT's layout names its global transformer, sized by ``global_config`` (the top config has no hidden
    size): the moves are that stack's, and the text says they run over a sequence of their own."""
    for layout, implementation, _, moves, modules, text in ranks2.run(explained, "blt"):
        assert (layout, implementation) == ("blt", "ulysses") and modules[0].startswith("model.global_")
        width = 64 // 4  # the global stack's hidden size over its heads (tiny: 64, 4 heads, 2 kv heads)
        assert moves["q"][3] == 4 * width * F32 and moves["k"][3] == 2 * width * F32
        assert "per position of the sequence they run over" in text
