"""LoRA under cp: PEFT's adapters live in the modules of the model it wraps, so that model
(``peft_model.get_base_model()``) runs under cp as any model does, its adapters trained and its frozen
weights without a gradient, as in one process; under tp each adapter splits with the layer it wraps
(:mod:`cpshard.parallel.adapters`), and what tp cannot split so is refused before any collective. PEFT's
wrapper itself is refused, naming that way out."""

import re

import pytest
import torch
from peft import LoraConfig, get_peft_model

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model

#: the layers of the plan that LoRA wraps in the tp cases: column-wise (q, v, gate) and row-wise (o, down)
SPLIT_TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


def _lora(model_type: str, targets=("q_proj", "v_proj"), **options):
    """The tiny model with LoRA adapters on ``targets`` (B drawn, not zeros: the adapters change the
    output)."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), **options)
    config.init_lora_weights = False
    return get_peft_model(tiny_model(model_type), config)


def lora_step(model_type: str, implementation: str, sizes: dict, targets=("q_proj", "v_proj")) -> dict:
    """One ``loss.backward()`` under cp on the wrapped model, on a mesh of ``sizes`` (with fsdp or tp:
    sharded by ``parallelize``; fsdp's dp groups hold the same batch), and one in this process alone on a
    copy: the losses, which parameters have a gradient in each, and the largest difference of the adapters'
    gradients relative to their scale."""
    torch.manual_seed(0)  # the adapters' draws alike on every rank
    own, model = (_lora(model_type, targets).get_base_model() for _ in range(2))
    model.load_state_dict(own.state_dict())
    forward = cpshard.make_cp_forward(model, implementation=implementation)
    mesh = cpshard.make_mesh(**sizes)
    sharded = {"fsdp", "tp"} & set(sizes)
    if sharded:
        cpshard.parallelize(model, mesh)
    batch = tiny_batch(model.config.vocab_size, 2, 23, pad="left")
    loss = forward(cpshard.params_of(model), batch, mesh).loss
    loss.backward()
    under_cp = {
        name: p.grad.full_tensor() if sharded else p.grad
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    own_loss = own(**batch).loss
    own_loss.backward()
    own = {name: p.grad for name, p in own.named_parameters() if p.grad is not None}
    return {
        "losses": (loss.item(), own_loss.item()),
        "with gradient": (sorted(under_cp), sorted(own)),
        "worst": max(((under_cp[n] - g).abs().max() / g.abs().max()).item() for n, g in own.items()),
    }


def _assert_as_in_one_process(results: list) -> None:
    for result in results:
        cp_loss, own_loss = result["losses"]
        assert abs(cp_loss - own_loss) <= 1e-5 * abs(own_loss), result
        under_cp, own = result["with gradient"]
        assert under_cp == own and own and all(".lora_" in name for name in own), result
        assert result["worst"] <= 1e-5, result


@pytest.mark.parametrize(
    "model_type, implementation, sizes, targets",
    [
        ("llama", "ulysses", dict(cp=2), ("q_proj", "v_proj")),
        ("llama", "ring", dict(cp=2), ("q_proj", "v_proj")),
        ("qwen3_next", "auto", dict(cp=2), ("q_proj", "v_proj")),
        ("llama", "auto", dict(fsdp=2, cp=1), ("q_proj", "v_proj")),
        ("llama", "auto", dict(cp=1, tp=2), SPLIT_TARGETS),
        ("qwen3_moe", "auto", dict(cp=2), ("q_proj", "down_proj")),  # down_proj: PEFT wraps the experts too
    ],
)
def test_lora_adapters_train_as_in_one_process(ranks2, model_type, implementation, sizes, targets):
    _assert_as_in_one_process(ranks2.run(lora_step, model_type, implementation, sizes, targets))


@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_lora_adapters_split_with_their_layers_beside_cp(ranks4, implementation):
    _assert_as_in_one_process(ranks4.run(lora_step, "llama", implementation, dict(cp=2, tp=2), SPLIT_TARGETS))


#: LoRA configurations tp cannot split as the layers they wrap, and what the refusal names
UNSPLIT = {
    "dora": (dict(use_dora=True), r"q_proj: is a LoRA layer with the variant \['default'\] \(as DoRA\)"),
    "dropout": (dict(lora_dropout=0.1), r"q_proj: is a LoRA layer with dropout, .* set lora_dropout=0"),
    "bias": (
        dict(lora_bias=True),
        r"o_proj: is a row-wise LoRA layer with lora_bias, .* set lora_bias=False",
    ),
}


def refused_under_tp(options: dict) -> str:
    """What ``parallelize`` raises on cp 1 x tp 2 for the LoRA of ``options`` on q and o."""
    model = _lora("llama", ("q_proj", "o_proj"), **options).get_base_model()
    with pytest.raises(ValueError) as raised:
        cpshard.parallelize(model, cpshard.make_mesh(cp=1, tp=2))
    return str(raised.value)


@pytest.mark.parametrize("case", sorted(UNSPLIT))
def test_lora_that_tp_cannot_split_is_refused_on_every_rank(ranks2, case):
    options, message = UNSPLIT[case]
    for refusal in ranks2.run(refused_under_tp, options):
        assert re.search(rf"model\.layers\.0\.self_attn\.{message}", refusal), refusal
        assert "run this model with tp=1" in refusal, refusal


def test_peft_s_wrapper_is_refused_naming_the_model_it_wraps():
    with pytest.raises(
        cpshard.LayoutError, match=r"PeftModel is PEFT's wrapper around a LlamaForCausalLM: pass "
    ):
        cpshard.make_cp_forward(_lora("llama"))


def refused_under_ep() -> str:
    """What ``parallelize`` raises on cp 2 x ep 2 for Qwen3-MoE with LoRA on its experts' down_proj."""
    model = _lora("qwen3_moe", ("down_proj",)).get_base_model()
    with pytest.raises(ValueError) as raised:
        cpshard.parallelize(model, cpshard.make_mesh(cp=2, ep=2))
    return str(raised.value)


def test_lora_on_experts_is_refused_under_ep_on_every_rank(ranks2):
    for refusal in ranks2.run(refused_under_ep):
        assert re.search(
            r"model\.layers\.\d+\.mlp\.experts is a ParamWrapper with parameters below it \(.*lora_A.*; "
            r"PEFT's LoRA on the experts\): ep=2 splits the experts' own weights alone; build the mesh "
            r"with ep=1",
            refusal,
        ), refusal


def adapters_after_parallelize(sizes: dict) -> str:
    """What the first cp call raises where LoRA's adapters were added to a model already parallelized over a
    mesh of ``sizes`` (its base weights DTensors, the adapters plain tensors that no rank splits or sums)."""
    model, mesh = tiny_model("llama"), cpshard.make_mesh(**sizes)
    cpshard.parallelize(model, mesh)
    torch.manual_seed(0)  # the adapters' draws alike on every rank
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"])).get_base_model()
    batch = tiny_batch(model.config.vocab_size, 2, 8)
    with pytest.raises(ValueError) as raised:
        cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, mesh)
    return str(raised.value)


@pytest.mark.parametrize(
    "sizes, where",
    [
        (dict(cp=1, tp=2), "on a mesh with tp=2 and ep=1"),
        (dict(fsdp=2, cp=1), "beside parallelize's DTensors"),
    ],
)
def test_adapters_added_after_parallelize_are_named_on_every_rank(ranks2, sizes, where):
    for refusal in ranks2.run(adapters_after_parallelize, sizes):
        assert (
            f"{where} cp_forward needs the parameters of cpshard.params_of(cpshard.parallelize(model, mesh)) "
            "(plain: model.layers.0.self_attn.q_proj.lora_A.default.weight, "
            "model.layers.0.self_attn.q_proj.lora_B.default.weight, "
            "model.layers.1.self_attn.q_proj.lora_A.default.weight, ...)" in refusal
        ), refusal
        assert "parallelize the model after adding any module, as LoRA's adapters" in refusal, refusal
