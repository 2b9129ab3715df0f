"""Linear-attention and state-space layers under cp (Gated DeltaNet: qwen3_next, qwen3_5_text, olmo_hybrid;
KDA: kimi_linear; lightning attention: minimax; Mamba2: bamba, granitemoehybrid, nemotron_h, falcon_h1,
zamba2; Mamba1, split over channels: jamba, falcon_mamba; LFM2's short convolutions: lfm2_moe; RG-LRU:
recurrent_gemma; RWKV: rwkv; xLSTM's mLSTM: xlstm; ZAYA's convolving attention projection: zaya; Inkling's
convolutions and relative position bias: inkling_text),
served by state passing and a convolution halo: loss, logits and every gradient against the model's own
code in one process (a second model on the same weights that cpshard never touched), at cp 2 and 4, with
two kernel chunks of 64 per rank, plain, left- and right-padded batches, and value heads that cp does not
divide; with inputs_embeds, the model's activation checkpointing, logits=False and FSDP2 x cp; the
summaries and halos are really exchanged; what is not served yet is refused on every rank.

The chunked kernel's fp32 rounding depends on where its chunks start: one process differs from itself by
about 2e-5 of its logits between chunks of 64 and 32. Where each rank's slice starts on the chunk grid,
cp is exact at 1e-5; where it does not (a length cp*64 does not divide), cp lies within that same
variation of the one process, which the test measures on the batch.
"""

import importlib

import pytest
import torch

import cpshard
from cpshard.comm.record import recording
from cpshard.layouts.derive import derive_layout
from cpshard.layouts.qwen3_next import LAYOUT as QWEN3_NEXT
from cpshard.layouts.registry import resolve_layout
from cpshard.recurrent.affine import stabilised_fold
from cpshard.tools.layout_file import layout_for
from cpshard.tools.parity import check_parity, failing_rows, reference, tensor_group
from cpshard.tools.tiny import tiny_batch, tiny_model

#: (model type, config overrides): qwen3_next's registered file, the others derived and probed
MODELS = {
    "qwen3_next": {},
    "qwen3_next-3-value-heads": {"linear_num_key_heads": 1, "linear_num_value_heads": 3},
    "qwen3_5_text": {},
    "olmo_hybrid": {},
    "kimi_linear": {},
    "minimax": {},  # lightning attention: no convolution, a constant decay
    "bamba": {},  # Mamba2's SSD: a scalar decay per head
    "granitemoehybrid": {},
    "granitemoehybrid-rope": {"position_embedding_type": "rope"},  # its file cuts a rotary pair it may get
    "nemotron_h": {},  # Mamba2, MoE, attention and MLP layers
    "nemotron_h-3-heads": {"mamba_num_heads": 3, "n_groups": 1},
    "nemotron_h-1-group": {"n_groups": 1},
    "falcon_h1": {},  # attention and a Mamba2 mixer side by side in every layer
    "zamba2": {},  # Mamba2 layers, and hybrid layers with a shared attention block before a Mamba2 mixer
    "lfm2_moe": {},  # LFM2's short convolution alone: a halo, no state
    "jamba": {},  # Mamba1's selective scan, split over channels
    "falcon_mamba": {"attn_implementation": "auto"},  # Mamba1 layers only (no attention to implement)
    "recurrent_gemma": {},  # RG-LRU: a decay per channel; its scan a method, its convolution a module
    "rwkv": {"attn_implementation": "auto"},  # RWKV's WKV (a running max beside its state), token shifts
    "xlstm": {"attn_implementation": "auto"},  # mLSTM: a matrix memory, its stabiliser folded across ranks
    "zaya": {},  # attention whose projection convolves q and k and delays half of v: halos, no state
    # four convolutions a layer, attention with a relative bias per query and a log scale per position
    # (a window of 5 and a bias reach of 6: shorter than a rank's slice; then longer than one)
    "inkling_text": {},
    "inkling_text-long-reach": {"sliding_window_size": 160, "rel_extent": 200},
    # as Inkling, beside a stack of block states the decoder keeps (cut where the sequence enters it);
    # Inkling2-Loop runs its middle layers in three passes
    "inkling2_text": {"attn_implementation": "auto"},
    "inkling2_text-long-reach": {
        "attn_implementation": "auto",
        "sliding_window_size": 160,
        "rel_extent": 200,
    },
    "inkling2_loop_text": {"attn_implementation": "auto"},
}
CHUNK = 64  # the torch kernels' chunk
#: the models that pass no state between ranks: a convolution alone, Mamba1 split over channels
SPLIT_OVER_CHANNELS = ("jamba", "falcon_mamba")
STATELESS = (
    *("lfm2_moe", "zaya", "inkling_text", "inkling_text-long-reach"),
    *("inkling2_text", "inkling2_text-long-reach", "inkling2_loop_text", *SPLIT_OVER_CHANNELS),
)
#: the models whose recurrent layers have no convolution or token shift (no halo)
NO_CONVOLUTION = ("minimax", "xlstm")


def _model(name: str):
    return tiny_model(name.split("-")[0], **MODELS[name])


