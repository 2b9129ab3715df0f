"""Attention that selects its keys per query under cp (DeepSeek's: deepseek_v32, glm_moe_dsa, axk2,
dots3_note, hy_v4; Doge's dynamic mask; Kolibri 1.1's indexed layers): each rank's queries against the keys
gathered whole. Exact against the model's own code in one process (loss, logits, every gradient), the indexer
selecting the same set of keys for every real query (ties included: many scores are exactly 0 after its
ReLU), the bytes those of the key side alone; what it does not serve, refused on every rank."""

import pytest
import torch
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

import cpshard
from cpshard.attention import sparse
from cpshard.comm.record import recording
from cpshard.layouts.derive import derive_layout
from cpshard.spec.sequence import positions
from cpshard.tools.parity import beyond_own_rounding, check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model


def _model(model_type: str, topk: int, **config):
    """The tiny model with its indexer keeping ``topk`` keys per query (Doge: its dynamic mask keeping
    ``topk`` keys per head and query, beyond which it masks), ``config`` besides."""
    selection = "keep_window_size" if model_type == "doge" else "index_topk"
    return tiny_model(model_type, attn_implementation="auto", **{selection: topk}, **config)


def key_sets(output) -> list[list[set]]:
    """The keys an indexer selected for each row and query: from its top-k indices ``[B, T, k]``, or from
    Kolibri 1.1's ``(mask [B, 1, T, L], pool)``."""
    if isinstance(output, tuple):
        return [[set(query.nonzero().flatten().tolist()) for query in row] for row in output[0][:, 0]]
    return [[set(query.tolist()) for query in row] for row in output]


def selections(model, run) -> list[torch.Tensor]:
    """The keys the indexer of each layer selected for each row and query during ``run()``
    (:func:`key_sets`)."""
    found = []
    hooks = [
        module.register_forward_hook(lambda module, args, output: found.append(key_sets(output)))
        for name, module in model.named_modules()
        if name.endswith("indexer")
    ]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return found


def differing_selections(ours: list, theirs: list, batch: dict, order: str, length: int) -> list[tuple]:
    """``(layer, row, position)`` of every real query whose selected keys differ from one process's, among
    the keys it may see (a query that sees fewer keys than the top-k fills it with hidden ones, at -inf,
    whichever: the mask hides them again)."""
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    differing = []
    for layer, (mine, whole) in enumerate(zip(ours, theirs, strict=True)):
        held = positions(order, len(mine[0]) * cp, cp, rank).tolist()
        for row in range(len(mine)):
            for index, position in enumerate(held):
                if position >= length or not mask[row, position]:
                    continue
                seen = {key for key in range(position + 1) if mask[row, key]}
                if seen & mine[row][index] != seen & whole[row][position]:
                    differing.append((layer, row, position))
    return differing


