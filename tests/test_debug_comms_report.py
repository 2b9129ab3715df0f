"""trace_comms: totals against bytes worked out by hand, groups against the layout's optimum."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.comm.exchange import all_to_all
from cpshard.debug import trace_comms
from cpshard.debug.comms_report import split_name
from cpshard.runtime.batch import fingerprint
from cpshard.tools.tiny import tiny_batch, tiny_model
from cpshard.tools.tiny_sizes import SMALL

F32 = 4
V, D, FFN = SMALL["vocab_size"], SMALL["hidden_size"], SMALL["intermediate_size"]
H, KV, HD, LAYERS = (
    SMALL["num_attention_heads"],
    SMALL["num_key_value_heads"],
    SMALL["head_dim"],
    SMALL["num_hidden_layers"],
)


def llama_param_count() -> int:
    """Embeddings and lm_head (untied), final norm, and per layer q, k, v, o, a gated MLP and two norms."""
    layer = D * H * HD + 2 * D * KV * HD + H * HD * D + 3 * D * FFN + 2 * D
    return 2 * V * D + D + LAYERS * layer


def traced_step(rows: int, length: int):
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, rows, length)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    report = trace_comms(
        cpshard.value_and_grad(cpshard.make_cp_forward(model)), cpshard.params_of(model), batch, mesh
    )
    output, grads = report.result
    return (
        report.as_dict(),
        str(report),
        report.total_bytes,
        fingerprint(batch).numel() * 8,
        7 * 8,  # a first call agrees on the forward: its options, the parameters' count and kinds, the
        # config, how many are DTensors and their placements, the values
        output.loss.item(),
        sorted(grads) == sorted(cpshard.params_of(model)),
    )


def test_llama_cp2_bytes_by_hand(ranks2):
    rows, length, cp = 2, 13, 2
    local = rows * (length + 1) // cp  # 13 tokens padded to 14, 7 per rank
    q = out = local * H * HD * F32  # q and the output: every head of the rank's tokens
    k = v = local * KV * HD * F32  # cp=2 divides the 2 kv heads: none repeated
    per_module = q + k + v + out
    grads = llama_param_count() * F32
    for as_dict, text, total, fingerprint_bytes, agreement, loss, all_grads in ranks2.run(
        traced_step, rows, length
    ):
        assert all_grads and loss > 0
        checks = fingerprint_bytes + agreement  # the batch's fingerprint, the agreement's seven integers
        assert total == as_dict["total_bytes"] == LAYERS * 2 * per_module + grads + F32 + checks
        # per layer and direction: q, k and v in one all-to-all, the output in another
        assert as_dict["by_op"]["all_to_all"] == {"count": LAYERS * 2 * 2, "bytes": LAYERS * 2 * per_module}
        # value_and_grad: the loss rides with the gradients, one all-reduce after the backward
        assert as_dict["by_module"]["gradients"] == {"count": 1, "bytes": grads + F32}
        assert "loss" not in as_dict["by_module"]
        assert as_dict["matches_optimum"]
        attention = [g for g in as_dict["groups"] if g["op"] == "all_to_all"]
        assert [(g["module"], g["phase"]) for g in attention] == [
            (f"model.layers.{i}.self_attn", phase) for i in range(LAYERS) for phase in ("forward", "backward")
        ]
        for group in attention:
            assert (
                (group["count"], group["nbytes"])
                == (group["optimum_count"], group["optimum_bytes"])
                == (2, per_module)
            )
        lines = text.splitlines()
        row = next(
            line for line in lines if line.startswith("model.layers.1.self_attn") and "backward" in line
        )
        assert row.split() == [
            "model.layers.1.self_attn",
            "all_to_all",
            "backward",
            "2",
            f"{per_module:,}",
            "2",
            f"{per_module:,}",
            "ok",
        ]
        # + the agreement, the batch fingerprint, the gradients
        assert lines[-1].split() == ["total", str(LAYERS * 4 + 3), f"{total:,}"]


def traced_backward(rows: int, length: int, frozen: bool = False) -> tuple[bool, dict, int]:
    """A step by ``cp_forward(...).loss.backward()`` (the loss reduced in the forward): whether it meets the
    optimum, its gradients' group, and the model's count of parameters that require a gradient (``frozen``:
    all but the embeddings)."""
    model = tiny_model("llama")
    model.model.embed_tokens.weight.requires_grad_(not frozen)
    forward, mesh = cpshard.make_cp_forward(model), cpshard.make_mesh(cp=dist.get_world_size())

    def step(params, batch, mesh):
        forward(params, batch, mesh).loss.backward()

    report = trace_comms(
        step, cpshard.params_of(model), tiny_batch(model.config.vocab_size, rows, length), mesh
    )
    gradients = next(g for g in report.as_dict()["groups"] if g["module"] == "gradients")
    return report.matches_optimum, gradients, sum(p.requires_grad for p in model.parameters())


def test_backward_s_gradients_carry_which_ranks_reached_each_parameter(ranks2):
    """One element per parameter rides with the gradients (cpshard.comm.collectives._reached_sums), so that a
    parameter no rank reached keeps no gradient, as in one process; the optimum counts them."""
    for matches, gradients, count in ranks2.run(traced_backward, 2, 13):
        assert matches, gradients
        assert (gradients["count"], gradients["nbytes"]) == (1, llama_param_count() * F32 + count * F32)


def test_backward_s_optimum_counts_the_parameters_that_require_a_gradient(ranks2):
    """A frozen parameter (the embeddings here; most of a model under LoRA) has no gradient to sum:
    ``backward()`` reduces the others and their flags, and the optimum counts those (it counted every
    parameter, so a frozen model's trace said DIFFERS)."""
    for matches, gradients, count in ranks2.run(traced_backward, 2, 13, frozen=True):
        assert matches, gradients
        trained = llama_param_count() - V * D
        assert (gradients["count"], gradients["nbytes"]) == (1, trained * F32 + count * F32)
        assert gradients["nbytes"] == gradients["optimum_bytes"], gradients


def traced_forward_with_extra():
    """cp=4 over 2 kv heads (each repeated twice), forward only, plus one all-to-all the layout never
    asked for."""
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 1, 12)
    mesh = cpshard.make_mesh(cp=4)
    cp_forward = cpshard.make_cp_forward(model)

    def step():
        output = cp_forward(cpshard.params_of(model), batch, mesh)
        all_to_all(torch.zeros(4, 3), 0, 1, mesh.get_group("cp"), name="model.layers.0.self_attn extra")
        return output.loss

    report = trace_comms(step)
    return [
        (g.module, g.phase, g.count, g.nbytes, g.optimum_count, g.optimum_bytes, g.verdict)
        for g in report.groups
    ], report.matches_optimum


