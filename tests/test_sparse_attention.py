"""Attention that selects its keys per query under cp (DeepSeek's: deepseek_v32, glm_moe_dsa, axk2,
dots3_note, hy_v4; Doge's dynamic mask; Kolibri 1.1's indexed layers; DeepSeek-V4's compressed layers, whose
windows of tokens pool into keys): each rank's queries against the keys gathered whole. Exact against the
model's own code in one process (loss, logits, every gradient), the indexer selecting the same set of keys
(DeepSeek-V4's: compressed entries) for every real query (ties included: many scores are exactly 0 after its
ReLU), the bytes those of the key side alone; what it does not serve, refused on every rank."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention

import cpshard
from cpshard.attention import compressed, sparse
from cpshard.comm.record import recording
from cpshard.debug import trace_comms
from cpshard.layouts.derive import derive_layout
from cpshard.layouts.fingerprint import changed
from cpshard.spec.sequence import padded_length_for, positions
from cpshard.tools.parity import beyond_own_rounding, check_parity, failing_rows, reference
from cpshard.tools.tiny import tiny_batch, tiny_model


def _model(model_type: str, topk: int, **config):
    """The tiny model with its indexer keeping ``topk`` keys per query (Doge: its dynamic mask keeping
    ``topk`` keys per head and query, beyond which it masks), ``config`` besides. DeepSeek-V4's sinks and
    its compressors' position biases, which start at 0, drawn (the same on every process)."""
    selection = "keep_window_size" if model_type == "doge" else "index_topk"
    model = tiny_model(model_type, attn_implementation="auto", **{selection: topk}, **config)
    if model_type == "deepseek_v4":
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(("sinks", "position_bias")):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


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


