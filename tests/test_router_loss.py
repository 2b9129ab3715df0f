"""The MoE router's load-balancing loss under cp: the whole batch's, as one process computes it."""

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import cpshard
from cpshard.loss.router import load_balancing_loss
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model

ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.5)


@pytest.mark.parametrize("masked", [False, True])
def test_one_process_is_transformers_own(masked):
    generator = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(2 * 9, 8, generator=generator) for _ in range(3))
    mask = torch.ones(2, 9)
    if masked:
        mask[1, :4] = 0
    expected = load_balancing_loss_func(logits, 8, 2, mask.long() if masked else None)
    assert torch.equal(load_balancing_loss(logits, 8, 2, mask, None), expected)


def parity_with_router_loss(implementation: str, logits: bool, pad: str | None, coefficient: float):
    model = tiny_model("qwen3_moe", **{**ROUTER_LOSS, "router_aux_loss_coef": coefficient})
    batch = tiny_batch(model.config.vocab_size, 2, 13, pad=pad)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    cp_forward = cpshard.make_cp_forward(model, implementation=implementation, logits=logits)
    return check_parity(model, batch, mesh, cp_forward)


@pytest.mark.parametrize("pad", [None, "left"])
@pytest.mark.parametrize("implementation, logits", [("ulysses", True), ("ring", True), ("ulysses", False)])
def test_router_loss_over_the_whole_batch(ranks2, implementation, logits, pad):
    with_loss = ranks2.run(parity_with_router_loss, implementation, logits, pad, 0.5)
    without = ranks2.run(parity_with_router_loss, implementation, logits, pad, 0.0)
    for parity, plain in zip(with_loss, without):
        assert not failing_rows([parity]), (parity.diffs, parity.scales)
        assert parity.scales["loss"] != plain.scales["loss"], "the router loss did not count in the reference"
        sparse = "grad model.layers.1.mlp"  # the router's gradients change with the loss's weight
        assert parity.scales[sparse] != plain.scales[sparse], (parity.scales, plain.scales)


def parity_of_routers_without_loss(model_type: str):
    """A model that returns its router logits but adds no load-balancing loss (DeepSeek-V3, with no
    coefficient in its config; Llama 4, with one its forward does not use): cp adds none either."""
    model = tiny_model(model_type, output_router_logits=True)
    batch = tiny_batch(model.config.vocab_size, 2, 13, pad="left")
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    return check_parity(model, batch, mesh, cpshard.make_cp_forward(model))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "llama4_text"])
def test_a_model_that_adds_no_router_loss_gets_none(ranks2, model_type):
    for parity in ranks2.run(parity_of_routers_without_loss, model_type):
        assert not failing_rows([parity]), (parity.diffs, parity.scales)
