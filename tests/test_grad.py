"""value_and_grad: gradients already reduced, whatever requires_grad says, over cp and dp."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import cpshard
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model


def run_requires_grad_does_not_matter():
    model = tiny_model("qwen3")
    batch = tiny_batch(model.config.vocab_size, 2, 9, pad="right")
    grad_fn = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    mesh = cpshard.make_mesh(cp=2)
    frozen = {name: p.detach() for name, p in cpshard.params_of(model).items()}
    _, from_frozen = grad_fn(frozen, batch, mesh)
    _, from_live = grad_fn(cpshard.params_of(model), batch, mesh)
    assert list(from_frozen) == list(frozen)
    return {name: torch.equal(from_frozen[name], from_live[name]) for name in frozen}, from_frozen


def test_requires_grad_does_not_matter_and_ranks_agree(ranks2):
    (same0, grads0), (same1, grads1) = ranks2.run(run_requires_grad_does_not_matter)
    assert all(same0.values()) and all(same1.values())
    assert all(torch.equal(grads0[name], grads1[name]) for name in grads0), "ranks hold different gradients"


def run_without_labels():
    model = tiny_model("llama")
    batch = {"input_ids": tiny_batch(model.config.vocab_size, 1, 6)["input_ids"]}
    cp_forward = cpshard.make_cp_forward(model)
    output = cp_forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    assert output.loss is None and output.logits is not None
    cpshard.value_and_grad(cp_forward)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))


def test_value_and_grad_without_labels_says_what_is_missing(ranks2):
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(run_without_labels)
    assert sorted(caught.value.failures) == [0, 1]
    assert "give the batch labels or shift_labels" in caught.value.failures[0].message


def run_data_parallel_batches():
    """dp_replicate=2 x cp=2: each dp group its own batch; the loss is that of one process over both."""
    model = tiny_model("mistral", sliding_window=4)
    batches = [tiny_batch(model.config.vocab_size, 2, 11, pad="left", seed=seed) for seed in (1, 2)]
    batches[1]["labels"][:, :6] = -100  # different token counts: a mean of means would be wrong
    mesh = cpshard.make_mesh(dp_replicate=2, cp=2)
    mine = batches[mesh.get_local_rank("dp_replicate")]
    output, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(
        cpshard.params_of(model), mine, mesh
    )
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    ref_loss, _, ref_grads = reference(model, cpshard.params_of(model), whole)
    count = int((whole["labels"][:, 1:] != -100).sum())
    worst = max((grads[name] - ref_grads[name]).abs().max().item() for name in grads)
    return (
        abs(output.loss.item() - ref_loss.item()),
        worst,
        output.num_tokens.item() == count,
        dist.get_rank(),
    )


def test_data_parallel_loss_and_gradients_are_one_process_over_all_batches(ranks4):
    for loss_diff, grad_diff, count_ok, rank in ranks4.run(run_data_parallel_batches):
        assert loss_diff <= 1e-5 and grad_diff <= 1e-5 and count_ok, (rank, loss_diff, grad_diff)


#: what a user differentiates: (from a CPOutput, from one process's loss and logits), each a scalar
OBJECTIVES = {
    "loss": (lambda out: out.loss, lambda loss, logits: loss),
    "full logits": (
        lambda out: out.logits.full_tensor().log_softmax(-1)[..., :3].sum() * 0.1,
        lambda loss, logits: logits.log_softmax(-1)[..., :3].sum() * 0.1,
    ),
    "logits DTensor": (
        lambda out: (out.logits**2).sum().full_tensor() * 1e-3,
        lambda loss, logits: (logits**2).sum() * 1e-3,
    ),
    "local logits": (  # each rank its own shard's term: the objective is their sum
        lambda out: (out.logits.to_local() ** 2).sum() * 1e-3,
        lambda loss, logits: (logits**2).sum() * 1e-3,
    ),
    "loss and logits": (
        lambda out: out.loss + out.logits.full_tensor()[:, -1].logsumexp(-1).sum(),
        lambda loss, logits: loss + logits[:, -1].logsumexp(-1).sum(),
    ),
}


def _worst_relative(grads: dict, ref: dict) -> float:
    full = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}
    return max((full[n] - ref[n]).abs().max().item() for n in ref) / max(
        r.abs().max().item() for r in ref.values()
    )


def run_plain_autograd(sizes: dict, model_type: str = "llama", forward: dict | None = None):
    """Every objective through backward() and autograd.grad, against one process on all dp groups' batches."""
    mesh = cpshard.make_mesh(**sizes)
    model, twin = tiny_model(model_type, vocab_size=130), tiny_model(model_type, vocab_size=130)
    groups = sizes.get("dp_replicate", 1) * sizes.get("fsdp", 1)
    batches = [tiny_batch(130, 2, 13, pad="left", seed=seed) for seed in range(1, groups + 1)]
    if groups > 1:
        batches[1]["labels"][:, :6] = -100
        mine = batches[
            mesh.get_local_rank("dp_replicate") * sizes.get("fsdp", 1) + mesh.get_local_rank("fsdp")
        ]
    else:
        mine = batches[0]
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    if len(sizes) > 1 or "cp" not in sizes:
        cpshard.parallelize(model, mesh)
    params = cpshard.params_of(model)
    cp_forward = cpshard.make_cp_forward(model, **(forward or {}))
    leaves = {name: p.detach().requires_grad_(True) for name, p in cpshard.params_of(twin).items()}
    output = torch.func.functional_call(twin, leaves, (), {**whole, "use_cache": False})
    errors = {}
    for name, (objective, reference_objective) in OBJECTIVES.items():
        ref = dict(
            zip(
                leaves,
                torch.autograd.grad(
                    reference_objective(output.loss, output.logits), list(leaves.values()), retain_graph=True
                ),
            )
        )
        for p in params.values():
            p.grad = None
        objective(cp_forward(params, mine, mesh)).backward()
        errors[f"{name} backward()"] = _worst_relative({n: p.grad for n, p in params.items()}, ref)
        value = objective(cp_forward(params, mine, mesh))
        errors[f"{name} autograd.grad"] = _worst_relative(
            dict(zip(params, torch.autograd.grad(value, list(params.values())))), ref
        )
    return errors