def _seen(config, mask: torch.Tensor, row: int, position: int) -> set:
    """What the query at ``position`` may see among what its indexer selects from: the keys up to it that
    are not padding, or DeepSeek-V4's compressed entries whose window closed at or before it (padding pooled
    in as one process pools it)."""
    if config.model_type == "deepseek_v4":
        return set(range((position + 1) // config.compress_rates["compressed_sparse_attention"]))
    return {key for key in range(position + 1) if mask[row, key]}


def differing_selections(
    ours: list, theirs: list, batch: dict, order: str, length: int, config
) -> list[tuple]:
    """``(layer, row, position)`` of every real query whose selected keys differ from one process's, among
    the keys it may see (a query that sees fewer keys than the top-k fills it with hidden ones, at -inf,
    whichever: the mask hides them again; DeepSeek-V4's indexer marks those -1)."""
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    differing = []
    for layer, (mine, whole) in enumerate(zip(ours, theirs, strict=True)):
        held = positions(order, len(mine[0]) * cp, cp, rank).tolist()
        for row in range(len(mine)):
            for index, position in enumerate(held):
                if position >= length or not mask[row, position]:
                    continue
                seen = _seen(config, mask, row, position)
                if seen & mine[row][index] != seen & whole[row][position]:
                    differing.append((layer, row, position))
    return differing


def parameters_off(own, forward, params: dict, batch: dict, mesh) -> dict[str, float]:
    """DeepSeek-V4's compressors', indexers' and sinks' parameters whose gradient lies more than 1e-5 of its
    own scale off one process's, each alone (check_parity's rows hold a layer's attention together), with
    how far; an indexer's gradient is 0 on both sides (its top-k is not differentiable), exactly."""
    _, _, theirs = reference(own, params, batch)
    _, ours = cpshard.value_and_grad(forward)(params, batch, mesh)
    off = {}
    for name, gradient in theirs.items():
        if "compressor" in name or name.endswith("sinks"):
            scale, difference = gradient.abs().max().item(), (ours[name] - gradient).abs().max().item()
            if difference > 1e-5 * scale or (".indexer." in name) != (scale == 0.0):
                off[name] = difference / (scale or 1.0)
    return off


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
    sparse = all(max(len(keys) for row in layer for keys in row) < length for layer in theirs)
    if model_type == "deepseek_v4":  # its last queries see more compressed entries than its indexer keeps
        rate = model.config.compress_rates["compressed_sparse_attention"]
        sparse = sparse and model.config.index_topk < length // rate
    gathered = {}
    for event in log.events:
        if event.name.endswith((" key", "key and value", "tokens and gates", "entries")):
            gathered[event.op, event.phase] = gathered.get((event.op, event.phase), 0) + event.nbytes
    return {
        "failing": failing,
        "parameters off": parameters_off(own, forward, params, batch, mesh)
        if model_type == "deepseek_v4"
        else {},
        "selections differ": differing_selections(ours, theirs, batch, order, length, model.config),
        "sparse": sparse,
        "selecting layers": len(theirs),
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
#: DeepSeek-V4's compressed layers without its sliding one
_V4_COMPRESSED = dict(
    num_hidden_layers=2, layer_types=["compressed_sparse_attention", "heavily_compressed_attention"]
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
    # the tiny config's sliding layer (cp's Ulysses), CSA layer (windows of 3 pooled, its indexer keeping 2 of
    # the 12) and HCA layer (windows of 4): 37 tokens, off both grids, windows across the ranks' boundary
    ("deepseek_v4", 2, 37, "left", "contiguous", "ulysses"),
    # 35 tokens padded to 36 for cp: padding pooled in, each compressor would have a window more
    ("deepseek_v4", 2, 35, None, "contiguous", "ulysses"),
    # its compressed layers alone under ring's head-tail order (a sliding layer's sinks refuse the ring)
    ("deepseek_v4", 2, 37, "left", "head_tail", "ring", _V4_COMPRESSED),
]


def _check(result: dict, model_type: str) -> None:
    assert result["failing"] == [] and result["selections differ"] == [], result
    assert result["parameters off"] == {}, result
    # the indexer ran (Doge's dynamic mask has none) and selects fewer keys than there are
    assert result["selecting layers"] > 0 or model_type == "doge", result
    assert result["sparse"], result


@pytest.mark.parametrize("case", CASES, ids=str)
def test_sparse_attention_is_exact_at_cp2(ranks2, case):
    for result in ranks2.run(against_one_process, *case):
        _check(result, case[0])


@pytest.mark.parametrize("case", [("deepseek_v32", 4, 37, "left", "head_tail", "ring")], ids=str)
def test_sparse_attention_is_exact_at_cp4(ranks4, case):
    config = _model(case[0], case[1]).config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    for result in ranks4.run(against_one_process, *case):
        _check(result, case[0])
        # per layer and rank (B = 2, fp32): its latent, rope key and indexer key all-gathered, the first two's
        # gradients reduce-scattered (every rank's, cp = 4); no hidden states, no queries
        per_token = 2 * 4 * result["local tokens"]
        layers = config.num_hidden_layers
        assert result["gathered bytes"] == {
            ("all_gather", "forward"): layers * per_token * (latent + config.index_head_dim),
            ("reduce_scatter", "backward"): layers * 4 * per_token * latent,
        }, result


#: DeepSeek-V4 with windows of 4 tokens in both compressed layers (2 CSA entries of 11 tokens, its indexer
#: keeping 1): at cp 4 each rank holds 3 tokens, shorter than a window (head-tail: chunks of 2 of 16)
_V4_SHORT = dict(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 4})


def compressed_bytes(config, local: int, csa: tuple[int, int], hca: tuple[int, int]) -> dict:
    """Per rank (B = 2, fp32), its sliding layer apart (Ulysses), at cp 4: each compressed layer's key
    (``local`` tokens of head_dim); each compressor's halo (``csa`` / ``hca``: its tokens, then its entry
    slots), of its tokens and gates (CSA's: 2 x head_dim each; HCA's: head_dim each; the indexer's, with CSA's
    halo: 2 x index_head_dim each); each compressor's entries (head_dim; the indexer's index_head_dim),
    all-gathered; the keys', the compressors' halos' and entries' gradients reduce-scattered (every rank's),
    the indexer's none."""
    key, index, element = config.head_dim, config.index_head_dim, 2 * 4
    (csa_halo, csa_slots), (hca_halo, hca_slots) = csa, hca
    csa_sent = local * key + csa_halo * 4 * key + csa_slots * key
    hca_sent = local * key + hca_halo * 2 * key + hca_slots * key
    indexer = csa_halo * 4 * index + csa_slots * index
    return {
        ("all_gather", "forward"): element * (csa_sent + indexer + hca_sent),
        ("reduce_scatter", "backward"): element * 4 * (csa_sent + hca_sent),
    }


@pytest.mark.parametrize(
    "case, halos",
    [
        # 36 for cp (a window more if pooled), 9 a rank: CSA's halo min(9, 2 x 3 - 1) tokens and at most 3 of
        # its 11 windows a rank; HCA's min(9, 4 - 1) and 2 of 8
        (("deepseek_v4", 2, 35, "left", "contiguous", "ulysses"), ((5, 3), (3, 2))),
        # 3 tokens a rank: the whole slice is each halo; 2 windows each, one a rank at most (two ranks none)
        (("deepseek_v4", 1, 11, "left", "contiguous", "ulysses", _V4_SHORT), ((3, 1), (3, 1))),
        (("deepseek_v4", 2, 37, None, "head_tail", "hybrid", _V4_COMPRESSED), None),  # 40 for cp
        (("deepseek_v4", 1, 11, None, "head_tail", "ring", {**_V4_COMPRESSED, **_V4_SHORT}), None),
    ],
    ids=str,
)
def test_compressed_attention_is_exact_at_cp4(ranks4, case, halos):
    config = _model(case[0], case[1], **(case[6] if len(case) > 6 else {})).config
    for result in ranks4.run(against_one_process, *case):
        _check(result, case[0])
        if halos:
            assert result["gathered bytes"] == compressed_bytes(config, result["local tokens"], *halos), (
                result
            )


@pytest.mark.parametrize("order", ["contiguous", "head_tail", "striped"])
@pytest.mark.parametrize(
    "size, length, rate", [(2, 37, 3), (4, 11, 4), (4, 35, 3), (4, 37, 5), (3, 1000, 128)]
)
@pytest.mark.parametrize("overlap", [True, False])
def test_each_window_is_pooled_once_from_its_own_tokens(order, size, length, rate, overlap):
    """:func:`~cpshard.attention.compressed.window_plan` on sizes alone, each rank's slice standing for its
    tokens' positions: each rank pools whole windows of the tokens, at their positions; a window it keeps
    follows the window before it (where windows overlap; the first pooled gets no overlap, so it is window 0
    or one dropped); every window of the first ``length`` tokens is kept by one rank, at its place in
    window order."""
    padded = padded_length_for(length, size, order)
    held = [positions(order, padded, size, rank) for rank in range(size)]
    plans = [compressed.window_plan(order, padded, size, r, length, rate, overlap) for r in range(size)]
    halo = torch.cat([mine[plan.tails] for mine, plan in zip(held, plans)])
    entries = torch.full((size, plans[0].slots), -1)
    for rank, (mine, plan) in enumerate(zip(held, plans)):
        pooled = torch.cat([halo, mine])[plan.take].view(-1, rate)
        starts = plan.first_positions + rate * torch.arange(len(pooled))
        assert (pooled == starts[:, None] + torch.arange(rate)).all(), (rank, pooled, starts)
        windows = pooled[:, 0] // rate
        for index in plan.keep.tolist():
            follows = index > 0 and windows[index - 1] == windows[index] - 1
            assert follows or windows[index] == 0 or not overlap, (rank, windows, plan.keep)
        assert overlap or len(plan.keep) == len(windows), (rank, windows, plan.keep)
        entries[rank, : len(plan.keep)] = windows[plan.keep]
    assert (entries.flatten()[plans[0].order] == torch.arange(length // rate)).all(), entries


def attention_verdicts(model_type: str) -> list[tuple]:
    """``trace_comms``' verdict on each attention module's collectives (op, phase) of a training step: the
    sparse layers' gathers against the count they declare, the others' Ulysses exchanges against its."""
    model, mesh = _model(model_type, 4), cpshard.make_mesh(cp=2)
    batch = tiny_batch(model.config.vocab_size, 2, 37, pad="left")
    forward, params = cpshard.make_cp_forward(model), cpshard.params_of(model)
    forward(params, batch, mesh)  # the derived layout's probe, untraced
    report = trace_comms(lambda: cpshard.value_and_grad(forward)(params, batch, mesh))
    return sorted((g.module, g.op, g.phase, g.verdict) for g in report.groups if "self_attn" in g.module)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "deepseek_v4"])
def test_trace_comms_counts_the_gathered_keys_and_no_exchange_beside_them(ranks2, model_type):
    for verdicts in ranks2.run(attention_verdicts, model_type):
        assert verdicts and all(verdict == "ok" for *_, verdict in verdicts), verdicts
        ulysses = sorted({module for module, op, *_ in verdicts if op == "all_to_all"})
        assert ulysses == (["model.layers.0.self_attn"] if model_type == "deepseek_v4" else []), verdicts


def kept_for_the_backward(under_cp: bool) -> list[tuple]:
    """The shapes of the tensors autograd keeps for the backward in DeepSeek-V4's training step (37 tokens,
    left-padded): under cp, or of the model on this process alone."""
    model, mesh = _model("deepseek_v4", 2), cpshard.make_mesh(cp=2)
    batch = tiny_batch(model.config.vocab_size, 2, 37, pad="left")
    forward, params = cpshard.make_cp_forward(model), cpshard.params_of(model)
    forward(params, batch, mesh)  # the derived layout's probe
    kept = []

    def pack(tensor):
        kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if under_cp:
            cpshard.value_and_grad(forward)(params, batch, mesh)
        else:
            reference(model, params, batch)
    return kept


def test_the_indexer_keeps_nothing_for_a_backward_under_cp(ranks2):
    """DeepSeek-V4's lightning indexer returns the integer indices of a top-k, so no gradient reaches what it
    computes; under cp it runs without autograd and its scores ``[B, L/cp, index heads, entries]`` are not
    kept for the backward (one process keeps them)."""
    config = _model("deepseek_v4", 2).config
    entries = 37 // config.compress_rates["compressed_sparse_attention"]
    scores = lambda shape: len(shape) == 4 and shape[2:] == (config.index_n_heads, entries)  # noqa: E731
    for kept in ranks2.run(kept_for_the_backward, False):
        assert any(scores(shape) for shape in kept), kept
    for kept in ranks2.run(kept_for_the_backward, True):
        assert not any(scores(shape) for shape in kept), [shape for shape in kept if scores(shape)]


def without_gradient(fsdp: int) -> tuple[list[str], list[str]]:
    """The parameters that keep no ``.grad`` after ``loss.backward()`` of DeepSeek-V3.2 (37 tokens,
    left-padded) on this process alone, and under cp (its parameters sharded over ``fsdp`` ranks beside)."""
    own, model = _model("deepseek_v32", 4), _model("deepseek_v32", 4)
    batch = tiny_batch(own.config.vocab_size, 2, 37, pad="left")
    own(**batch, use_cache=False).loss.backward()
    forward = cpshard.make_cp_forward(model)
    forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))  # the derived layout's probe
    mesh = cpshard.make_mesh(fsdp=fsdp, cp=2 // fsdp)
    parallel = cpshard.parallelize(model, mesh) if fsdp > 1 else model
    forward(cpshard.params_of(parallel), batch, mesh).loss.backward()
    return _without_grad(own), _without_grad(parallel)


def _without_grad(model) -> list[str]:
    return sorted(name for name, parameter in model.named_parameters() if parameter.grad is None)


@pytest.mark.parametrize("fsdp", [1, 2], ids=["cp2", "fsdp2xcp1"])
def test_parameters_no_loss_reaches_keep_no_gradient_as_in_one_process(ranks2, fsdp):
    """DeepSeek-V3.2's indexer is reached by no loss (its top-k indices carry no gradient): one process leaves
    its ``.grad`` None, and cp left zeros there, which AdamW's weight decay then moved (2e-3 after two steps,
    every other weight within 7e-6), where one process's AdamW skips them."""
    for own, under_cp in ranks2.run(without_gradient, fsdp):
        assert own and all(".indexer." in name for name in own), own
        assert under_cp == own, (under_cp, own)


def refusals(model_type: str) -> list[str]:
    """The messages of tp, generation and compile beside the model's sparse attention, then of ring (for
    DeepSeek-V4, whose sliding layer has sinks: Ulysses only; its compressed layers gather their keys), each
    on a model of its own."""
    messages = []
    batch = tiny_batch(_model(model_type, 4).config.vocab_size, 2, 16)
    attempts = [
        lambda model: cpshard.make_cp_forward(model)(
            cpshard.params_of(model), batch, cpshard.make_mesh(cp=2, tp=2)
        ),
        lambda model: cpshard.make_cp_prefill(model),
        lambda model: cpshard.make_cp_forward(model, compile="aot_eager")(
            cpshard.params_of(model), batch, cpshard.make_mesh(cp=4)
        ),
        lambda model: cpshard.make_cp_forward(model, implementation="ring")(
            cpshard.params_of(model), batch, cpshard.make_mesh(cp=4)
        ),
    ]
    counters.clear()
    for attempt in attempts:
        try:
            attempt(_model(model_type, 4))
            messages.append("no error")
        except (ValueError, cpshard.LayoutError) as error:
            messages.append(str(error))
    return [*messages, counters["frames"]["total"]]  # frames compiled: refused before the probe compiled


@pytest.mark.parametrize("model_type", ["deepseek_v32", "deepseek_v4"])
def test_what_sparse_attention_does_not_serve_is_refused_on_every_rank(ranks4, model_type):
    results = ranks4.run(refusals, model_type)
    assert all(result == results[0] for result in results), results
    tp, generation, compiled, ring, frames_compiled = results[0]
    assert frames_compiled == 0, frames_compiled  # the probe compiled a dozen frames (12 s) first before
    assert tp.startswith("tp=2, ep=1, compile=False: cp serves the sparse attention of ('self_attn',)"), tp
    assert compiled.startswith("tp=1, ep=1, compile='aot_eager': cp serves the sparse attention"), compiled
    if model_type == "deepseek_v32":
        assert "its indexer selects keys per query over the whole cache" in generation, generation
        assert ring == "no error", ring
    else:
        assert "its compressors pool windows of tokens into keys" in generation, generation
        assert ring.startswith("model.layers.0.self_attn: the ring's merge has no place for the per-head"), (
            ring
        )


class _UnreadIndexedAttention(DeepseekV32Attention):
    """DeepSeek's sparse attention under a class cpshard has not read: what its indexer selects is unknown."""


def test_the_derived_layout_names_the_sparse_attention_and_other_indexers_stay_refused():
    for model_type in (
        *("deepseek_v32", "glm_moe_dsa", "axk2", "dots3_note_text", "hy_v4", "kolibri1_1", "deepseek_v4"),
    ):
        assert derive_layout(_model(model_type, 4)).sparse_attention == ("self_attn",), model_type
    # DeepSeek-V4 with sliding layers only selects no keys: cp's ordinary attention (Ulysses, compiled too)
    sliding = _model("deepseek_v4", 4, layer_types=["sliding_attention"] * 3)
    assert derive_layout(sliding).sparse_attention == ()
    model = _model("deepseek_v32", 4)
    for layer in model.model.layers:
        layer.self_attn.__class__ = _UnreadIndexedAttention
    with pytest.raises(cpshard.LayoutError, match=r"layers.0.self_attn.indexer \(DeepseekV32Indexer.*not"):
        derive_layout(model)


@pytest.mark.parametrize(
    "model_type, piece",
    [
        ("deepseek_v32", "DeepseekV32Indexer"),
        ("deepseek_v4", "DeepseekV4Attention"),
        ("deepseek_v4", "DeepseekV4HCACompressor"),
        ("deepseek_v4", "DeepseekV4CSACompressor"),
        ("deepseek_v4", "DeepseekV4Indexer"),
        ("deepseek_v4", "DeepseekV4HCACache.store_compression_weights"),
        ("deepseek_v4", "DeepseekV4CSACache.update_overlap_state"),
    ],
)
def test_other_code_is_refused_at_setup(monkeypatch, model_type, piece):
    model = _model(model_type, 4)
    name = type(model.model.layers[-1].self_attn).__name__
    module, pieces = sparse.WRITTEN_AGAINST[name]
    assert piece in pieces
    monkeypatch.setitem(sparse.WRITTEN_AGAINST, name, (module, {**pieces, piece: "0" * 16}))
    with pytest.raises(cpshard.LayoutError, match=f"{name} .its keys gathered by cpshard.: cpshard.*{piece}"):
        cpshard.make_cp_forward(model)


def test_what_cpshard_rewrites_was_written_for_the_installed_transformers():
    for name, (module, pieces) in sparse.WRITTEN_AGAINST.items():
        assert changed(module, pieces) == [], name