def test_kv_replication_and_an_extra_collective(ranks4):
    local = 1 * 12 // 4
    per_module = 2 * local * H * HD * F32 + 2 * local * (2 * KV) * HD * F32  # k, v: 2 kv heads -> 4
    extra = 4 * 3 * F32
    for groups, matches in ranks4.run(traced_forward_with_extra):
        attention = {g[0]: g[1:] for g in groups if g[0].startswith("model.layers.")}
        assert attention == {
            "model.layers.0.self_attn": ("forward", 3, per_module + extra, 2, per_module, "DIFFERS"),
            "model.layers.1.self_attn": ("forward", 2, per_module, 2, per_module, "ok"),
        }, "no backward ran, so no backward optimum either"
        assert not matches


def traced_step_under_tp(model_type: str):
    """A cp=2 x tp=2 step on parallelized parameters (a cp forward made, and its layout probed, before
    parallelizing: as a derived layout asks): the attention modules' all-to-alls."""
    model = tiny_model(model_type)
    batch = tiny_batch(model.config.vocab_size, 1, 12)
    cp_forward = cpshard.make_cp_forward(model)
    cp_forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=4))  # a derived layout's probe
    mesh = cpshard.make_mesh(cp=2, tp=2)
    params = cpshard.params_of(cpshard.parallelize(model, mesh))
    report = trace_comms(cpshard.value_and_grad(cp_forward), params, batch, mesh)
    attention = {
        (g.module, g.phase): (g.count, g.nbytes, g.verdict) for g in report.groups if g.op == "all_to_all"
    }
    tp = {  # the sums over tp
        (g.module, g.phase): (g.count, g.nbytes, g.verdict) for g in report.groups if g.module[:3] == "tp "
    }
    return attention, tp, report.matches_optimum


