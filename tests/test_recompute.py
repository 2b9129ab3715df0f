"""cp_forward under transformers' activation checkpointing: the recompute re-runs the collectives, exactly."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.runtime.recompute import checkpointing_modules
from cpshard.tools.parity import check_parity
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


def checkpointed_with_other_params() -> tuple[float, float]:
    """cp_forward's ``params`` are not the module's own (an optimizer's output): the recompute in the
    backward must use them too. The reference is a model that does not checkpoint at all."""
    mesh = cpshard.make_mesh(cp=2)
    model = tiny_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = {name: value.detach() * 1.05 for name, value in cpshard.params_of(model).items()}
    batch = tiny_batch(model.config.vocab_size, 2, 11)
    out, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(params, batch, mesh)
    leaves = {name: value.clone().requires_grad_(True) for name, value in params.items()}
    reference = torch.func.functional_call(tiny_model("llama"), leaves, (), batch, strict=False)
    wanted = torch.autograd.grad(reference.loss, list(leaves.values()))
    worst = max(float((grads[name] - want).abs().max()) for name, want in zip(leaves, wanted))
    return float((out.loss - reference.loss).abs()), worst


def test_the_recompute_uses_the_calls_params_not_the_modules(ranks2):
    for loss_diff, grad_diff in ranks2.run(checkpointed_with_other_params):
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5, (loss_diff, grad_diff)