def test_plain_autograd_gives_one_process_gradients_cp2(ranks2):
    for rank, errors in enumerate(ranks2.run(run_plain_autograd, dict(cp=2))):
        assert max(errors.values()) <= 1e-5, (rank, errors)


@pytest.mark.parametrize(
    "sizes, model_type",
    [
        (dict(fsdp=2, cp=2), "llama"),
        (dict(dp_replicate=2, cp=2), "llama"),
        (dict(tp=2, cp=2), "llama"),
        (dict(fsdp=2, cp=2, ep=2), "qwen3_moe"),
    ],
    ids=str,
)
def test_plain_autograd_gives_one_process_gradients_parallel(ranks4, sizes, model_type):
    for rank, errors in enumerate(ranks4.run(run_plain_autograd, sizes, model_type)):
        assert max(errors.values()) <= 1e-5, (rank, errors)


def run_input_gradients(sizes: dict, model_type: str = "llama", forward: dict | None = None):
    """``inputs_embeds`` that require a gradient (an adapter's output, a soft prompt), one batch per dp
    group: each rank's input gradient against one process's for the same input, over every group's batch
    (each rank's backward reaches only its own tokens' share: cp sums them). Worst relative differences."""
    mesh = cpshard.make_mesh(**sizes)
    model = tiny_model(model_type, vocab_size=130)
    groups = sizes.get("dp_replicate", 1) * sizes.get("fsdp", 1)
    batches = [tiny_batch(130, 2, 13, pad="left", seed=seed) for seed in range(1, groups + 1)]
    embeds = [
        torch.randn(2, 13, model.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        for seed in range(groups)
    ]
    leaves = [e.clone().requires_grad_(True) for e in embeds]
    whole = {key: torch.cat([b[key] for b in batches]) for key in ("attention_mask", "labels")}
    objective = lambda loss, logits: loss + (logits[:, -1] ** 2).sum() * 1e-2  # noqa: E731
    output = model(inputs_embeds=torch.cat(leaves), **whole, use_cache=False)
    objective(output.loss, output.logits).backward()
    group = mesh.get_local_rank("dp_replicate") * sizes.get("fsdp", 1) + mesh.get_local_rank("fsdp")
    ref = leaves[group].grad
    if len(sizes) > 1:
        cpshard.parallelize(model, mesh)
    cp_forward, params = cpshard.make_cp_forward(model, **(forward or {})), cpshard.params_of(model)
    mine = {key: batches[group][key] for key in ("attention_mask", "labels")}
    errors = {}
    for how in ("backward()", "autograd.grad"):
        leaf = embeds[group].clone().requires_grad_(True)
        out = cp_forward(params, {**mine, "inputs_embeds": leaf}, mesh)
        value = objective(out.loss, out.logits.full_tensor())
        if how == "backward()":
            value.backward()
            grad = leaf.grad
        else:
            (grad,) = torch.autograd.grad(value, leaf)
        errors[how] = ((grad - ref).abs().max() / ref.abs().max()).item()
    return errors


@pytest.mark.parametrize(
    "model_type, forward",
    [("llama", None), ("llama", dict(implementation="ring")), ("qwen3_5_text", None)],
    ids=["ulysses", "ring", "gated-deltanet"],
)
def test_inputs_that_require_a_gradient_get_one_process_gradients_cp2(ranks2, model_type, forward):
    for rank, errors in enumerate(ranks2.run(run_input_gradients, dict(cp=2), model_type, forward)):
        assert max(errors.values()) <= 1e-5, (rank, errors)


@pytest.mark.parametrize("sizes", [dict(fsdp=2, cp=2), dict(tp=2, cp=2)], ids=str)
def test_inputs_that_require_a_gradient_get_one_process_gradients_parallel(ranks4, sizes):
    for rank, errors in enumerate(ranks4.run(run_input_gradients, sizes)):
        assert max(errors.values()) <= 1e-5, (rank, errors)


def run_loss_rides_with_gradients():
    """value_and_grad's reductions against plain autograd's, on the same call: (op, name) of each."""
    from cpshard.comm.record import recording

    model = tiny_model("llama")
    batch, mesh = tiny_batch(model.config.vocab_size, 1, 10), cpshard.make_mesh(cp=2)
    cp_forward = cpshard.make_cp_forward(model)
    params = cpshard.params_of(model)
    with recording() as folded:
        output, grads = cpshard.value_and_grad(cp_forward)(params, batch, mesh)
    with recording() as apart:
        plain = cp_forward(params, batch, mesh)
        plain.loss.backward()
    reduce = lambda log: [(e.op, e.name) for e in log.events if e.op != "all_to_all"]  # noqa: E731
    same = torch.equal(output.loss, plain.loss.detach()) and all(
        torch.allclose(grads[n], p.grad, rtol=1e-6, atol=1e-7) for n, p in params.items()
    )
    return reduce(folded), reduce(apart), same


def test_value_and_grad_sums_loss_and_gradients_in_one_all_reduce(ranks2):
    for folded, apart, same in ranks2.run(run_loss_rides_with_gradients):
        # the first call: the ranks agree on the forward first, once
        assert folded == [
            ("all_gather", "cp forward agreement"),
            ("all_gather", "batch fingerprint"),
            ("all_reduce", "gradients"),
        ]
        assert apart == [
            ("all_gather", "batch fingerprint"),
            ("all_reduce", "loss"),
            ("all_reduce", "gradients"),
        ]
        assert same


def run_second_order(implementation: str) -> str:
    """A gradient penalty through cp: the first backward with create_graph, then a backward of the
    gradients' norm, which cp's collectives and loss cannot differentiate again."""
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 9, pad="right")
    params = cpshard.params_of(model)
    leaves = {name: p.detach().requires_grad_(True) for name, p in params.items()}
    cp_forward = cpshard.make_cp_forward(model, implementation=implementation)
    loss = cp_forward(leaves, batch, cpshard.make_mesh(cp=2)).loss
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True, allow_unused=True)
    penalty = sum(grad.pow(2).sum() for grad in grads if grad is not None)
    try:
        penalty.backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_a_second_order_gradient_is_refused_on_every_rank(ranks2, implementation):
    """A second differentiation through cp would be silently wrong (the collectives' backwards have no
    graph): it raises on every rank instead, the first-order gradient itself unaffected."""
    for message in ranks2.run(run_second_order, implementation):
        assert "differentiate twice" in message, message
