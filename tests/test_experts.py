"""Expert parallelism on real gloo groups: each rank's token slice through its own block of experts gives
one process's experts layer on all tokens (outputs, and gradients of hidden states, routing weights and
every expert weight), routes every token as one process does, and moves exactly the rows the routing
implies."""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeTopKRouter,
)

import cpshard
from cpshard.call import CallPlan, running
from cpshard.comm.exchange import all_to_all_rows
from cpshard.comm.record import recording
from cpshard.debug.optimum import ep_bytes, tp_share_bytes
from cpshard.layouts.decoder import LAYOUT
from cpshard.parallel.experts import (
    check_experts,
    ep_experts,
    exchange_counts,
    experts_name,
    gather_pairs,
    install_experts,
    local_expert_ids,
    rank_counts,
    route,
)
from cpshard.parallel.placement import expert_mesh
from cpshard.tools.tiny import tiny_config, tiny_model

E, K, H, FFN = 8, 2, 16, 8
ROWS, LENGTH = 2, 12  # a batch of 2 sequences; each rank holds LENGTH / ep positions of both, as under cp
TOLERANCE = dict(rtol=1e-5, atol=1e-5)
#: expert probabilities per rank slot: skewed, with experts no token of that slot picks
SKEWS = {
    "uneven": lambda slot: torch.tensor([8.0, 1, 0, 3, 1, 0.5, 2, 1]).roll(slot),
    # experts 4..7 never picked: the owner of the upper block (ep=2) receives no row at all
    "starved": lambda slot: torch.tensor([1.0, 2, 3, 4, 0, 0, 0, 0]),
}
_GROUPS: dict = {}


def _config(implementation: str = "eager"):
    config = tiny_config(
        "qwen3_moe", hidden_size=H, moe_intermediate_size=FFN, num_experts=E, num_experts_per_tok=K
    )
    config._experts_implementation = implementation
    return config