def against_one_process(
    model_type: str,
    topk: int,
    length: int,
    pad: str | None,
    order: str,
    impl: str,
    config: dict | None = None,
) -> dict:
    config = config or {}
    model, mesh = _model(model_type, topk, **config), cpshard.make_mesh(cp=torch.distributed.get_world_size())
    own = _model(model_type, topk, **config)  # the model's own code, which cpshard never prepared
    batch = tiny_batch(model.config.vocab_size, 2, length, pad=pad)
    forward = cpshard.make_cp_forward(model, implementation=impl, sequence_order=order)
    params = cpshard.params_of(model)
    forward(params, batch, mesh)  # the derived layout's probe, unrecorded
    with recording() as log:
        failing = failing_rows([check_parity(own, batch, mesh, forward, params)])
    twin = _model(model_type, topk, **config)
    failing = beyond_own_rounding(twin, own, params, batch, mesh, forward, failing)
    ours = selections(model, lambda: forward(params, batch, mesh))
    with torch.no_grad():
        theirs = selections(own, lambda: own(**batch))
    gathered = {}
    for event in log.events:
        if event.name.endswith(("latent and rope key", "key and value", "indexer key")):
            gathered[event.op, event.phase] = gathered.get((event.op, event.phase), 0) + event.nbytes
    return {
        "failing": failing,
        "selections differ": differing_selections(ours, theirs, batch, order, length),
        "sparse": all(max(len(keys) for row in layer for keys in row) < length for layer in theirs),
        "gathered bytes": gathered,
        "local tokens": -(-length // torch.distributed.get_world_size()),
    }


#: Kolibri 1.1 with a third layer that reads the second's keys and values and selects from its pool
_KOLIBRI_SHARING = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "indexed_attention", "indexed_attention"],
    index_layers=[1],
    kv_source_layers=[0, 1, 1],
)
#: (type, top-k, L, padding, sequence order, implementation[, config]): head-tail (ring's) puts the gathered
#: keys out of sequence order, which the gather puts back
CASES = [
    ("deepseek_v32", 4, 37, "left", "contiguous", "ulysses"),
    ("deepseek_v32", 4, 37, None, "head_tail", "ring"),
    ("deepseek_v32", 16, 64, "left", "contiguous", "ulysses"),
    ("glm_moe_dsa", 4, 37, "left", "contiguous", "ulysses"),
    ("axk2", 4, 37, "left", "contiguous", "ulysses"),  # a gated output beside the same indexer
    ("dots3_note_text", 4, 37, "left", "contiguous", "ulysses"),  # sliding layers without an indexer
    ("doge", 8, 37, "left", "contiguous", "ulysses"),  # a dynamic mask per head from every key's value
    ("doge", 8, 37, None, "head_tail", "ring"),
    # sinks, a gate; its second layer reuses the top-k. Its hyper-connections' gradients (7e-4 at most)
    # cancel into fp32's own noise: 1.6e-5 of scale from one process's where one process is itself 3.5e-5
    # from float64 (beyond_own_rounding: cp no farther from float64 than twice one process)
    ("hy_v4", 4, 37, "left", "contiguous", "ulysses"),
    ("hy_v4", 4, 37, "left", "head_tail", "ring"),
    # NoPE indexed layers choosing blocks, then keys (sinks and local ones besides); the sliding layer is cp's
    ("kolibri1_1", 2, 37, "left", "contiguous", "ulysses"),
    ("kolibri1_1", 2, 37, "left", "head_tail", "ring"),
    # a third layer reusing the second's keys, values and pool of candidate keys
    ("kolibri1_1", 2, 37, "left", "contiguous", "ulysses", _KOLIBRI_SHARING),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_attention_is_exact_at_cp2(ranks2, case):
    for result in ranks2.run(against_one_process, *case):
        assert result["failing"] == [] and result["selections differ"] == [], result
        assert result["sparse"], result  # the indexer selects fewer keys than there are


@pytest.mark.parametrize("case", [("deepseek_v32", 4, 37, "left", "head_tail", "ring")], ids=str)
def test_sparse_attention_is_exact_at_cp4(ranks4, case):
    config = _model(case[0], case[1]).config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    for result in ranks4.run(against_one_process, *case):
        assert result["failing"] == [] and result["selections differ"] == [], result
        # per layer and rank (B = 2, fp32): its latent, rope key and indexer key all-gathered, the first two's
        # gradients reduce-scattered (every rank's, cp = 4); no hidden states, no queries
        per_token = 2 * 4 * result["local tokens"]
        layers = config.num_hidden_layers
        assert result["gathered bytes"] == {
            ("all_gather", "forward"): layers * per_token * (latent + config.index_head_dim),
            ("reduce_scatter", "backward"): layers * 4 * per_token * latent,
        }, result


def refusals() -> list[str]:
    messages = []
    model = _model("deepseek_v32", 4)
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    attempts = [
        lambda: cpshard.make_cp_forward(model)(
            cpshard.params_of(model), batch, cpshard.make_mesh(cp=2, tp=2)
        ),
        lambda: cpshard.make_cp_prefill(model),
        lambda: cpshard.make_cp_forward(model, compile="aot_eager")(
            cpshard.params_of(model), batch, cpshard.make_mesh(cp=4)
        ),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("no error")
        except (ValueError, cpshard.LayoutError) as error:
            messages.append(str(error))
    return messages


def test_what_sparse_attention_does_not_serve_is_refused_on_every_rank(ranks4):
    results = ranks4.run(refusals)
    assert all(result == results[0] for result in results), results
    tp, generation, compiled = results[0]
    assert tp.startswith("tp=2, ep=1, compile=False: cp serves the sparse attention of ('self_attn',)"), tp
    assert "its indexer selects keys per query over the whole cache" in generation, generation
    assert compiled.startswith("tp=1, ep=1, compile='aot_eager': cp serves the sparse attention"), compiled


class _UnreadIndexedAttention(DeepseekV32Attention):
    """DeepSeek's sparse attention under a class cpshard has not read: what its indexer selects is unknown."""


def test_the_derived_layout_names_the_sparse_attention_and_other_indexers_stay_refused():
    for model_type in ("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text", "hy_v4", "kolibri1_1"):
        assert derive_layout(_model(model_type, 4)).sparse_attention == ("self_attn",), model_type
    model = _model("deepseek_v32", 4)
    for layer in model.model.layers:
        layer.self_attn.__class__ = _UnreadIndexedAttention
    with pytest.raises(cpshard.LayoutError, match=r"layers.0.self_attn.indexer \(DeepseekV32Indexer.*not"):
        derive_layout(model)


def test_other_code_is_refused_at_setup(monkeypatch):
    module, _ = sparse.WRITTEN_AGAINST["DeepseekV32Attention"]
    monkeypatch.setitem(
        sparse.WRITTEN_AGAINST, "DeepseekV32Attention", (module, {"DeepseekV32Indexer": "0" * 16})
    )
    with pytest.raises(
        cpshard.LayoutError, match="DeepseekV32Attention .its keys gathered by cpshard.: cpshard"
    ):
        cpshard.make_cp_forward(_model("deepseek_v32", 4))
