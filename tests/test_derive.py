"""Layouts derived from the model: the rows found in families off ``model.layers``, and the refusals."""

import pytest
import torch
import torch.distributed as dist
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention
from transformers.models.hrm_text.modeling_hrm_text import HrmTextModel
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashMLA

import cpshard
from cpshard.debug import trace_comms
from cpshard.layouts.derive import derive_layout
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.layout import ENTERED_DECODERS
from cpshard.layouts.structure import structure_problems
from cpshard.recurrent.slots import DECODER_ENTRY_HOOKS
from cpshard.runtime.install import attention_modules
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model


@pytest.mark.parametrize(
    "model_type, rows",
    [
        (
            "gpt_neox",
            dict(
                decoder_layers="gpt_neox.layers",
                attention="attention",
                final_norm="gpt_neox.final_layer_norm",
            ),
        ),
        ("gptj", dict(decoder_layers="transformer.h", attention="attn", final_norm="transformer.ln_f")),
        (
            "phi",
            dict(decoder_layers="model.layers", attention="self_attn", final_norm="model.final_layernorm"),
        ),
        ("lfm2", dict(final_norm="model.embedding_norm")),
        ("gpt_oss", dict(per_head_params=("sinks",))),
        ("stablelm", dict(attention="self_attn")),
        # post-norm: the last layer gives the final hidden states; BERT's attention calls the registry inside
        (
            "bert",
            dict(decoder="bert", decoder_layers="bert.encoder.layer", final_norm="bert.encoder.layer.1"),
        ),
        ("marian", dict(final_norm="model.decoder.layers.1", labels_shifted=True)),
        ("opt", dict(final_norm="model.decoder.final_layer_norm", labels_shifted=False)),  # registered first
        ("gpt2", dict(final_norm="transformer.ln_f", restores_length=True)),
        ("openai-gpt", dict(final_norm="transformer.h.1", restores_length=True)),  # post-norm, a list out
        ("llama", dict(restores_length=False, labels_shifted=False, looped=False)),
        # looped: its norm runs between the passes too, and a short output there is not the decoder's
        ("dory", dict(final_norm="model.norm", looped=True, restores_length=False)),
        ("llama4_text", dict(decoder="model", decoder_layers="model.layers")),  # get_decoder() is the model
        ("modernbert-decoder", dict(decoder="model")),  # get_decoder() is its head
        ("dbrx", dict(attention="norm_attn_norm.attn")),  # one level below the layer
        # two attention sublayers per layer in one list; num_hidden_layers counts them, not the layers
        ("longcat_flash", dict(decoder_layers="model.layers", attention="self_attn")),
        (
            "gemma3",
            dict(decoder="model.language_model"),
        ),  # a multimodal model's decoder, sized in its text part
    ],
)
def test_rows_read_off_the_model(model_type, rows):
    model = tiny_model(model_type, attn_implementation="auto")
    layout = derive_layout(model)
    assert {row: getattr(layout, row) for row in rows} == rows
    assert layout.model_types == (model_type,) and structure_problems(model, layout) == []
    assert layout.layer_inputs or model_type in ("bert", "marian", "opt", "gpt2", "openai-gpt")  # absolute


@pytest.mark.parametrize(
    "model_type, key, spec",
    [
        ("gemma4_text", "per_layer_input", "b s@cp x2"),  # passed to each layer by position
        ("beam", "attention_scaling", "b x1 s@cp x3"),  # [b, 1, s, 1]: the sequence on dim 2
    ],
)
def test_per_position_inputs_by_position_or_on_another_dim(model_type, key, spec):
    layout = derive_layout(tiny_model(model_type, attn_implementation="auto"))
    inputs = {name: str(after) for name, _, after in layout.layer_inputs}
    assert inputs.get(key) == spec, inputs


def test_kv_heads_fall_back_to_heads():
    model = tiny_model("llama")
    del model.config.num_key_value_heads
    layout = derive_layout(model)
    assert layout.kv_heads is None and layout.head_counts(model.config) == (4, 4)


class _OwnScoresAttention(LlamaAttention):
    def forward(self, hidden_states, **kwargs):  # scores of its own code, not the registry's
        return hidden_states, None


def test_attention_of_its_own_code_that_cpshard_does_not_know_is_refused():
    model = tiny_model("llama", attn_implementation="auto")
    for layer in model.model.layers:
        layer.self_attn.__class__ = _OwnScoresAttention
    with pytest.raises(LayoutError, match="does not call attention through transformers' attention registry"):
        derive_layout(model)


@pytest.mark.parametrize(
    "model_type, words",
    [
        # no heads of one decoder: a byte encoder, a global transformer over patches, a byte decoder (BLT's
        # layout file serves it, not the generic layout)
        ("blt", ["model.global_transformer.layers", "lists of layers that attend", "layout file of its own"]),
        (
            "xlnet",
            ["transformer.layer.0.rel_attn (XLNetRelativeAttention)", "two-stream", "attention registry"],
        ),
        ("musicgen", ["does not run on token ids and labels alone", "RuntimeError"]),  # ids per codebook
    ],
)
def test_what_cp_cannot_serve_is_refused_naming_module_and_reason(model_type, words):
    with pytest.raises(LayoutError) as info:
        derive_layout(tiny_model(model_type, attn_implementation="auto"))
    missing = [word for word in words if word not in str(info.value)]
    assert not missing, f"{info.value} lacks {missing}"