@pytest.mark.parametrize(
    "model_type, heads, kv_heads",
    [
        # llama's plan splits q, k and v over tp: each tp rank's 2 q heads and 1 kv head (repeated for cp)
        ("llama", H // 2, KV // 2 * 2),
        # Phi-3's fused qkv_proj: its derived plan leaves attention whole, every head on every tp rank
        ("phi3", H, KV),
    ],
)
def test_tp_splits_the_heads_that_the_optimum_counts(ranks4, model_type, heads, kv_heads):
    """The optimum counted every head of the model, and a correct llama step under tp was reported as
    differing; the sums over tp are counted too (before, listed without an optimum)."""
    local = 12 // 2
    per_module = 2 * local * heads * HD * F32 + 2 * local * kv_heads * HD * F32
    stream = local * D * F32  # one sum over tp of this rank's tokens of the residual stream
    for attention, tp, matches in ranks4.run(traced_step_under_tp, model_type):
        assert attention == {
            (f"model.layers.{i}.self_attn", phase): (2, per_module, "ok")
            for i in range(LAYERS)
            for phase in ("forward", "backward")
        }
        assert matches
        if model_type == "llama":  # the row-wise layers' outputs and the split blocks' input gradients
            assert tp == {
                ("tp self_attn.o_proj", "forward"): (LAYERS, LAYERS * stream, "ok"),
                ("tp mlp.down_proj", "forward"): (LAYERS, LAYERS * stream, "ok"),
                ("tp input", "backward"): (2 * LAYERS, 2 * LAYERS * stream, "ok"),
            }
        assert all(verdict == "ok" for _, _, verdict in tp.values()), tp  # phi3's derived plan splits none


def test_split_name_and_nothing_launched():
    modules = {"model.layers.0.self_attn", "lm_head"}
    assert split_name("model.layers.0.self_attn q", modules) == ("model.layers.0.self_attn", "q")
    assert split_name("lm_head tiles", modules) == ("lm_head", "tiles")
    assert split_name("batch fingerprint", modules) == ("batch fingerprint", "")
    assert split_name("loss", modules) == ("loss", "")
    report = trace_comms(lambda a, *, b: a + b, 2, b=3)
    assert report.result == 5 and report.total_bytes == 0 and report.groups == [] and report.matches_optimum
    assert report.as_dict()["by_op"] == {} and str(report).splitlines()[-1].split() == ["total", "0", "0"]


def traced_ring_step():
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 8)
    cp_forward = cpshard.make_cp_forward(model, implementation="ring")
    report = trace_comms(
        cpshard.value_and_grad(cp_forward), cpshard.params_of(model), batch, cpshard.make_mesh(cp=2)
    )
    return report.as_dict()


def test_ring_is_traced_without_claiming_a_ulysses_optimum(ranks2):
    for as_dict in ranks2.run(traced_ring_step):
        attention = [g for g in as_dict["groups"] if g["module"].startswith("model.layers.")]
        assert {g["module"] for g in attention} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
        assert "all_to_all" not in {g["op"] for g in attention} and all(
            g["optimum_bytes"] is None for g in attention
        )
        assert as_dict["matches_optimum"] and as_dict["total_bytes"] == sum(
            g["nbytes"] for g in as_dict["groups"]
        )


def traced_latent_attention(model_type: str) -> tuple[bool, list, int]:
    """Whether a latent-attention model's trace meets its optimum, its attention groups, and the bytes of
    q, k, v and the output worked out from its config by hand."""
    model = tiny_model(model_type)
    config, rows, length = model.config, 2, 8
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    batch = tiny_batch(config.vocab_size, rows, length)
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    step(cpshard.params_of(model), batch, mesh)  # the derived layout's probe runs here, untraced
    report = trace_comms(step, cpshard.params_of(model), batch, mesh)
    qk, v = config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    tokens, heads = rows * length // dist.get_world_size(), config.num_attention_heads
    by_hand = tokens * heads * (2 * qk + 2 * v) * F32  # q and k qk wide, v and the output v wide
    attention = [(g.module, g.phase, g.count, g.nbytes) for g in report.groups if g.op == "all_to_all"]
    return report.matches_optimum, attention, by_hand


def test_latent_attention_s_widths_are_in_its_optimum(ranks2):
    """MLA's q and k are nope + rope wide, its v and output v_head_dim wide (its config's head_dim is the
    rope part alone), which the optimum counts as the exchanges move them."""
    for matches, attention, by_hand in ranks2.run(traced_latent_attention, "deepseek_v3"):
        assert matches and attention, attention
        assert {(count, nbytes) for _, _, count, nbytes in attention} == {(2, by_hand)}, (attention, by_hand)