def failing_against_own_code(name: str, length: int, pad: str | None, recurrent: str = "auto") -> dict:
    """The rows that differ from one process, and how many state gathers, halo sends and head-split
    exchanges ran."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    own, prepared = _model(name), _model(name)
    cp_forward = cpshard.make_cp_forward(prepared, recurrent=recurrent)
    batch = tiny_batch(own.config.vocab_size, 2, length, pad=pad)
    cp_forward(cpshard.params_of(prepared), batch, mesh)  # a derived layout's probe runs here, unrecorded
    with recording() as log:
        failing = failing_rows([check_parity(own, batch, mesh, cp_forward)])
    names = log.count_by("name")
    return {
        "failing": failing,
        "state gathers": sum(n for key, n in names.items() if key.endswith(" state")),
        "halo sends": sum(n for key, n in names.items() if key.endswith(" halo")),
        "head exchanges": sum(
            n for key, n in names.items() if " chunk_" in key and {"q", "output"} & set(key.split())
        ),
        "channel exchanges": sum(n for key, n in names.items() if " selective_scan_fn " in key),
        "ssd head exchanges": sum(
            n
            for key, n in names.items()
            if " mamba_chunk_scan_combined " in key and {"x", "output"} & set(key.split())
        ),
    }


@pytest.mark.parametrize("pad", [None, "left"])
@pytest.mark.parametrize("name", MODELS)
def test_linear_attention_is_exact_at_cp2(ranks2, name, pad):
    for rank, result in enumerate(ranks2.run(failing_against_own_code, name, 2 * 2 * CHUNK, pad)):
        assert result["failing"] == [], (rank, result)
        # forward and backward, on every linear layer (one in the tiny models): the chain really ran
        assert result["state gathers"] >= (0 if name in STATELESS else 2), (rank, result)
        assert (result["halo sends"] >= 1) == (name not in NO_CONVOLUTION), (rank, result)
        if name in SPLIT_OVER_CHANNELS:  # x, dt and z together, then the output, forward and backward
            assert result["channel exchanges"] >= 4, (rank, result)
        else:
            assert result["head exchanges"] == 0, (rank, result)  # auto: state passing moves fewer bytes


@pytest.mark.parametrize(
    "name, length",
    [
        *(("qwen3_next", 13), ("olmo_hybrid", 13), ("kimi_linear", 13)),
        # qwen3_next at this length: see test_off_the_chunk_grid_cp_is_within_the_kernel_s_own_rounding
        *(("olmo_hybrid", 2 * 2 * CHUNK + 3), ("kimi_linear", 2 * 2 * CHUNK + 3)),
    ],
)
def test_the_head_split_is_exact_at_cp2(ranks2, name, length):
    """The model's kernel on whole sequences for half the heads: one process's chunks, so exact at any
    length; at 7 tokens a rank it is also what "auto" takes (fewer bytes than the summaries)."""
    for recurrent in ("head_split", "auto") if length == 13 else ("head_split",):
        for rank, result in enumerate(ranks2.run(failing_against_own_code, name, length, "left", recurrent)):
            assert result["failing"] == [], (recurrent, rank, result)
            # the kernel's inputs together, then the output, forward and backward
            assert result["head exchanges"] >= 4 and result["state gathers"] == 0, (recurrent, rank, result)


@pytest.mark.parametrize("length", [2 * 2 * CHUNK + 3, 13])
@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h-1-group"])
def test_the_mamba2_head_split_is_exact_at_cp2(ranks2, name, length):
    """The model's scan on whole sequences for half the heads, B and C split with their groups (two) or
    gathered whole (one group); at 7 tokens a rank "auto" takes it too (fewer bytes than the summaries)."""
    for recurrent in ("head_split", "auto") if length == 13 else ("head_split",):
        for rank, result in enumerate(ranks2.run(failing_against_own_code, name, length, "left", recurrent)):
            assert result["failing"] == [], (recurrent, rank, result)
            assert result["ssd head exchanges"] >= 4 and result["state gathers"] == 0, (
                recurrent,
                rank,
                result,
            )


def test_the_mamba2_head_split_is_exact_at_cp4_with_fewer_groups_than_ranks(ranks4):
    for result in ranks4.run(failing_against_own_code, "nemotron_h", 4 * 2 * CHUNK, "left", "head_split"):
        assert result["failing"] == [] and result["ssd head exchanges"] >= 4, result


@pytest.mark.parametrize(
    "name, length",
    [
        ("qwen3_next-3-value-heads", 4 * 2 * CHUNK),
        ("nemotron_h-3-heads", 4 * 2 * CHUNK),
        ("recurrent_gemma", 4 * 2 * CHUNK),
        ("rwkv", 4 * 16),  # no chunk grid; its recurrence loops over tokens in Python, twice under cp
        ("xlstm", 4 * 2 * CHUNK),
        ("zaya", 4 * 2 * CHUNK),
        ("inkling_text", 4 * 2 * CHUNK),
        ("inkling_text-long-reach", 4 * 2 * CHUNK),
        ("inkling2_text", 4 * 2 * CHUNK),
        ("inkling2_loop_text", 4 * 2 * CHUNK),
    ],
)
def test_recurrent_layers_are_exact_at_cp4(ranks4, name, length):
    """Heads that cp does not divide; summaries folded over four ranks."""
    for result in ranks4.run(failing_against_own_code, name, length, "left"):
        assert result["failing"] == [], result


@pytest.mark.parametrize("name", ["qwen3_next", "kimi_linear", "minimax", "nemotron_h"])
def test_state_passing_over_many_chunks_a_rank_is_exact(ranks4, name):
    """A long sequence, left-padded: 8 chunks a rank at cp=4. Each rank's summary folds many chunks and
    the states pass through three ranks: an error that builds up along the sequence or across ranks
    would show here, not at a chunk or two a rank."""
    for result in ranks4.run(failing_against_own_code, name, 4 * 8 * CHUNK, "left", "state_passing"):
        assert result["failing"] == [] and result["state gathers"] >= 2, result


def _rows(loss, logits, grads) -> dict:
    rows = {"loss": loss, "logits": logits}
    for name, grad in grads.items():
        rows.setdefault("grad " + tensor_group(name), []).append(grad)
    return rows


def _largest_differences(a: dict, b: dict) -> dict:
    return {
        row: max(
            (x - y).abs().max().item()
            for x, y in zip(*(v if isinstance(v, list) else [v] for v in (a[row], b[row])))
        )
        for row in a
    }


def against_the_kernel_s_own_variation(name: str, length: int, recurrent: str) -> dict:
    """Per row: cp's largest difference from one process, and one process's between chunks of 64 and 32."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    own, prepared = _model(name), _model(name)
    batch = tiny_batch(own.config.vocab_size, 2, length, pad="left")
    params = cpshard.params_of(own)
    whole, other_chunks = reference(own, params, batch), reference(own, params, {**batch, "chunk_size": 32})
    output, grads = cpshard.value_and_grad(cpshard.make_cp_forward(prepared, recurrent=recurrent))(
        cpshard.params_of(prepared), batch, mesh
    )
    cp = (output.loss.detach(), output.logits.full_tensor().detach(), grads)
    rows = [_rows(*run) for run in (whole, other_chunks, cp)]
    zeros = {
        row: [torch.zeros_like(x) for x in v] if isinstance(v, list) else 0 * v for row, v in rows[0].items()
    }
    return {
        "cp": _largest_differences(rows[2], rows[0]),
        "kernel": _largest_differences(rows[1], rows[0]),
        "scale": _largest_differences(rows[0], zeros),
    }