@pytest.mark.parametrize(
    "mode, words",
    [
        ("train", ["mode='train' takes sequences of whole chunks only (chunk_size=64)"]),
        ("train_with_padding", ["returns no last state"]),
    ],
)
def test_a_recurrent_kernel_mode_cp_cannot_run_is_refused_saying_which_to_set(mode, words):
    """xLSTM's train modes, derived or given a layout: before, the derivation's recording run on 13 tokens
    failed in the model's kernel, and the refusal said the model does not run on token ids alone; a layout
    given explicitly was refused by the probe's "its own forward raised", naming the chunk error."""
    served = derive_layout(tiny_model("xlstm"))
    assert any(row.kernel == "mlstm" for row in served.recurrent)
    model = tiny_model("xlstm", attn_implementation="auto", mode=mode)
    for refused in (lambda: derive_layout(model), lambda: cpshard.make_cp_forward(model, layout=served)):
        with pytest.raises(LayoutError) as info:
            refused()
        missing = [word for word in [*words, "set config.mode = 'inference'"] if word not in str(info.value)]
        assert not missing, f"{info.value} lacks {missing}"


class _UnreadCompressedAttention(DeepseekV4Attention):
    """DeepSeek-V4's attention under a class cpshard has not read: what its compressor pools is unknown."""


def test_a_compressor_inside_attention_cpshard_has_not_read_is_refused():
    model = tiny_model("deepseek_v4", attn_implementation="auto")
    for layer in model.model.layers:
        layer.self_attn.__class__ = _UnreadCompressedAttention
    with pytest.raises(LayoutError) as info:
        derive_layout(model)
    words = ["model.layers.1.self_attn.compressor (DeepseekV4CSACompressor", "windows of tokens"]
    assert all(word in str(info.value) for word in words), info.value


class _UnreadStacks(HrmTextModel):
    """HRM's decoder under a class cpshard has not read: its loop over two stacks is not known to be per
    position outside attention."""


def test_layers_run_from_a_second_list_are_refused_beside_an_unread_decoder():
    model = tiny_model("hrm_text", attn_implementation="auto")
    model.model.__class__ = _UnreadStacks
    with pytest.raises(LayoutError) as info:
        derive_layout(model)
    words = ["model.H_module.layers.0 (HrmTextDecoderLayer) runs beside model.L_module.layers", "not read"]
    assert all(word in str(info.value) for word in words), info.value


def test_hrm_is_cut_where_the_sequence_enters_its_decoder():
    layout = derive_layout(tiny_model("hrm_text", attn_implementation="auto"))
    assert layout.cut_at_entry and layout.looped and layout.layer_inputs == ()
    assert layout.final_norm == "model.H_module.final_norm" and not layout.restores_length
    assert set(DECODER_ENTRY_HOOKS) == ENTERED_DECODERS  # each decoder the recording admits has its hook


#: LongCat-Flash of two layers, each running two attention sublayers from its list ``self_attn``
_LONGCAT = dict(num_hidden_layers=4, attn_implementation="auto")


def test_each_attention_module_of_a_list_is_an_attention_module():
    model = tiny_model("longcat_flash", **_LONGCAT)
    found = attention_modules(model, derive_layout(model))
    assert found == [attention for layer in model.model.layers for attention in layer.self_attn]
    assert len(found) == 4


class _OwnScoresMLA(LongcatFlashMLA):
    def forward(self, hidden_states, **kwargs):  # scores of its own code, not the registry's
        return hidden_states, None


def test_a_list_holding_attention_of_its_own_code_is_refused_naming_that_module():
    model = tiny_model("longcat_flash", **_LONGCAT)
    model.model.layers[1].self_attn[1].__class__ = _OwnScoresMLA
    with pytest.raises(LayoutError, match=r"model\.layers\.1\.self_attn\.1 \(_OwnScoresMLA\) does not call"):
        derive_layout(model)


def longcat_parity(implementation: str, attention_recompute: bool = False) -> dict:
    """LongCat-Flash under cp against one process on a plain and a left-padded batch: the failing rows, and
    the attention modules whose collectives ran (each sublayer under its own name)."""
    model = tiny_model("longcat_flash", **_LONGCAT)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    forward = cpshard.make_cp_forward(
        model, implementation=implementation, attention_recompute=attention_recompute
    )
    failing, modules = {}, set()
    for pad in (None, "left"):
        batch = tiny_batch(model.config.vocab_size, 2, 11, pad=pad)
        report = trace_comms(check_parity, model, batch, mesh, forward)
        failing[pad] = failing_rows([report.result])
        modules |= {group.module for group in report.groups if ".self_attn." in group.module}
    return {"failing": failing, "modules": sorted(modules)}


_SUBLAYERS = [f"model.layers.{i}.self_attn.{j}" for i in range(2) for j in range(2)]
_EXACT = {"failing": {None: [], "left": []}, "modules": _SUBLAYERS}


@pytest.mark.parametrize(
    "implementation, recompute", [("ulysses", False), ("ring", False), ("ulysses", True)]
)
def test_a_list_of_attention_modules_is_exact_at_cp2(ranks2, implementation, recompute):
    for result in ranks2.run(longcat_parity, implementation, recompute):
        assert result == _EXACT, result


@pytest.mark.parametrize("implementation", ["ulysses", "hybrid"])
def test_a_list_of_attention_modules_is_exact_at_cp4(ranks4, implementation):
    for result in ranks4.run(longcat_parity, implementation):
        assert result == _EXACT, result


@pytest.mark.parametrize("model_type", ["bart", "mbart", "marian"])
def test_a_bf16_model_reads_its_labels_as_its_fp32_twin_does(model_type):
    """BART's causal LMs take labels as already shifted. In bf16 their loss (5.25) is the aligned
    cross-entropy (5.2579) to bf16's rounding, which an fp32 tolerance took for 'not aligned': cp then shifted
    the labels itself, and the probe refused the layout (the gradient of the embeddings differed)."""
    for dtype in (torch.float32, torch.bfloat16):
        assert derive_layout(tiny_model(model_type, dtype=dtype)).labels_shifted, dtype
