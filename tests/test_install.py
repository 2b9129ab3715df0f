"""The install step: once per model, never doubled (a deepcopy, a second make_cp_forward), and checked on
every call (a model switched back to plain attention is wrapped again, never run on a slice)."""

import copy

import torch
import torch.distributed as dist

import cpshard
from cpshard.interfaces import _Marked
from cpshard.runtime.install import ensure_installed, install
from cpshard.tools.parity import check_parity
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5


def _worst(parity) -> float:
    assert parity.comm_bytes > 0, "nothing was communicated, so nothing was split"
    return max(parity.diffs.values())


def _marked_hooks(model) -> int:
    return sum(
        isinstance(hook, _Marked)
        for module in model.modules()
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
    )


def _batch(model, seed=0):
    torch.manual_seed(seed)
    return tiny_batch(model.config.vocab_size, 2, 13, pad="left")


def prepared_twice_and_copied() -> dict:
    """A deepcopy of a prepared model (the usual DPO reference) and a second make_cp_forward stay exact."""
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    model = tiny_model("llama")
    cpshard.make_cp_forward(model)
    hooks = _marked_hooks(model)
    twin = copy.deepcopy(model)
    results = {"hooks": hooks, "twin hooks before": _marked_hooks(twin)}
    twin_forward = cpshard.make_cp_forward(twin)
    results["twin hooks after"] = _marked_hooks(twin)
    results["twin"] = _worst(check_parity(twin, _batch(twin), mesh, twin_forward))
    again = cpshard.make_cp_forward(model, implementation="ring")
    results["hooks again"] = _marked_hooks(model)
    results["again"] = _worst(check_parity(model, _batch(model), mesh, again))
    return results


def test_deepcopy_and_second_forward_stay_exact(ranks2):
    for result in ranks2.run(prepared_twice_and_copied):
        # per layer the cut, one on the final norm, one on the LM head: 2 layers -> 4 (tp hooks go in at the
        # first tp > 1 call)
        assert result["hooks"] == 4
        assert result["twin hooks before"] == result["twin hooks after"] == result["hooks again"] == 4
        assert result["twin"] <= TOLERANCE and result["again"] <= TOLERANCE, result


def switched_back() -> dict:
    """After make_cp_forward, the model is switched back to plain sdpa in the two ways users do it."""
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    model = tiny_model("llama")
    cp_forward = cpshard.make_cp_forward(model)
    model.set_attn_implementation("sdpa")
    results = {"set_attn_implementation": _worst(check_parity(model, _batch(model), mesh, cp_forward))}
    results["attention after"] = model.config._attn_implementation
    # a reference (or teacher, or EMA) model built from the same config object resets the shared config
    reference = type(model)._from_config(model.config, attn_implementation="eager")
    results["shared config"] = model.config._attn_implementation
    results["from the same config"] = _worst(check_parity(model, _batch(model, 1), mesh, cp_forward))
    results["attention then"] = model.config._attn_implementation
    results["reference is a model"] = isinstance(reference, torch.nn.Module)
    return results


def test_switched_back_attention_is_wrapped_again(ranks2):
    for result in ranks2.run(switched_back):
        assert result["set_attn_implementation"] <= TOLERANCE, result
        assert result["shared config"] == "eager", "the second model did not reset the shared config"
        assert result["from the same config"] <= TOLERANCE, result
        assert result["attention after"] == "cpshard_sdpa" and result["attention then"] == "cpshard_eager"


def test_install_is_idempotent_on_one_process():
    model = tiny_model("qwen3")
    layout = cpshard.make_cp_forward(model).layout
    first = _marked_hooks(model)
    install(model, layout)
    install(model, layout)
    # the cut on 2 layers, one on the final norm, one on the head
    assert first == _marked_hooks(model) == 4
    ensure_installed(model, layout, tp=2)
    ensure_installed(model, layout, tp=2)
    assert _marked_hooks(model) == 12, "at tp > 1: two tp entries and two row-wise outputs per layer, once"
    batch = _batch(model)
    with torch.no_grad():
        expected = tiny_model("qwen3")(**batch).logits  # same seed, same weights, never installed
        assert torch.equal(model(**batch).logits, expected), "outside a cp call the model is unchanged"


def with_a_vision_tower_of_its_own_attention() -> dict:
    """GOT-OCR2's vision tower keeps its own attention code (transformers declines to switch it, so the
    model's top-level config keeps eager): its text decoder's attention modules take cp's, and cp serves
    the text exactly (a batch of token ids never runs the tower)."""
    model = tiny_model("got_ocr2", attn_implementation="auto")
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    batch = tiny_batch(model.config.text_config.vocab_size, 2, 13, pad="left")
    worst = _worst(check_parity(model, batch, mesh, cpshard.make_cp_forward(model)))
    return {
        "worst": worst,
        "text": model.config.text_config._attn_implementation,
        "vision": model.config.vision_config._attn_implementation,
    }


def test_a_part_that_keeps_its_own_attention_is_left_as_it_is(ranks2):
    for result in ranks2.run(with_a_vision_tower_of_its_own_attention):
        assert result["worst"] <= TOLERANCE, result
        assert (result["text"], result["vision"]) == ("cpshard_eager", "eager"), result
