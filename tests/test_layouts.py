"""The layout registry and files: which layout serves which model, and what each declares."""

import re
from dataclasses import replace

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import cpshard
from cpshard.comm.redistribute import plan
from cpshard.layouts.errors import LayoutError
from cpshard.layouts.layout import Recurrent, specs
from cpshard.layouts.llama import LAYOUT as LLAMA
from cpshard.layouts.registry import (
    BY_NAME,
    REGISTERED,
    decoder,
    gemma3,
    llama,
    mistral,
    qwen3,
    resolve_layout,
)
from cpshard.layouts.structure import structure_problems
from cpshard.spec.notation import Spec
from cpshard.tools.tiny import tiny_model

SUPPORTED = ("gemma3_text", "llama", "mistral", "qwen3", "qwen3_moe")
#: every model type with a layout file: the attention decoders above, the Gated DeltaNet and Mamba2 hybrids,
#: XLM as a causal LM, ProphetNet's, Reformer's and BLT's causal LMs
FILES = sorted(
    (*SUPPORTED, "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "nemotron_h", "granitemoehybrid", "xlm")
    + ("prophetnet", "reformer", "blt")
)


@pytest.fixture(scope="module")
def models():
    """One small random model per type, built once (no downloads)."""
    built = {t: tiny_model(t) for t in (*SUPPORTED, "qwen2", "olmo2")}
    built["gpt2"] = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    return built


@pytest.mark.parametrize(
    "model_type, layout",
    [
        ("llama", llama.LAYOUT),
        ("mistral", mistral.LAYOUT),
        ("qwen3", qwen3.LAYOUT),
        ("gemma3_text", gemma3.LAYOUT),
    ],
)
def test_registered_types_get_their_file(models, model_type, layout):
    assert resolve_layout(models[model_type]) is layout
    assert model_type in layout.model_types
    assert structure_problems(models[model_type], layout) == []


@pytest.mark.parametrize("model_type", ["qwen2", "olmo2"])
def test_other_decoders_get_the_generic_layout(models, model_type):
    assert model_type not in REGISTERED
    derived = resolve_layout(models[model_type])
    assert derived.name == f"derived:{model_type}" and derived.model_types == (model_type,)
    for row in ("decoder", "decoder_layers", "attention", "final_norm", "heads", "kv_heads", "qkv", "logits"):
        assert getattr(derived, row) == getattr(decoder.LAYOUT, row), row
    assert [key for key, *_ in derived.layer_inputs] == ["position_embeddings", "position_ids"]


@pytest.mark.parametrize(
    "model, model_type, why",
    [
        (
            "xlnet",
            "'xlnet' (XLNetLMHeadModel)",
            "transformer.layer.0.rel_attn (XLNetRelativeAttention) is XLNet's two-stream relative attention",
        ),
        (torch.nn.Linear(2, 2), "'Linear' (Linear)", "not a transformers model"),
        (torch.nn.Module(), "'Module' (Module)", "not a transformers model"),
    ],
)
def test_models_that_do_not_fit_are_refused(models, model, model_type, why):
    model = tiny_model(model, attn_implementation="auto") if isinstance(model, str) else model
    with pytest.raises(ValueError) as info:
        resolve_layout(model)
    message = str(info.value)
    assert f"model type {model_type}" in message
    assert why in message
    assert f"Layout files: {', '.join(FILES)}" in message


@pytest.mark.parametrize("base", ["llama", "bert"])
def test_a_model_without_a_language_model_head_is_refused_naming_the_class_to_load(base):
    """A base model (AutoModel's): BertModel derived a layout whose final norm was its first layer and
    crashed installing hooks on its head (None); LlamaModel was told only that it had no decoder layers."""
    config = tiny_model(base).config
    model = transformers.AutoModel.from_config(config)
    with pytest.raises(LayoutError) as info:
        cpshard.make_cp_forward(model)
    assert str(info.value) == (
        f"{type(model).__name__} has no language-model head (its get_output_embeddings() is None): cp "
        "computes a causal LM's loss and logits; load it with AutoModelForCausalLM (e.g. LlamaForCausalLM, "
        "not LlamaModel)"
    )


def test_registry():
    assert sorted(REGISTERED) == FILES
    assert sorted(BY_NAME) == [
        "blt",
        "decoder",
        "gemma3",
        "granitemoehybrid",
        "llama",
        "mistral",
        "nemotron_h",
        "prophetnet",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "reformer",
        "xlm",
    ]
    for model_type, layout in REGISTERED.items():
        assert BY_NAME[layout.name] is layout and model_type in layout.model_types


@pytest.mark.parametrize("name", ["decoder", "llama", "gemma3", "gemma3_text"])
def test_layout_by_name(models, name):
    expected = BY_NAME.get(name) or REGISTERED[name]
    assert resolve_layout(models["qwen2"], name) is expected


def test_layout_given_or_unknown(models):
    custom = decoder.LAYOUT.for_types("mine", "qwen2")
    assert resolve_layout(models["qwen2"], custom) is custom
    with pytest.raises(
        ValueError, match=r"unknown layout 'gpt2'.*decoder, gemma3, granitemoehybrid, llama, mistral"
    ):
        resolve_layout(models["qwen2"], "gpt2")
    broken = decoder.LAYOUT.with_rows(name="broken", decoder_layers="model.blocks")
    with pytest.raises(ValueError, match=r"'qwen2'.*'broken'.*'model.blocks'") as caught:
        resolve_layout(models["qwen2"], broken)
    # a layout the caller gave is checked against the model, not sent to write another architecture's file
    assert "check its rows against the model (`cpshard layout qwen2`" in str(caught.value)
    assert "another architecture" not in str(caught.value)


def test_structure_problems_name_each_misfit(models):
    model = models["llama"]
    assert structure_problems(model, decoder.LAYOUT.with_rows(attention="cross_attn")) == [
        "not every decoder layer has an attention module 'cross_attn'"
    ]
    assert structure_problems(model, decoder.LAYOUT.with_rows(heads="n_heads", kv_heads="n_kv")) == [
        "its config has no n_heads",
        "its config has no n_kv",
    ]
    assert structure_problems(model, decoder.LAYOUT.with_rows(decoder_layers="lm_head")) == [
        "no list of decoder layers at 'lm_head'"
    ]


@pytest.mark.parametrize(
    "model_type, mixer",
    [
        ("nemotron_h", "NemotronHMamba2Mixer at 'mixer'"),
        ("qwen3_5_text", "Qwen3_5GatedDeltaNet at 'linear_attn'"),
    ],
)
def test_a_layout_lacking_the_recurrent_rows_is_told_which_mixers_they_name(model_type, mixer):
    """Before, nemotron_h's file without its rows said only that its mixer does not call attention through
    the registry."""
    model = tiny_model(model_type)
    layout = resolve_layout(model)
    assert structure_problems(model, layout) == []
    problems = structure_problems(model, replace(layout, recurrent=()))
    assert f"recurrent mixers that no row of the layout's recurrent table names ({mixer};" in problems[-1]


@pytest.mark.parametrize("layout", [decoder.LAYOUT, *REGISTERED.values()], ids=lambda layout: layout.name)
def test_layout_files_declare_the_cheap_moves(layout):
    """The residual cut and per-layer inputs are slices; q, k, v and the output are one all-to-all each."""
    for before, after in [layout.hidden, *(pair for _, *pair in layout.layer_inputs)]:
        assert [(m.axis, m.kind) for m in plan(before, after)] == [("cp", "slice")], (before, after)
    for before, after in (layout.qkv, layout.attn_output):
        assert [(m.axis, m.kind) for m in plan(before, after)] == [("cp", "all_to_all")], (before, after)
    assert layout.logits.sharded_dim("cp") == 1


#: rows cpshard could not run, or would not read as written: refused where the layout is made, naming the row
BAD_ROWS = {
    "an axis typo": (dict(hidden=specs("b s d", "b s@cq d")), "hidden splits over 'cq'"),
    "tp in a spec": (dict(qkv=specs("b h s@tp d", "b h@cp s d")), "qkv splits over 'tp'"),
    "other names": (dict(hidden=specs("b s d", "b t@cp d")), "hidden moves b s d to b t@cp d, which name"),
    "a layer input": (
        dict(layer_inputs=(("position_ids", *specs("b s", "s@cp b")),)),
        "layer_inputs 'position_ids' moves b s to s@cp b",
    ),
    "logits whole": (dict(logits=Spec("b s v")), "logits=b s v; a cp call gives the logits as b s@cp v"),
}


def test_specs_given_as_their_notation_are_specs():
    written = replace(LLAMA, hidden=("b s d", "b s@cp d"), logits="b s@cp v")
    assert written == LLAMA and isinstance(written.logits, Spec)


@pytest.mark.parametrize("case", BAD_ROWS)
def test_a_row_cpshard_would_not_read_as_written_is_refused(case):
    rows, message = BAD_ROWS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        replace(LLAMA, **rows)


BAD_RECURRENT = {
    "kernel typo": (dict(kernel="chunk_gated_delta"), "kernel='chunk_gated_delta' is not a kernel cpshard"),
    "another decay": (
        dict(decay="scalar"),
        "chunk_gated_delta_rule's state decays as 'matrix', not 'scalar'",
    ),
    "another state": (dict(state=Spec("b h v k")), "state=b h v k; cpshard reads a kernel's state"),
    "conv typo": (dict(conv="conv1d"), "conv='conv1d'; the convolution slot is 'causal_conv1d_fn'"),
}


@pytest.mark.parametrize("case", BAD_RECURRENT)
def test_a_recurrent_row_states_its_kernel_s_facts(case):
    rows, message = BAD_RECURRENT[case]
    good = dict(module="linear_attn", kernel="chunk_gated_delta_rule", conv="causal_conv1d_fn")
    with pytest.raises(ValueError, match=re.escape(message)):
        Recurrent(**{**good, **rows})
    ssd = Recurrent("mixer", kernel="mamba_chunk_scan_combined", conv="causal_conv1d_fn")
    assert ssd.decay == "scalar" and ssd == replace(ssd, decay=None)  # the kernel's decay, filled in