@pytest.mark.parametrize("recurrent", ["state_passing", "head_split"])
def test_off_the_chunk_grid_cp_is_within_the_kernel_s_own_rounding(ranks2, recurrent):
    """State passing: rank 1's chunks start off one process's grid. The head split keeps the grid, but its
    kernel's fp32 sums over half the heads differ from one process's by rounding (1e-6 of the linear
    layer's output), which qwen3_next's MoE router amplifies at one token to 1.01e-5 of the logits' scale
    on some CPUs: within the kernel's own variation, far from an error's size. Beside it, 1e-7 or a few fp32
    ulps of the row's largest value: where the kernel's variation happens to round to none (the loss, one
    number, on a CPU without AVX2), cp's may still be one ulp of it."""
    length = 2 * 2 * CHUNK + 3  # odd: cp pads it to 2 x 130, so rank 1's chunks start at 130, not 128
    ulp = torch.finfo(torch.float32).eps
    for result in ranks2.run(against_the_kernel_s_own_variation, "qwen3_next", length, recurrent):
        kernel, scale = result["kernel"], result["scale"]
        assert kernel["logits"] > 0  # the variation is real (else the bound below would be vacuous)
        for row, difference in result["cp"].items():
            slack = max(1e-7, 4 * ulp * scale[row])
            assert difference <= 2 * kernel[row] + slack, (row, difference, kernel[row])


def refusal(name: str, length: int, **options) -> str:
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    model = _model(name)
    packed = options.pop("packed", False)
    try:
        cp_forward = cpshard.make_cp_forward(model, **options)
        batch = tiny_batch(model.config.vocab_size, 2, length, packed=packed)
        cp_forward(cpshard.params_of(model), batch, mesh)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "length, options, words",
    [
        (16, {"sequence_order": "head_tail"}, ["sequence_order='head_tail'", "contiguous"]),
        (
            16,
            {"compile": "aot_eager"},
            ["compile='aot_eager'", "linear_attn", "the cp forward without compile"],
        ),
        (4, {}, ["holds 2 positions", "fewer than the 3", "at least 3 tokens per cp rank"]),
        (16, {"packed": True}, ["packed documents", "(linear_attn) carry", "one document per row"]),
        (16, {"recurrent": "sideways"}, ["recurrent='sideways'", "auto, state_passing, head_split"]),
    ],
    ids=["order", "compile", "short-slices", "packed", "scheme"],
)
def test_what_is_not_served_is_refused_on_every_rank(ranks2, length, options, words):
    messages = ranks2.run(refusal, "qwen3_next", length, **options)
    assert messages[0] == messages[1], messages
    for word in words:
        assert word in messages[0], (word, messages[0])