def _ep_group(ep: int):
    """The ep group of this rank: every rank, or consecutive pairs on 4 ranks (two groups side by side)."""
    if ep not in _GROUPS:
        world = dist.get_world_size()
        _GROUPS[ep] = cpshard.make_mesh(cp=ep, fsdp=world // ep).get_group("cp")
    return _GROUPS[ep]


def _whole(seed: int, skew: str, ep: int) -> dict:
    """One process's inputs for the whole batch, the same on every rank of a group."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, LENGTH, H, generator=generator)
    slots = torch.arange(LENGTH).repeat(ROWS, 1) * ep // LENGTH  # which rank holds each token
    probs = torch.stack([SKEWS[skew](int(s)) for s in slots.reshape(-1)])
    index = torch.multinomial(probs, K, replacement=False, generator=generator).view(ROWS, LENGTH, K)
    weights = torch.rand(ROWS, LENGTH, K, generator=generator) + 0.1
    experts = Qwen3MoeExperts(_config())
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * FFN, H, generator=generator) * 0.3)
        experts.down_proj.copy_(torch.randn(E, H, FFN, generator=generator) * 0.3)
    upstream = torch.randn(ROWS, LENGTH, H, generator=generator)
    return dict(hidden=hidden, index=index, weights=weights, experts=experts, upstream=upstream)


def _mine(x: torch.Tensor, rank: int, ep: int) -> torch.Tensor:
    """This rank's positions of every row, flattened to tokens."""
    return x.chunk(ep, dim=1)[rank].reshape(-1, *x.shape[2:])


def _reference(data: dict) -> dict:
    """One process's experts layer on all tokens, and its gradients."""
    hidden = data["hidden"].reshape(-1, H).clone().requires_grad_(True)
    weights = data["weights"].reshape(-1, K).clone().requires_grad_(True)
    experts = data["experts"]
    experts.zero_grad()
    out = experts(hidden, data["index"].reshape(-1, K), weights)
    (out * data["upstream"].reshape(-1, H)).sum().backward()
    return dict(
        out=out.detach().view(ROWS, LENGTH, H),
        hidden=hidden.grad.view(ROWS, LENGTH, H),
        weights=weights.grad.view(ROWS, LENGTH, K),
        gate_up_proj=experts.gate_up_proj.grad.clone(),
        down_proj=experts.down_proj.grad.clone(),
    )


def _call(group, names=None) -> CallPlan:
    return CallPlan(
        mesh=None,
        cp_size=1,
        layout=LAYOUT,
        module_names=names or {},
        implementation="ulysses",
        ulysses=1,
        order="contiguous",
        length=LENGTH,
        padded_length=LENGTH,
        expert_group=group,
    )


def _sharded_run(data: dict, inner: str, call: CallPlan, block: slice, mine) -> dict:
    """The experts module of ``data`` on this rank's tokens (``mine``) with its ``block`` of experts, inside
    ``call``: outputs and gradients, and the collectives launched."""
    module = data["experts"]
    module.config._experts_implementation = experts_name(
        inner
    )  # the registry path, as install_experts sets it
    local = {
        name: getattr(module, name)[block].detach().clone().requires_grad_(True)
        for name in ("gate_up_proj", "down_proj")
    }
    hidden, weights = mine(data["hidden"]).requires_grad_(True), mine(data["weights"]).requires_grad_(True)
    with running(call), recording() as log:
        out = torch.func.functional_call(module, local, (hidden, mine(data["index"]), weights))
        (out * mine(data["upstream"])).sum().backward()
    grads = {  # no row arrived: no gradient
        name: torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for name, leaf in local.items()
    }
    return dict(out=out.detach(), hidden=hidden.grad, weights=weights.grad, grads=grads, log=log)


def _ep_case(ep: int, skew: str, inner: str) -> dict:
    group = _ep_group(ep)
    rank, seed = dist.get_rank(group), dist.get_process_group_ranks(group)[0]
    data = _whole(seed, skew, ep)
    expected = _reference(data)
    block = slice(rank * E // ep, (rank + 1) * E // ep)
    run = _sharded_run(
        data, inner, _call(group, {id(data["experts"]): "mlp.experts"}), block, lambda x: _mine(x, rank, ep)
    )
    checks = {
        "out": (run["out"], _mine(expected["out"], rank, ep)),
        "grad hidden": (run["hidden"], _mine(expected["hidden"], rank, ep)),
        "grad weights": (run["weights"], _mine(expected["weights"], rank, ep)),
    }
    for name, grad in run["grads"].items():
        checks[f"grad {name}"] = (grad, expected[name][block])
    whole_index = data["index"].reshape(-1)
    sent = _mine(data["index"], rank, ep).numel()
    received = int(((whole_index >= block.start) & (whole_index < block.stop)).sum())
    log = run["log"]
    events = [(e.name, e.phase, e.nbytes) for e in log.events]
    expected_events = [
        ("mlp.experts counts", "forward", E * 8),
        ("mlp.experts dispatch", "forward", sent * H * 4),
        ("mlp.experts return", "forward", received * H * 4),
        ("mlp.experts return", "backward", sent * H * 4),
        ("mlp.experts dispatch", "backward", received * H * 4),
    ]
    analytic = ep_bytes(sent, received, H, 4, E)
    by_phase = log.bytes_by("phase")
    return dict(
        checks=checks,
        events=(events, expected_events),
        analytic=(
            (by_phase.get("forward"), by_phase.get("backward")),
            (analytic["forward"], analytic["backward"]),
        ),
        received=received,
        ops={(e.op, e.group_size) for e in log.events},
    )


def _tp_case(ep: int, plan: str, skew: str, inner: str) -> dict:
    """cp2 x tp2 with ``ep``: the two tp ranks of a cp slice hold its tokens and share its pairs; the
    outputs and the gradients of hidden states and routing weights are one process's on every rank, the
    expert-weight gradients summed over efsdp are one process's on their block, and the bytes are the
    plan's analytic count."""
    mesh = cpshard.make_mesh(cp=2, tp=2, ep=ep)
    experts_mesh = expert_mesh(mesh)
    cp_rank, ep_rank = mesh.get_local_rank("cp"), experts_mesh.get_local_rank("ep")
    data = _whole(0, skew, 2)
    expected = _reference(data)
    block = slice(ep_rank * E // ep, (ep_rank + 1) * E // ep)
    call = replace(
        _call(experts_mesh.get_group("ep"), {id(data["experts"]): "mlp.experts"}),
        tp_group=mesh.get_group("tp"),
        expert_plan=plan,
    )
    run = _sharded_run(data, inner, call, block, lambda x: _mine(x, cp_rank, 2))
    checks = {
        "out": (run["out"], _mine(expected["out"], cp_rank, 2)),
        "grad hidden": (run["hidden"], _mine(expected["hidden"], cp_rank, 2)),
        "grad weights": (run["weights"], _mine(expected["weights"], cp_rank, 2)),
    }
    grads = list(run["grads"].values())
    if experts_mesh.size(experts_mesh.mesh_dim_names.index("efsdp")) > 1:
        grads = [grad.clone() for grad in grads]
        for grad in grads:  # summed over the ranks that hold the same experts for other tokens
            dist.all_reduce(grad, group=experts_mesh.get_group("efsdp"))
    for name, grad in zip(run["grads"], grads):
        checks[f"grad {name}"] = (grad, expected[name][block])
    tokens = ROWS * LENGTH // 2
    analytic = tp_share_bytes(tokens, H, K, 4, shares=2 if plan == "dispatch" else 1)
    if (
        plan == "dispatch"
    ):  # this rank's half of its slice's tokens out; its experts' pairs of the ep group in
        group_index = data["index"] if ep == 4 else _mine(data["index"], cp_rank, 2)
        received = int(((group_index >= block.start) & (group_index < block.stop)).sum())
        dispatched = ep_bytes(tokens // 2 * K, received, H, 4, E)
        analytic = {phase: analytic[phase] + dispatched[phase] for phase in analytic}
    by_phase = run["log"].bytes_by("phase")
    checks["bytes"] = (
        (by_phase.get("forward"), by_phase.get("backward")),
        (analytic["forward"], analytic["backward"]),
    )
    ops = {("all_gather", 2), ("all_to_all", ep)} if plan == "dispatch" else {("all_reduce", 2)}
    checks["ops"] = ({(e.op, e.group_size) for e in run["log"].events}, ops)
    return checks


def _routing_case(ep: int) -> dict:
    """The real router on each rank's slice picks what it picks on all tokens, and each owner receives
    exactly the (token, expert) pairs of its experts: token ids travel as the rows."""
    group = _ep_group(ep)
    rank, seed = dist.get_rank(group), dist.get_process_group_ranks(group)[0]
    generator = torch.Generator().manual_seed(seed)
    router = Qwen3MoeTopKRouter(_config())
    with torch.no_grad():
        router.weight.copy_(torch.randn(E, H, generator=generator))
    hidden = torch.randn(ROWS, LENGTH, H, generator=generator)
    _, whole_weights, whole_index = router(hidden.reshape(-1, H))
    _, weights, index = router(_mine(hidden, rank, ep))
    token_ids = _mine(torch.arange(ROWS * LENGTH, dtype=torch.float64).view(ROWS, LENGTH, 1), rank, ep)
    routing = route(index, E)
    arrived_counts = exchange_counts(routing.per_expert, group)
    receive = rank_counts(arrived_counts, ep)
    arrived = all_to_all_rows(gather_pairs(token_ids, routing), routing.per_rank(ep), receive, group)
    local = E // ep
    experts = local_expert_ids(arrived_counts, ep) + rank * local
    pairs = sorted(zip(arrived.view(-1).long().tolist(), experts.tolist()))
    owned = [(n, e) for n, row in enumerate(whole_index.tolist()) for e in row if e // local == rank]
    return dict(
        index=(index, _mine(whole_index.view(ROWS, LENGTH, K), rank, ep)),
        weights=(weights, _mine(whole_weights.view(ROWS, LENGTH, K), rank, ep)),
        pairs=(pairs, sorted(owned)),
    )


def _model_case() -> dict:
    """A whole Qwen3-MoE (a dense layer, then a sparse one), installed: each rank runs its own batch row with
    its block of every experts module; the outputs, and the expert-weight gradients on their owners, are
    one process's on both rows; the other gradients summed over the ranks are one process's."""
    group = _ep_group(dist.get_world_size())
    rank, ep = dist.get_rank(group), dist.get_world_size(group)
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 128, (ep, 10), generator=torch.Generator().manual_seed(5))

    def loss_of(logits, labels):
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="sum"
        )

    whole = model(input_ids=ids).logits
    params = dict(model.named_parameters())
    expected = dict(zip(params, torch.autograd.grad(loss_of(whole, ids), list(params.values()))))
    install_experts(model)
    experts = [name for name in params if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    block = slice(rank * E // ep, (rank + 1) * E // ep)
    mine = {
        name: (p[block] if name in experts else p).detach().clone().requires_grad_(True)
        for name, p in params.items()
    }
    with running(_call(group)), recording() as log:  # no module names: the class name stands in
        logits = torch.func.functional_call(model, mine, (ids[rank : rank + 1],)).logits
        grads = dict(
            zip(mine, torch.autograd.grad(loss_of(logits, ids[rank : rank + 1]), list(mine.values())))
        )
    checks = {"logits": (logits.detach(), whole[rank : rank + 1].detach())}
    checks["counted as ep"] = ({e.parallelism for e in log.events}, {"ep"})
    checks["collectives"] = (
        len(log.events),
        5,
    )  # one sparse layer: counts, dispatch, return, and their backward
    for name in experts:
        checks[name] = (grads[name], expected[name][block])
    others = [name for name in mine if name not in experts]
    for name in others:  # the dense weights' gradients, summed over the ranks
        summed = grads[name].clone()
        dist.all_reduce(summed, group=group)
        checks[name] = (summed, expected[name])
    checks["sparse layers"] = (
        experts,
        ["model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"],
    )
    return checks


def _error_case() -> dict:
    group = _ep_group(dist.get_world_size())
    module = Qwen3MoeExperts(_config())
    messages = {}
    try:  # the whole expert stack where this rank's block belongs
        ep_experts(
            None, module, torch.zeros(3, H), torch.zeros(3, K, dtype=torch.long), torch.zeros(3, K), group
        )
    except ValueError as error:
        messages["full weights"] = str(error)
    try:
        all_to_all_rows(
            torch.zeros(3, H), [1] * dist.get_world_size(), [0] * dist.get_world_size(), group, name="probe"
        )
    except ValueError as error:
        messages["bad counts"] = str(error)
    return messages


def _outside_case() -> bool:
    """Inside a call without an expert group the wrapper is the model's own function, bit for bit."""
    data = _whole(0, "uneven", 1)
    args = (data["hidden"].reshape(-1, H), data["index"].reshape(-1, K), data["weights"].reshape(-1, K))
    own = data["experts"](*args)
    data["experts"].config._experts_implementation = experts_name("eager")
    with running(_call(None)):
        wrapped = data["experts"](*args)
    return torch.equal(own, wrapped)


def _run_cases(ep: int) -> dict:
    cases = {
        f"{skew} {inner}": _ep_case(ep, skew, inner) for skew in SKEWS for inner in ("eager", "grouped_mm")
    }
    return dict(cases=cases, routing=_routing_case(ep), errors=_error_case(), outside=_outside_case())


def _tp_cases(ep: int, plan: str, cases: list) -> list[dict]:
    return [_tp_case(ep, plan, skew, inner) for skew, inner in cases]


def _assert_same(actual, expected, where):
    if isinstance(actual, torch.Tensor):
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, where
        torch.testing.assert_close(actual, expected, **TOLERANCE, msg=where)
    else:
        assert actual == expected, f"{where}: {actual} != {expected}"


@pytest.mark.parametrize("ep, plan", [(4, "dispatch"), (2, "all_reduce"), (2, "dispatch")])
def test_expert_parallel_beside_tensor_parallel_matches_one_process(ranks4, ep, plan):
    cases = [(skew, inner) for skew in SKEWS for inner in ("eager", "grouped_mm")]
    for rank, results in enumerate(ranks4.run(_tp_cases, ep, plan, cases)):
        for (skew, inner), checks in zip(cases, results):
            for what, (actual, expected) in checks.items():
                _assert_same(
                    actual, expected, f"cp2 x tp2 x ep{ep} {plan}, rank {rank}, {skew} {inner}, {what}"
                )


@pytest.mark.ranks  # starts its own ranks
@pytest.mark.parametrize("world, ep", [(2, 2), (4, 2), (4, 4)])
def test_expert_parallel_matches_one_process(world, ep, request):
    results = request.getfixturevalue(f"ranks{world}").run(_run_cases, ep)
    for rank, result in enumerate(results):
        for case, outcome in result["cases"].items():
            where = f"ep={ep} of {world}, rank {rank}, {case}"
            for what, (actual, expected) in outcome["checks"].items():
                _assert_same(actual, expected, f"{where}, {what}")
            _assert_same(*outcome["events"], f"{where}, events")
            _assert_same(*outcome["analytic"], f"{where}, bytes vs ep_bytes")
            assert outcome["ops"] == {("all_to_all", ep)}, where
        for what, (actual, expected) in result["routing"].items():
            _assert_same(actual, expected, f"ep={ep} of {world}, rank {rank}, routing {what}")
        assert result["outside"], f"rank {rank}: the wrapper changed the result outside expert parallelism"
        full = result["errors"]["full weights"]
        assert f"block of 8 // {world} experts" in full and "got weights for 8 experts" in full, full
        assert result["errors"]["bad counts"].startswith("probe: 3 rows split as send="), result["errors"]
    for case in results[0]["cases"]:
        received = [result["cases"][case]["received"] for result in results]
        groups = [received[g : g + ep] for g in range(0, world, ep)]
        assert all(sum(g) == ROWS * LENGTH * K for g in groups), f"{case}: rows received {received}"
        assert len(set(received)) > 1, (
            f"{case}: every rank received {received[0]} rows; the case is not uneven"
        )
        if case.startswith("starved") and ep == 2:
            assert received[1::2] == [0] * (world // 2), f"{case}: the upper owner received {received}"


def test_whole_model_under_expert_parallelism(ranks2):
    for rank, checks in enumerate(ranks2.run(_model_case)):
        for what, (actual, expected) in checks.items():
            _assert_same(actual, expected, f"rank {rank}, {what}")


def test_install_experts_is_idempotent_and_exact_outside_a_call():
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=ids).logits
    own = model.config._experts_implementation
    name = install_experts(model)
    assert name == f"cpshard_ep_{own}" and install_experts(model) == name
    assert model.config._experts_implementation == name
    assert torch.equal(model(input_ids=ids).logits, before)


def test_install_experts_needs_experts():
    with pytest.raises(ValueError, match="LlamaForCausalLM has no mixture-of-experts layer.*use ep=1"):
        install_experts(tiny_model("llama"))


def test_check_experts_errors():
    config = _config()
    check_experts(config, 4)
    with pytest.raises(ValueError, match=r"8 experts over ep=3 ranks.*choose ep among 1, 2, 4, 8"):
        check_experts(config, 3)
    with pytest.raises(ValueError, match="declares no num_experts"):
        check_experts(tiny_config("llama"), 2)
