"""torch.compile under cp: each decoder layer compiled (``make_cp_forward(compile=...)``), exact against one
process, with no graph break inside a layer and one graph for every layer; lengths that change recompile
once; the whole step compiled runs exact too, over compiled layers as well. Counted with torch's own
counters. Inductor (``compile=True``) runs once per case that only it can fail (its stride checks of the
custom ops, the ops it can lower); aot_eager proves the same tracing elsewhere at a fraction of the
compile time."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

import cpshard
from cpshard.comm.record import recording
from cpshard.runtime.compiled import check_compiled_parallelism, compile_options
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5


def _worst(output, grads, expected) -> float:
    loss, logits, ref_grads = expected
    diffs = [(output.loss - loss).abs().item(), (output.logits.full_tensor() - logits).abs().max().item()]
    return max(diffs + [(grads[name] - ref).abs().max().item() for name, ref in ref_grads.items()])


def step_bytes(log) -> int:
    """The bytes of a step's collectives: without the ranks' agreement, which a cp forward's first call
    alone adds (:mod:`cpshard.runtime.agreement`)."""
    return sum(event.nbytes for event in log.events if event.name != "cp forward agreement")


def _compiled_step(twin, forward, params, batch, mesh) -> dict:
    """One value_and_grad step of ``forward`` against one process running ``twin`` (the same weights,
    never compiled); the graph breaks, graphs compiled and bytes communicated during the step."""
    expected = reference(twin, cpshard.params_of(twin), batch)
    counters.clear()
    with recording() as log:
        output, grads = cpshard.value_and_grad(forward)(params, batch, mesh)
    return {
        "worst": _worst(output, grads, expected),
        "breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "bytes": step_bytes(log),
    }


def per_layer(
    implementation: str, checkpointing: bool, lengths=(15,), degree=None, compile="aot_eager", rows=2
) -> dict:
    """Steps of ``make_cp_forward(model, compile=compile)``, one per length, each against one process;
    the bytes one eager cp step communicates at the last length."""
    torch._dynamo.reset()
    model = tiny_model("llama").train()
    if checkpointing:
        model.activation_checkpointing_enable()
    twin = copy.deepcopy(model)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    options = dict(implementation=implementation, ulysses_degree=degree)
    compiled = cpshard.make_cp_forward(model, compile=compile, **options)
    params = cpshard.params_of(model)
    batches = [tiny_batch(128, rows, n, pad="right") for n in lengths]
    steps = [_compiled_step(twin, compiled, params, batch, mesh) for batch in batches]
    with recording() as log:
        cpshard.value_and_grad(cpshard.make_cp_forward(twin, **options))(
            cpshard.params_of(twin), batches[-1], mesh
        )
    return {"steps": steps, "eager bytes": step_bytes(log)}


def _check(results, first: int, graphs: int):
    """Every step exact without graph breaks, the same bytes as eager; ``first`` graphs compiled by the
    first step (1: one graph serves every layer), ``graphs`` over all steps."""
    for result in results:
        for step in result["steps"]:
            assert step["worst"] <= TOLERANCE, result
            assert step["breaks"] == 0, f"graph breaks inside the compiled layers: {result}"
        assert result["steps"][-1]["bytes"] == result["eager bytes"], "compiled collectives differ from eager"
        assert result["steps"][0]["graphs"] == first, f"one graph should serve every layer: {result}"
        assert sum(step["graphs"] for step in result["steps"]) <= graphs, f"recompiled: {result}"


@pytest.mark.parametrize(
    "implementation, checkpointing, compile",
    [("ulysses", True, "aot_eager"), ("ring", False, True), ("ring", True, "aot_eager")],
    ids=["ulysses-checkpointed", "ring-inductor", "ring-checkpointed"],
)
def test_each_compiled_layer_is_exact_without_graph_breaks(ranks2, implementation, checkpointing, compile):
    # one graph, the checkpoint's recompute included (it runs with the same parameters)
    _check(ranks2.run(per_layer, implementation, checkpointing, compile=compile), 1, 1)


def test_hybrid_compiled_layers_are_exact_without_graph_breaks(ranks4):
    # the "eager" backend: dynamo's trace (breaks, graphs) on 4 ranks; aot_eager covers the same ops above
    _check(ranks4.run(per_layer, "hybrid", False, (15,), 2, "eager"), 1, 1)


def test_five_lengths_compile_at_most_twice(ranks2):
    # Ulysses without checkpointing: one graph at the first length, one more over the other four; one row,
    # so that rank 1's cut is a slice of the embeddings that needs no copy to be contiguous
    _check(ranks2.run(per_layer, "ulysses", False, (9, 12, 15, 21, 26), rows=1), 1, 2)


def whole_step(implementation: str, layers, backend: str, lengths: tuple[int, ...] = (15,)) -> dict:
    """``torch.compile(value_and_grad(cp_forward), backend=backend)`` over ``make_cp_forward(model,
    compile=layers)`` at each of ``lengths`` in turn (a second length compiles again with dynamic sizes):
    exact at the last; the graph breaks it takes, by reason."""
    torch._dynamo.reset()
    model = tiny_model("llama").train()
    twin = copy.deepcopy(model)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    forward = cpshard.make_cp_forward(model, implementation=implementation, compile=layers)
    step, params = torch.compile(cpshard.value_and_grad(forward), backend=backend), cpshard.params_of(model)
    counters.clear()
    for length in lengths:
        batch = tiny_batch(128, 2, length, pad="right")
        output, grads = step(params, batch, mesh)
    expected = reference(twin, cpshard.params_of(twin), batch)
    return {"worst": _worst(output, grads, expected), "breaks": sum(counters["graph_break"].values())}


@pytest.mark.parametrize(
    "implementation, layers, backend, lengths",
    [("ulysses", False, "aot_eager", (16, 15)), ("ring", True, "inductor", (15,))],
    ids=["ulysses-two-lengths", "ring-over-compiled-layers-inductor"],
)
def test_whole_compiled_step_is_exact(ranks2, implementation, layers, backend, lengths):
    """At a second length cp must pad (15 on 2 ranks), as at the first (the loss's gather once failed
    there under dynamic sizes)."""
    for result in ranks2.run(whole_step, implementation, layers, backend, lengths):
        assert result["worst"] <= TOLERANCE, result
        assert result["breaks"] > 0, "the batch checks and the running call break the whole step's graph"


def test_compile_takes_true_or_a_backend_and_refuses_tp_and_ep():
    assert compile_options(True) == {} and compile_options("aot_eager") == {"backend": "aot_eager"}
    with pytest.raises(ValueError, match="compile=3"):
        compile_options(3)
    check_compiled_parallelism(1, 1)
    for tp, ep in ((2, 1), (1, 2)):
        with pytest.raises(ValueError, match=f"tp={tp}, ep={ep}"):
            check_compiled_parallelism(tp, ep)