@pytest.mark.parametrize(
    "name, options, words",
    [
        (
            "nemotron_h-3-heads",
            {"recurrent": "head_split"},
            ["mixer mamba_chunk_scan_combined", "splits 3 heads in 1 groups of B and C over cp=2"],
        ),
        # it said "a split of its 128 channels over cp=2 ranks ..., which cp must divide": 2 divides 128
        (
            "jamba",
            {"recurrent": "state_passing"},
            ["mamba selective_scan_fn", "takes no incoming state", "(recurrent='auto' or 'head_split')"],
        ),
        (
            "recurrent_gemma",
            {"recurrent": "head_split"},
            ["temporal_block _rnn_scan", "not served for RG-LRU"],
        ),
        ("rwkv", {"recurrent": "head_split"}, ["blocks.0.attention: cp serves RWKV's WKV", "state passing"]),
        ("nemotron_h", {"packed": True}, ["packed documents", "(mixer) carry", "one document per row"]),
        # it said the layers "carry a state along the sequence": LFM2's short convolutions carry none
        (
            "lfm2_moe",
            {"sequence_order": "head_tail"},
            ["sequence_order='head_tail'", "short convolutions read the tokens just before", "contiguous"],
        ),
        ("lfm2_moe", {"packed": True}, ["packed documents", "short convolutions (conv) read", "per row"]),
    ],
    ids=[
        "mamba2-head-split-of-3-heads",
        "mamba1-state-passing",
        "rg-lru-head-split",
        "rwkv-head-split",
        "mamba2-packed",
        "convolution-order",
        "convolution-packed",
    ],
)
def test_what_state_space_layers_do_not_serve_is_refused_on_every_rank(ranks2, name, options, words):
    messages = ranks2.run(refusal, name, 16, **options)
    assert messages[0] == messages[1], messages
    for word in words:
        assert word in messages[0], (word, messages[0])


def test_lightning_attention_has_no_head_split(ranks2):
    messages = ranks2.run(refusal, "minimax", 16, recurrent="head_split")
    assert messages[0] == messages[1] and "lightning attention runs its block loop" in messages[0], messages


def rescaled_rwkv_refusal() -> str:
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    model = tiny_model("rwkv", attn_implementation="auto", rescale_every=6)
    try:
        cpshard.make_cp_forward(model)(cpshard.params_of(model), tiny_batch(128, 2, 16), mesh)
    except ValueError as error:
        return str(error)
    return "no error"


def test_rwkv_that_rescales_its_weights_in_place_is_refused_on_every_rank(ranks2):
    messages = ranks2.run(rescaled_rwkv_refusal)
    assert messages[0] == messages[1] and "set model.config.rescale_every = 0" in messages[0], messages


@pytest.mark.parametrize(
    "hooked, piece, written_for",
    [
        ("lightning", "MiniMaxDecoderLayer", "MiniMaxLightningAttention"),
        ("rg_lru", "RecurrentGemmaRglru", "RecurrentGemmaRecurrentBlock"),
        ("rwkv", "RwkvFeedForward", "RwkvSelfAttention"),
        ("xlstm", "mlstm_chunkwise_recurrent_fw_C", "xLSTMLayer"),
        ("zaya", "ZayaAttention.forward", "ZayaCCAProjection"),
        ("inkling", "causal_conv1d_forward", "InklingDecoderLayer"),
    ],
)
def test_a_hooked_mixer_of_other_code_is_refused(monkeypatch, hooked, piece, written_for):
    """Each mixer served by hooks checks the code they were written against (one piece changed here)."""
    module = importlib.import_module(f"cpshard.recurrent.{hooked}")
    transformers_module, pieces = module.WRITTEN_AGAINST
    monkeypatch.setattr(module, "WRITTEN_AGAINST", (transformers_module, {**pieces, piece: "0" * 16}))
    check = next(
        getattr(module, name) for name in dir(module) if name.startswith("check_") and "unchanged" in name
    )
    with pytest.raises(cpshard.LayoutError, match=f"{written_for} .* other code in {piece}"):
        check()


@pytest.mark.parametrize("model_type", ["inkling2_text", "inkling2_loop_text"])
def test_inkling2_of_other_code_is_refused(monkeypatch, model_type):
    """Inkling2's hooks check the code of its file (or Inkling2-Loop's) they were written against."""
    module = importlib.import_module("cpshard.recurrent.inkling2")
    decoder = _model(model_type).model
    name = type(decoder).__name__
    transformers_module, pieces = module.WRITTEN_AGAINST[name]
    piece = next(iter(pieces))
    monkeypatch.setitem(module.WRITTEN_AGAINST, name, (transformers_module, {**pieces, piece: "0" * 16}))
    with pytest.raises(cpshard.LayoutError, match=f"{name} .* other code in {piece}"):
        module.check_inkling2_unchanged(decoder)


