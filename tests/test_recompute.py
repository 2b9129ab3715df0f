"""cp_forward under transformers' activation checkpointing: the recompute re-runs the collectives, exactly;
make_cp_forward(attention_recompute=True) checkpoints each attention on its own, with or without the
layers'."""

import pytest
import torch.distributed as dist

import cpshard
from cpshard.runtime.recompute import checkpointing_modules
from cpshard.tools.parity import check_parity, reference
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5


def parity_with_checkpointing(implementation: str, logits: bool, checkpointing: bool):
    model = tiny_model("llama", num_hidden_layers=3).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    funcs = {id(m): m._gradient_checkpointing_func for m in checkpointing_modules(model)}
    batch = tiny_batch(model.config.vocab_size, 2, 15, pad="right")
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    parity = check_parity(
        model, batch, mesh, cpshard.make_cp_forward(model, implementation=implementation, logits=logits)
    )
    unchanged = {id(m): m._gradient_checkpointing_func for m in checkpointing_modules(model)} == funcs
    return parity, len(funcs), unchanged


@pytest.mark.parametrize("logits", [True, False])
@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_checkpointed_layers_recompute_inside_the_call(ranks2, implementation, logits):
    plain = ranks2.run(parity_with_checkpointing, implementation, logits, False)
    checkpointed = ranks2.run(parity_with_checkpointing, implementation, logits, True)
    for (parity, layers, unchanged), (baseline, _, _) in zip(checkpointed, plain):
        assert layers >= 3, "checkpointing was not enabled on the decoder layers, so nothing was recomputed"
        assert unchanged, "the checkpoint functions were left changed after the call"
        assert parity.worst <= TOLERANCE, parity.diffs
        assert parity.comm_bytes > baseline.comm_bytes, (
            "the backward did not re-run the forward's collectives"
        )


def gradients_of_other_params() -> float:
    """A functional step on parameters that are not the module's own (an optimizer's output): the
    recompute must use them, not the stale weights the module holds. Returns the largest relative
    difference from one process without checkpointing."""
    model, twin = tiny_model("llama", num_hidden_layers=2).train(), tiny_model("llama", num_hidden_layers=2)
    model.activation_checkpointing_enable()
    params = {name: p.detach() * 1.5 + 0.01 for name, p in cpshard.params_of(model).items()}
    batch = tiny_batch(model.config.vocab_size, 2, 15)
    _, _, want = reference(twin, params, batch)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    _, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(params, batch, mesh)
    return max(((grads[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


def test_the_recompute_uses_the_calls_parameters(ranks2):
    assert max(ranks2.run(gradients_of_other_params)) <= TOLERANCE


def attention_recomputed(implementation: str, checkpointing: bool) -> tuple[float, int]:
    """The largest relative difference of loss, logits and gradients from one process, and how many times
    each layer's attention ran in one step. The parameters are not the module's own (an optimizer's
    output)."""
    model, twin = tiny_model("llama", num_hidden_layers=2).train(), tiny_model("llama", num_hidden_layers=2)
    if checkpointing:
        model.activation_checkpointing_enable()
    params = {name: p.detach() * 1.1 for name, p in cpshard.params_of(model).items()}
    batch = tiny_batch(model.config.vocab_size, 2, 15, pad="right")
    want_loss, want_logits, want = reference(twin, params, batch)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    step = cpshard.value_and_grad(
        cpshard.make_cp_forward(model, implementation=implementation, attention_recompute=True)
    )
    step(params, batch, mesh)
    runs = []
    model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: runs.append(1))
    out, grads = step(params, batch, mesh)
    diffs = [((out.loss - want_loss).abs() / want_loss.abs()).item()]
    diffs.append(((out.logits.full_tensor() - want_logits).abs().max() / want_logits.abs().max()).item())
    diffs += [((grads[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want]
    return max(diffs), len(runs)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["alone", "in-checkpointed-layers"])
@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_attention_recomputed_apart_is_exact(ranks2, implementation, checkpointing):
    for worst, runs in ranks2.run(attention_recomputed, implementation, checkpointing):
        assert worst <= TOLERANCE
        assert runs == (3 if checkpointing else 2)  # the forward, the layer's recompute, the attention's
