"""LoRA under cp: PEFT's adapters live in the modules of the model it wraps, so that model
(``peft_model.get_base_model()``) runs under cp as any model does, its adapters trained and its frozen
weights without a gradient, as in one process. PEFT's wrapper itself is refused, naming that way out."""

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model


def _lora(model_type: str):
    """The tiny model with LoRA adapters on q and v (B drawn, not zeros: the adapters change the output)."""
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    config.init_lora_weights = False
    return get_peft_model(tiny_model(model_type), config)


def lora_step(model_type: str, implementation: str, fsdp: bool) -> dict:
    """One ``loss.backward()`` under cp on the wrapped model (``fsdp``: sharded by ``parallelize`` over two
    dp groups that hold the same batch, cp 1) and one in this process alone on a copy: the losses, which
    parameters have a gradient in each, and the largest difference of the adapters' gradients relative to
    their scale."""
    torch.manual_seed(0)  # the adapters' draws alike on every rank
    own, model = (_lora(model_type).get_base_model() for _ in range(2))
    model.load_state_dict(own.state_dict())
    forward = cpshard.make_cp_forward(model, implementation=implementation)
    mesh = cpshard.make_mesh(**({"fsdp": 2, "cp": 1} if fsdp else {"cp": dist.get_world_size()}))
    if fsdp:
        cpshard.parallelize(model, mesh)
    batch = tiny_batch(model.config.vocab_size, 2, 23, pad="left")
    loss = forward(cpshard.params_of(model), batch, mesh).loss
    loss.backward()
    under_cp = {
        name: p.grad.full_tensor() if fsdp else p.grad
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


@pytest.mark.parametrize(
    "model_type, implementation, fsdp",
    [
        ("llama", "ulysses", False),
        ("llama", "ring", False),
        ("qwen3_next", "auto", False),
        ("llama", "auto", True),
    ],
)
def test_lora_adapters_train_as_in_one_process(ranks2, model_type, implementation, fsdp):
    for result in ranks2.run(lora_step, model_type, implementation, fsdp):
        cp_loss, own_loss = result["losses"]
        assert abs(cp_loss - own_loss) <= 1e-5 * abs(own_loss), result
        under_cp, own = result["with gradient"]
        assert under_cp == own and own and all(".lora_" in name for name in own), result
        assert result["worst"] <= 1e-5, result


def test_peft_s_wrapper_is_refused_naming_the_model_it_wraps():
    with pytest.raises(
        cpshard.LayoutError, match=r"PeftModel is PEFT's wrapper around a LlamaForCausalLM: pass "
    ):
        cpshard.make_cp_forward(_lora("llama"))