def test_the_head_split_refuses_heads_cp_does_not_divide(ranks2):
    messages = ranks2.run(refusal, "qwen3_next-3-value-heads", 16, recurrent="head_split")
    assert messages[0] == messages[1] and "splits 1 key and 3 value heads over cp=2" in messages[0], messages


def plain_after_cp(name: str) -> float:
    """A prepared model outside a cp call gives what its own code gives (the slots step aside)."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    own, prepared = _model(name), _model(name)
    batch = tiny_batch(own.config.vocab_size, 2, 2 * CHUNK)
    cpshard.make_cp_forward(prepared)(cpshard.params_of(prepared), batch, mesh)
    with torch.no_grad():
        return (prepared(**batch).logits - own(**batch).logits).abs().max().item()


def test_a_prepared_model_outside_cp_is_the_model(ranks2):
    assert ranks2.run(plain_after_cp, "qwen3_next") == [0.0, 0.0]


#: the rows a registered file of a hybrid shares with the layout cpshard derives from the model (the files
#: leave out the tensor-parallel plan, refused beside recurrent layers, and MLP tiling of mixed MLPs)
SHARED_ROWS = ("attention", "final_norm", "layer_inputs", "head_transforms", "hidden", "qkv", "logits")


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text", "nemotron_h", "granitemoehybrid"])
def test_derived_recurrent_rows_match_the_registered_file(name):
    model = _model(name)
    derived, registered = derive_layout(model), resolve_layout(model)
    assert registered.name == name.replace("qwen3_5_text", "qwen3_next")
    for row in (*SHARED_ROWS, "recurrent", "pointwise"):
        if (name, row) == ("granitemoehybrid", "layer_inputs"):  # its file also cuts a rope config's pair
            assert not derived.layer_inputs, derived.layer_inputs  # (granitemoehybrid-rope: exact above)
            continue
        assert getattr(derived, row) == getattr(registered, row), row


def test_the_printed_layout_file_is_the_registered_one():
    namespace = {}
    exec(layout_for("qwen3_5_text"), namespace)  # noqa: S102 -- cpshard's own printed layout file
    assert namespace["LAYOUT"] == QWEN3_NEXT


def failing_with(name: str, case: str) -> list[str]:
    """cp against one process where the call or the model asks for more than a plain batch."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    own, prepared = _model(name), _model(name)
    embeds = own.config.hidden_size if case == "inputs_embeds" else None
    pad = "right" if case == "right padding" else "left"
    batch = tiny_batch(own.config.vocab_size, 2, 2 * 2 * CHUNK, pad=pad, embeds_dim=embeds)
    if case == "checkpointing":
        prepared.gradient_checkpointing_enable()
        prepared.train()
    options = {"logits": False} if case == "logits=False" else {}
    return failing_rows([check_parity(own, batch, mesh, cpshard.make_cp_forward(prepared, **options))])


@pytest.mark.parametrize(
    "name, case",
    [
        ("qwen3_next", "inputs_embeds"),
        ("qwen3_next", "checkpointing"),
        ("qwen3_next", "logits=False"),
        ("kimi_linear", "right padding"),
        ("nemotron_h", "checkpointing"),
        ("falcon_h1", "inputs_embeds"),
        ("jamba", "logits=False"),
        ("minimax", "checkpointing"),  # the recomputed layer runs the lightning hooks again
        ("recurrent_gemma", "checkpointing"),  # and RG-LRU's scan slot and convolution hooks
        ("rwkv", "checkpointing"),  # and RWKV's shadowed WKV and token shift hooks
        ("xlstm", "inputs_embeds"),
        ("inkling2_text", "checkpointing"),  # the recomputed layer reads its halos again
        ("inkling2_loop_text", "inputs_embeds"),  # cut where they enter the decoder
    ],
)
def test_linear_attention_with_more_than_a_plain_batch(ranks2, name, case):
    assert ranks2.run(failing_with, name, case) == [[], []]


def parallel_step_against_one_process(name: str, sizes: dict) -> dict:
    """One step on ``sizes`` (two dp groups where fsdp=2, each its own batch) against one process on every
    batch; the bytes each parallelism moved."""
    mesh, groups = cpshard.make_mesh(**sizes), sizes.get("fsdp", 1)
    model, twin = _model(name), _model(name)
    batches = [tiny_batch(model.config.vocab_size, 2, 2 * 2 * CHUNK, pad="left", seed=s) for s in (1, 2)]
    batches = batches[:groups]
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    cp_forward = cpshard.make_cp_forward(model)
    if cp_forward.layout.name.startswith("derived:"):  # probed on the plain weights first
        cp_forward(
            cpshard.params_of(model), batches[0], cpshard.make_mesh(cp=torch.distributed.get_world_size())
        )
    params = cpshard.params_of(cpshard.parallelize(model, mesh, cp_forward.layout))
    with recording() as log:
        output, grads = cpshard.value_and_grad(cp_forward)(params, batches[mesh.get_local_rank("fsdp")], mesh)
    loss, _, expected = reference(twin, cpshard.params_of(twin), whole)
    return {
        "loss": abs(output.loss.item() - loss.item()) / loss.abs().item(),
        "grads": max(
            ((grads[n].full_tensor() - g).abs().max() / g.abs().max().clamp_min(1e-6)).item()
            for n, g in expected.items()
        ),
        "bytes": log.bytes_by_parallelism(),
    }


