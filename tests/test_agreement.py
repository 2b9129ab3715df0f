"""Every rank runs the same cp forward on the same weights (cpshard.runtime.agreement): ranks that made it
otherwise or hold other weights are refused on every rank, on the first call, by one small all-gather."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.call import split_call
from cpshard.comm.record import recording
from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.runtime.agreement import config_text
from cpshard.tools.tiny import tiny_batch, tiny_model


def first_call(models: tuple[dict, dict], forwards: tuple[dict, dict], generate: bool = False) -> str:
    """One call of a cp forward made on each rank with that rank's model (``tiny_model``'s arguments) and
    options; what it raised."""
    rank = dist.get_rank()
    model = tiny_model("llama", **models[rank])
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    mesh = cpshard.make_mesh(cp=2)
    try:
        if generate:
            cpshard.generate(model, {"input_ids": batch["input_ids"]}, mesh, max_new_tokens=2)
        else:
            cpshard.value_and_grad(cpshard.make_cp_forward(model, **forwards[rank]))(
                cpshard.params_of(model), batch, mesh
            )
    except ValueError as error:
        return str(error)
    return "no error"


def test_weights_that_differ_across_the_ranks_are_refused_on_every_rank(ranks2):
    """A model built with another seed on each rank (its norms alike, all ones): each rank's tokens ran with
    its own weights, the loss and gradients of no one model (the batch was checked, the weights were not)."""
    for generate in (False, True):
        messages = ranks2.run(first_call, ({"seed": 0}, {"seed": 1}), ({}, {}), generate)
        assert messages[0] == messages[1], messages
        assert messages[0].startswith(
            "the parameters differ across the mesh: ranks [1] hold other values than rank 0 for 16 of them "
            "(e.g. ['model.embed_tokens.weight', 'model.layers.0.self_attn.q_proj.weight'"
        ), messages[0]
        assert "build the model after torch.manual_seed with one seed on every rank" in messages[0]


@pytest.mark.parametrize(
    "forwards, rank_0_s",
    [
        # rank 1 waited in the ring's receive for ever while rank 0 timed out in its all-to-all
        (({"implementation": "ulysses"}, {"implementation": "ring"}), "implementation='ulysses'"),
        (({}, {"logits": False, "mlp_tile": 4}), "logits=True, mlp_tile=None"),
    ],
)
def test_a_cp_forward_made_otherwise_on_a_rank_is_refused_on_every_rank(ranks2, forwards, rank_0_s):
    """Every rank's message names the options in which the ranks differ, each rank's (each rank named all of
    its own only before)."""
    messages = ranks2.run(first_call, ({}, {}), forwards)
    assert messages[0] == messages[1], messages
    rank_1_s = ", ".join(f"{name}={value!r}" for name, value in forwards[1].items())
    assert messages[0] == (
        "the cp forward differs across the mesh: ranks [1] made it with another layout or other options "
        f"than rank 0 (rank 0: {rank_0_s}; rank 1: {rank_1_s}); every rank makes the same cp "
        "forward (each rank's options choose the collectives it waits in)"
    ), messages[0]


@pytest.mark.parametrize(
    "models, counts",
    [
        (({}, {"num_hidden_layers": 3}), "rank 0: 21, rank 1: 30"),
        (({}, {"intermediate_size": 96}), "rank 0: 21, rank 1: 21"),
        (({}, {"dtype": torch.bfloat16}), "rank 0: 21, rank 1: 21"),  # blamed on the seed before
    ],
    ids=["layers", "widths", "dtypes"],
)
def test_models_built_otherwise_on_a_rank_are_refused_on_every_rank(ranks2, models, counts):
    """A config differing on rank 1: its agreement row (a digest per parameter) was longer than rank 0's,
    and gloo aborted rank 0 in the all-gather (SIGABRT); one of other widths was blamed on the weights."""
    for generate in (False, True):
        messages = ranks2.run(first_call, models, ({}, {}), generate)
        assert messages[0] == messages[1], messages
        assert messages[0] == (
            "the model differs across the mesh: ranks [1] built a model whose parameters differ in name, "
            f"shape or dtype from rank 0's (parameters: {counts}); every rank builds the same model from the "
            "same config, in the same dtype"
        ), messages[0]


def plain_params_on_rank_1_beside_parallelized_ones() -> str:
    """On a tp=2 mesh rank 0 passes its parallelized params (DTensors), rank 1 the plain model's."""
    model, plain = tiny_model("llama"), cpshard.params_of(tiny_model("llama"))
    mesh = cpshard.make_mesh(cp=1, tp=2)
    parallel = cpshard.params_of(cpshard.parallelize(model, mesh))
    try:
        cpshard.value_and_grad(cpshard.make_cp_forward(model))(
            plain if dist.get_rank() == 1 else parallel, tiny_batch(model.config.vocab_size, 2, 16), mesh
        )
    except ValueError as error:
        return str(error)
    return "no error"


def test_plain_params_beside_parallelized_ones_are_refused_by_their_placement(ranks2):
    """A DTensor's digest is zeros (its shards differ by design), so the ranks were told that they "hold
    other values", as if seeded otherwise, and not that one passed the plain model's params."""
    messages = ranks2.run(plain_params_on_rank_1_beside_parallelized_ones)
    assert messages[0] == messages[1], messages
    assert messages[0] == (
        "the params are placed otherwise across the mesh: ranks [1] pass parameters placed otherwise than "
        "rank 0's (DTensors among them: rank 0: 21, rank 1: 0); every rank passes the same kind of params: "
        "plain ones on every rank, or cpshard.params_of(cpshard.parallelize(model, mesh)) on every rank"
    ), messages[0]


