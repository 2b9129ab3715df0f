"""Each cp rank draws its dropout from a stream of its own within a call (cpshard.streams): with the ranks
seeded alike, one stream everywhere dropped the same positions of every rank's slice. The caller's stream
moves by one draw, alike on every rank; a checkpointed layer replays its rank's draws in the backward; what
cpshard runs to learn about a model draws nothing from the caller's streams."""

import torch
import torch.distributed as dist

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model

#: GPT-2 with its residual dropout (its MLP's ``dropout`` module) at one half, every other dropout off
DROPPING = dict(resid_pdrop=0.5)
MLP_DROPOUT = "transformer.h.0.mlp.dropout"


def _step(model, mesh, **options):
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    return cpshard.value_and_grad(cpshard.make_cp_forward(model, **options))(
        cpshard.params_of(model), batch, mesh
    )


def dropped_positions() -> torch.Tensor:
    """This rank's MLP dropout mask in a training call (the ranks seeded alike)."""
    torch.manual_seed(0)
    model, masks = tiny_model("gpt2", **DROPPING).train(), []
    model.get_submodule(MLP_DROPOUT).register_forward_hook(lambda m, args, out: masks.append(out == 0))
    _step(model, cpshard.make_mesh(cp=2))
    return masks[-1]  # the probe's runs come first, in eval mode


def test_each_cp_rank_drops_its_own_positions(ranks2):
    first, second = ranks2.run(dropped_positions)
    assert first.shape == second.shape and first.shape[:2] == (2, 8)  # each rank's slice of 16 tokens
    assert not torch.equal(first, second), "every rank dropped the same positions of its slice"
    for mask in (first, second):
        assert 0.4 < mask.float().mean() < 0.6


def stream_moves() -> dict:
    """The caller's next draws after making a cp forward (derived layout: a recording run) and after its
    first training call (the probe's runs, then the call), against a stream moved by one draw."""
    mesh = cpshard.make_mesh(cp=2)
    model = tiny_model("gpt2", **DROPPING).train()
    torch.manual_seed(1)
    forward = cpshard.make_cp_forward(model)
    after_make = torch.rand(4)
    torch.manual_seed(1)
    untouched = torch.rand(4)
    torch.manual_seed(1)
    forward(cpshard.params_of(model), tiny_batch(model.config.vocab_size, 2, 16), mesh)
    after_call = torch.rand(4)
    torch.manual_seed(1)
    torch.randint(0, 1 << 62, (1,))
    one_draw = torch.rand(4)
    return {
        "make": torch.equal(after_make, untouched),
        "call": torch.equal(after_call, one_draw),
        "next": after_call,
    }


def test_the_callers_stream_moves_by_one_draw_alike_on_every_rank(ranks2):
    first, second = ranks2.run(stream_moves)
    assert first["make"] and first["call"], first
    assert torch.equal(first["next"], second["next"])


def replayed(checkpointed: bool) -> tuple:
    """A training step with dropout, its layers checkpointed and each attention recomputed or neither."""
    model = tiny_model("gpt2", **DROPPING).train()
    if checkpointed:
        model.activation_checkpointing_enable()
    torch.manual_seed(2)
    out, grads = _step(model, cpshard.make_mesh(cp=2), attention_recompute=checkpointed)
    return out.loss.detach(), grads


def test_a_checkpointed_layer_replays_its_ranks_draws(ranks2):
    for (loss, grads), (plain_loss, plain_grads) in zip(
        ranks2.run(replayed, True), ranks2.run(replayed, False)
    ):
        assert torch.allclose(loss, plain_loss, rtol=1e-6), (loss, plain_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def dropout_off_in_eval() -> bool:
    """In eval mode a call draws nothing: the caller's stream is where it was."""
    model = tiny_model("gpt2", **DROPPING).eval()
    forward, mesh = cpshard.make_cp_forward(model), cpshard.make_mesh(cp=2)
    torch.manual_seed(3)
    forward(cpshard.params_of(model), tiny_batch(model.config.vocab_size, 2, 16), mesh)
    after = torch.rand(2)
    torch.manual_seed(3)
    return torch.equal(after, torch.rand(2)) and dist.get_world_size() == 2


def test_an_eval_call_draws_nothing(ranks2):
    assert ranks2.run(dropout_off_in_eval) == [True, True]


def dropped_under_tp() -> tuple[int, int, torch.Tensor]:
    """This rank's cp and tp coordinates and its MLP dropout mask in a training call at tp=2 x cp=2 (GPT-2's
    derived plan splits nothing of it: its blocks run whole, replicated, on both tp ranks)."""
    torch.manual_seed(0)
    model, masks = tiny_model("gpt2", **DROPPING).train(), []
    model.get_submodule(MLP_DROPOUT).register_forward_hook(lambda m, args, out: masks.append(out == 0))
    forward = cpshard.make_cp_forward(model)
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=4))  # the probe, on the plain weights
    mesh = cpshard.make_mesh(cp=2, tp=2)
    params = cpshard.params_of(cpshard.parallelize(model, mesh))
    cpshard.value_and_grad(forward)(params, batch, mesh)
    return mesh.get_local_rank("cp"), mesh.get_local_rank("tp"), masks[-1]


def test_tensor_parallel_ranks_drop_alike_and_cp_ranks_apart(ranks4):
    masks = {(cp, tp): mask for cp, tp, mask in ranks4.run(dropped_under_tp)}
    for cp in (0, 1):  # a replicated activation dropped otherwise on a tp rank would part the replicas
        assert torch.equal(masks[cp, 0], masks[cp, 1])
    assert not torch.equal(masks[0, 0], masks[1, 0])


def dropped_with_one_part_training() -> torch.Tensor:
    """The MLP dropout mask of a model in eval mode but for that dropout (Monte Carlo dropout, a frozen
    model with one part training): the top module's mode is not the model's."""
    torch.manual_seed(0)
    model, masks = tiny_model("gpt2", **DROPPING).eval(), []
    model.get_submodule(MLP_DROPOUT).train()
    model.get_submodule(MLP_DROPOUT).register_forward_hook(lambda m, args, out: masks.append(out == 0))
    _step(model, cpshard.make_mesh(cp=2))
    return masks[-1]


def test_a_model_with_one_part_training_draws_per_rank_too(ranks2):
    first, second = ranks2.run(dropped_with_one_part_training)
    assert not torch.equal(first, second), "every rank dropped the same positions of its slice"