@pytest.mark.parametrize(
    "name, sizes",
    [
        ("qwen3_next", dict(fsdp=2, cp=2)),
        ("nemotron_h", dict(fsdp=2, cp=2)),
        ("inkling2_text", dict(fsdp=2, cp=2)),  # cut at the decoder's entry, on each dp group's batch
        # tp splits the attention (and dense MLP) layers; the recurrent layers run whole on every tp rank
        ("qwen3_5_text", dict(tp=2, cp=2)),
        ("nemotron_h", dict(tp=2, cp=2)),
        ("granitemoehybrid", dict(tp=2, cp=2)),
    ],
    ids=str,
)
def test_recurrent_layers_under_fsdp2_or_tp2_and_cp(ranks4, name, sizes):
    # tp sums the row-wise layers' partial outputs and the column-wise inputs' gradients in another order
    # than one process: Gated DeltaNet's A_log gradient (a sum over every token and head) moves by 1.07e-5
    # of its largest entry (1e-7 of 0.0097), the most of any parameter
    tolerance = 2e-5 if sizes.get("tp", 1) > 1 else 1e-5
    for result in ranks4.run(parallel_step_against_one_process, name, sizes):
        assert result["loss"] <= tolerance and result["grads"] <= tolerance, result
        for kind in ("tp", "cp"):
            assert (result["bytes"][kind] > 0) == (sizes.get(kind, 1) > 1), (kind, result["bytes"])


def linear_layer_bytes(recurrent: str, length: int) -> dict:
    """Rank by rank, the bytes the linear layer's collectives took (by op and phase), and the analytic
    count of the scheme from the module's sizes: the summary all-gathered forward and its gradient
    reduce-scattered backward, or every kernel input and the output all-to-all'd both ways; the halo of
    ``kernel - 1`` positions sent forward by every rank but the last, its gradient back by every rank but
    the first."""
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh, model = cpshard.make_mesh(cp=cp), _model("qwen3_next")
    batch = tiny_batch(model.config.vocab_size, 2, length)
    cp_forward = cpshard.make_cp_forward(model, recurrent=recurrent)
    with recording() as log:
        cpshard.value_and_grad(cp_forward)(cpshard.params_of(model), batch, mesh)
    measured = {}
    for event in log.events:
        if "linear_attn" in event.name:
            key = f"{event.op} {event.phase}"
            measured[key] = measured.get(key, 0) + event.nbytes
    mixer, rows, tokens = model.model.layers[0].linear_attn, 2, length // cp
    halo = rows * mixer.conv_dim * (mixer.conv_kernel_size - 1) * 4
    expected = {"send forward": halo} if rank < cp - 1 else {}
    if rank > 0:
        expected["send backward"] = halo
    heads, dk, dv = mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    if recurrent == "state_passing":
        summary = rows * heads * dk * (dk + dv) * 4
        expected |= {"all_gather forward": summary, "reduce_scatter backward": cp * summary}
    else:
        per_token = mixer.num_k_heads * dk * 2 + heads * dv * 2 + heads * 2  # q, k; v, output; g, beta
        expected |= {
            f"all_to_all {phase}": rows * tokens * per_token * 4 for phase in ("forward", "backward")
        }
    return {"measured": measured, "expected": expected}


@pytest.mark.parametrize("recurrent", ["state_passing", "head_split"])
def test_a_linear_layer_moves_its_scheme_s_analytic_bytes(ranks2, recurrent):
    for length in (64, 256):
        for result in ranks2.run(linear_layer_bytes, recurrent, length):
            assert result["measured"] == result["expected"], (length, result)


def ssd_layer_bytes(length: int) -> dict:
    """Rank by rank, the bytes of nemotron_h's Mamba2 layer (by op and phase), and the analytic count from
    the mixer's sizes: the fp32 summary (the state ``[P, N]`` and one decay per row and head) all-gathered
    forward and its gradient reduce-scattered backward, and the convolution's halo."""
    cp, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    mesh, model = cpshard.make_mesh(cp=cp), _model("nemotron_h")
    batch, step = (
        tiny_batch(model.config.vocab_size, 2, length),
        cpshard.value_and_grad(cpshard.make_cp_forward(model)),
    )
    step(cpshard.params_of(model), batch, mesh)  # the derived layout's probe runs here, unrecorded
    with recording() as log:
        step(cpshard.params_of(model), batch, mesh)
    measured = {}
    for event in log.events:
        if event.name.startswith("model.layers.0.mixer"):
            measured[f"{event.op} {event.phase}"] = (
                measured.get(f"{event.op} {event.phase}", 0) + event.nbytes
            )
    mixer, rows = model.model.layers[0].mixer, 2
    summary = rows * mixer.num_heads * (mixer.head_dim * mixer.ssm_state_size + 1) * 4
    halo = rows * mixer.conv_dim * (mixer.conv_kernel_size - 1) * 4
    expected = {"all_gather forward": summary, "reduce_scatter backward": cp * summary}
    expected |= ({"send forward": halo} if rank < cp - 1 else {}) | ({"send backward": halo} if rank else {})
    return {"measured": measured, "expected": expected}