def test_a_config_differing_where_no_parameter_shows_it_is_refused_on_every_rank(ranks2):
    """Rank 1's model has another rotary base and norm epsilon, every parameter alike: each rank's tokens
    ran through its own model, the loss and gradients of no one model, without a word."""
    other = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rms_norm_eps": 1e-5}
    for generate in (False, True):
        messages = ranks2.run(first_call, ({}, other), ({}, {}), generate)
        assert messages[0] == messages[1], messages
        assert messages[0] == (
            "the model's config differs across the mesh: ranks [1] built the model from another config than "
            "rank 0's (rank 0: rms_norm_eps=1e-06, rope_parameters={'rope_theta': 10000.0, 'rope_type': "
            "'default'}; rank 1: rms_norm_eps=1e-05, rope_parameters={'rope_theta': 500000.0, 'rope_type': "
            "'default'}); every rank builds the same model from the same config"
        ), messages[0]


def agreement_gathers() -> list[int]:
    """The agreement's all-gathers in a cp forward's first call and in its second."""
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    mesh, forward = cpshard.make_mesh(cp=2), cpshard.make_cp_forward(model)
    counts = []
    for _ in range(2):
        with recording() as log:
            forward(cpshard.params_of(model), batch, mesh)
        counts.append(sum(1 for event in log.events if event.name == "cp forward agreement"))
    return counts


def test_the_ranks_agree_once_per_cp_forward(ranks2):
    assert ranks2.run(agreement_gathers) == [[1, 0], [1, 0]]


def _lacking_on_the_last_rank(params: dict) -> dict:
    """``params`` without the final norm's weight on the last rank, whole on the others."""
    if dist.get_rank() < dist.get_world_size() - 1:
        return params
    return {name: value for name, value in params.items() if name != "model.norm.weight"}


def params_lacking_one_on_the_last_rank(on_call: int) -> str:
    """The last rank leaves a parameter out of its params (the others give them all) on a cp forward's call
    ``on_call`` (0: the first)."""
    model = tiny_model("llama")
    params = cpshard.params_of(model)
    lacking = _lacking_on_the_last_rank(params)
    forward, batch = cpshard.make_cp_forward(model), tiny_batch(model.config.vocab_size, 2, 16)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    try:
        for call in range(on_call + 1):
            forward(lacking if call == on_call else params, batch, mesh)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("on_call", [0, 2], ids=["first-call", "later-call"])
def test_params_that_fail_their_checks_on_one_rank_stop_every_rank(ranks2, on_call):
    """Rank 1's own check raised before the first call's agreement or a later call's batch check, whose
    all-gather rank 0 then waited in until the group's timeout; the gather carries the failure now: rank 1
    says what is wrong, rank 0 who failed."""
    messages = ranks2.run(params_lacking_one_on_the_last_rank, on_call)
    assert messages[1].startswith("params lacks 1 of LlamaForCausalLM's parameters"), messages
    assert messages[0].startswith("ranks [1] failed cp_forward's checks of the model and its params"), (
        messages
    )


def test_params_that_fail_their_checks_on_a_later_call_at_cp1_are_refused():
    """One rank: a later call's failure, carried to the batch check, is raised there too."""
    with cpshard.LocalRanks(1, timeout=120) as ranks:
        (message,) = ranks.run(params_lacking_one_on_the_last_rank, 2)
    assert message.startswith("params lacks 1 of LlamaForCausalLM's parameters"), message


def _raising_under_cp(module, args):
    if split_call() is not None:
        raise TypeError("a layer that fails on a cp slice")


def retried_after_a_failed_probe() -> str:
    """A first call whose probe fails on every rank (a layer raising under cp), retried once the user took
    that layer's hook away, with a misshapen final norm on the last rank."""
    model = tiny_model("llama", attn_implementation="auto")
    hook = model.model.layers[1].register_forward_pre_hook(_raising_under_cp)
    forward = cpshard.make_cp_forward(model, layout=DECODER.with_rows(name="renamed"))
    params, batch, mesh = (
        cpshard.params_of(model),
        tiny_batch(model.config.vocab_size, 2, 9),
        cpshard.make_mesh(cp=2),
    )
    try:
        forward(params, batch, mesh)
    except cpshard.LayoutError:
        hook.remove()
    if dist.get_rank() == 1:
        params = {**params, "model.norm.weight": torch.ones(model.config.hidden_size + 1)}
    try:
        forward(params, batch, mesh)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_call_retried_after_a_failed_probe_agrees_again(ranks2):
    """The retry probed again, rank 1 with its failing params: its one-process run raised there, and every
    rank blamed the model ("fix the model or its config; this is not cp's doing"). Until a probe passes every
    call is a first call: the agreement carries the failure, before any rank probes."""
    messages = ranks2.run(retried_after_a_failed_probe)
    assert messages[1].startswith("params differ in shape from LlamaForCausalLM's: model.norm.weight"), (
        messages
    )
    assert messages[0].startswith("ranks [1] failed cp_forward's checks of the model and its params"), (
        messages
    )


class _Unwritable:
    def __repr__(self) -> str:
        return "_Unwritable()"


def test_a_config_field_json_cannot_write_is_compared_by_its_repr():
    """``to_json_string`` raises on a custom object; the first call would have failed on it."""
    config = tiny_model("llama").config
    config.custom = _Unwritable()
    with pytest.raises(TypeError):
        config.to_json_string(use_diff=True)
    assert "custom=_Unwritable()" in config_text(config).split("\n")