def test_a_mamba2_layer_moves_one_summary_whatever_the_length(ranks2):
    for length in (64, 256):
        for result in ranks2.run(ssd_layer_bytes, length):
            assert result["measured"] == result["expected"], (length, result)


def test_a_step_optimum_of_attention_layers_refuses_linear_ones():
    from cpshard.debug.optimum import optimum_for

    with pytest.raises(ValueError, match="has recurrent layers: their bytes are per layer and scheme"):
        optimum_for(_model("qwen3_next"), 2, 256, 2)


def bf16_errors(name: str, recurrent: str) -> dict:
    """Against one fp32 process: the mean logit error of cp in bf16 and of one bf16 process."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    exact, one, prepared = _model(name), _model(name).to(torch.bfloat16), _model(name).to(torch.bfloat16)
    batch = tiny_batch(exact.config.vocab_size, 2, 2 * 2 * CHUNK + 3, pad="left")
    with torch.no_grad():
        truth = exact(**batch, use_cache=False).logits
        alone = one(**batch, use_cache=False).logits.float()
        cp = cpshard.make_cp_forward(prepared, recurrent=recurrent)(cpshard.params_of(prepared), batch, mesh)
    return {
        "cp": (cp.logits.full_tensor().float() - truth).abs().mean().item(),
        "one bf16 process": (alone - truth).abs().mean().item(),
    }


@pytest.mark.parametrize("recurrent", ["state_passing", "head_split"])
def test_bf16_is_as_close_as_a_bf16_process(ranks2, recurrent):
    """Summaries and the fold stay fp32, so cp in bf16 is within a bf16 process's own error."""
    for errors in ranks2.run(bf16_errors, "qwen3_5_text", recurrent):  # dense: no routing to flip
        assert errors["cp"] <= 1.5 * errors["one bf16 process"], errors


def test_derived_rows_of_kda_and_lightning():
    assert derive_layout(_model("kimi_linear")).recurrent == (
        cpshard.Recurrent("self_attn", "chunk_kda", "causal_conv1d_fn"),
    )
    assert derive_layout(_model("minimax")).recurrent == (
        cpshard.Recurrent("self_attn", "lightning", None, decay="constant"),
    )


def refusal_on(sizes: dict, name: str = "qwen3_next") -> str:
    mesh, model = cpshard.make_mesh(**sizes), _model(name)
    try:
        cpshard.make_cp_forward(model)(
            cpshard.params_of(model), tiny_batch(model.config.vocab_size, 2, 16), mesh
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_tensor_parallelism_beside_a_derived_layout_s_linear_layers_is_refused(ranks4):
    """A derived plan is the model's own, written for its layers split alike (kimi_linear's splits its
    latent attention's queries but not its keys: a shape error deep inside); registered files are tested."""
    messages = ranks4.run(refusal_on, dict(cp=2, tp=2), "kimi_linear")
    assert len(set(messages)) == 1, messages
    assert messages[0].startswith(
        "tp > 1 with the derived layout 'derived:kimi_linear': cp does not serve"
    ), messages
    instead = "build the mesh with tp=1 (tp beside them: the layout files granitemoehybrid, nemotron_h, "
    assert instead in messages[0], messages


def test_expert_parallelism_beside_linear_layers_is_refused(ranks4):
    """Qwen3-Next's layouts declare no experts (expert parallelism is not served beside linear layers yet)."""
    messages = ranks4.run(refusal_on, dict(cp=2, fsdp=2, ep=2))
    assert len(set(messages)) == 1 and "declares no experts: the model's 4 experts run whole" in messages[0]


def traced_linear_layers(name: str, recurrent: str) -> list[dict]:
    """``trace_comms`` of one training step and of one prefill: the linear layer's groups, with the
    optimum their scheme declared, and whether the whole report matches its optimum."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    model = _model(name)
    batch = tiny_batch(model.config.vocab_size, 2, 64, pad="left")
    params = cpshard.params_of(model)
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model, recurrent=recurrent))
    step(params, batch, mesh)  # a derived layout's probe runs here, untraced
    reports = [cpshard.debug.trace_comms(step, params, batch, mesh)]
    if name in GENERATES:
        prompt = {key: value for key, value in batch.items() if key != "labels"}
        reports.append(cpshard.debug.trace_comms(cpshard.make_cp_prefill(model), params, prompt, mesh))
    layout, kinds = derive_layout(model), getattr(model.config, "layer_types", None) or ["linear_attention"]
    linear = f"{layout.decoder_layers}.{kinds.index('linear_attention')}.{layout.recurrent[0].module}"
    return [
        {
            "matches": report.matches_optimum,
            "differing": [g for g in report.groups if g.verdict == "DIFFERS"],
            "linear": {
                (g.op, g.phase): (g.count, g.nbytes, g.optimum_count, g.optimum_bytes)
                for g in report.groups
                if g.module == linear
            },
        }
        for report in reports
    ]


#: the models whose states cp generation carries (a prefill is traced too)
GENERATES = ("qwen3_next",)


@pytest.mark.parametrize(
    "name, recurrent",
    [
        ("qwen3_next", "state_passing"),
        ("qwen3_next", "head_split"),
        ("minimax", "auto"),
        ("nemotron_h", "auto"),
        ("nemotron_h", "head_split"),
        ("nemotron_h-1-group", "head_split"),  # B and C gathered whole
        ("jamba", "auto"),
        ("recurrent_gemma", "auto"),
        ("rwkv", "auto"),
        ("xlstm", "auto"),
    ],
)
def test_trace_comms_sets_each_linear_layer_beside_its_scheme_s_optimum(ranks2, name, recurrent):
    for rank, reports in enumerate(ranks2.run(traced_linear_layers, name, recurrent)):
        for report in reports:
            assert report["matches"], (rank, report)
            for count, nbytes, optimum_count, optimum_bytes in report["linear"].values():
                assert (count, nbytes) == (optimum_count, optimum_bytes) and nbytes > 0, (rank, report)
        ops = {op for op, _ in reports[0]["linear"]}
        split = recurrent == "head_split" or name in SPLIT_OVER_CHANNELS
        assert ops >= ({"all_to_all"} if split else {"all_gather"}), reports[0]
        if name in GENERATES:  # the prefill: state passing, and the last inputs' all-reduce
            assert {"all_gather", "all_reduce"} <= {op for op, _ in reports[1]["linear"]}, reports[1]


def traced_inkling(name: str) -> dict:
    """Whether trace_comms finds every group at its optimum, and the forward all-to-alls of the first layer's
    attention (q, k and v in one, the output, the rows moved per query: the bias, and Inkling2's sinks)."""
    mesh = cpshard.make_mesh(cp=torch.distributed.get_world_size())
    model = _model(name)
    batch, params = tiny_batch(model.config.vocab_size, 2, 64, pad="left"), cpshard.params_of(model)
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    step(params, batch, mesh)  # the derived layout's probe runs here, untraced
    report = cpshard.debug.trace_comms(step, params, batch, mesh)
    attention = [g for g in report.groups if g.module == "model.layers.0.self_attn" and g.phase == "forward"]
    return {"matches": report.matches_optimum, "all_to_alls": [g.count for g in attention]}


@pytest.mark.parametrize("name, moved", [("inkling_text", 3), ("inkling2_text", 4)])
def test_trace_comms_sets_inkling_s_halos_and_moved_rows_at_their_optimum(ranks2, name, moved):
    for result in ranks2.run(traced_inkling, name):
        assert result == {"matches": True, "all_to_alls": [moved]}, result


def test_a_mamba2_mixer_s_slots_are_taken_its_fused_kernel_too():
    """The fused slot that would do the whole mixer in one call (mamba_ssm's, on a GPU) steps aside inside
    a cp call, so the scan and the convolution run through the slots cpshard serves."""
    from cpshard.layouts.structure import kernel_slots
    from cpshard.recurrent.slots import Halo
    from cpshard.recurrent.state_space import SSDScan, Unfused
    from cpshard.runtime.install import install

    model = _model("nemotron_h")
    install(model, resolve_layout(model))
    slots = kernel_slots(model.model.layers[0].mixer)
    assert isinstance(slots["mamba_chunk_scan_combined"], SSDScan)
    assert isinstance(slots["causal_conv1d_fn"], Halo)
    assert isinstance(slots["mamba_split_conv1d_scan_combined"], Unfused)


def test_the_stabilised_fold_adds_the_true_states():
    """RWKV's and xLSTM's fold: ``part e^m`` after the slice is the decayed incoming one plus the slice's own,
    for parts wider than ``m`` (xLSTM's memory ``[B, H, dk, dv]`` beside ``m`` ``[B, H, 1]``)."""
    generator = torch.Generator().manual_seed(0)
    shapes = ((2, 3, 4, 5), (2, 3, 4), (2, 3, 1))
    previous, local = (
        [torch.randn(s, generator=generator, dtype=torch.float64) for s in shapes] for _ in "ab"
    )
    log_decay = -torch.rand(2, 3, 1, generator=generator, dtype=torch.float64) * 5
    *folded, new_max = stabilised_fold(tuple(previous), tuple(local), log_decay)

    def true(part, m):
        return part * m.reshape(*m.shape, *[1] * (part.dim() - m.dim())).exp()

    for part, before, own in zip(folded, previous[:2], local[:2], strict=True):
        expected = true(before, previous[2] + log_decay) + true(own, local[2])
        assert torch.allclose(true(part, new_max), expected, rtol=1e-12), (part.shape,)
    assert torch.equal(new_max, torch.maximum(previous[2] + log_decay, local[2]))
