"""parallelize: FSDP2 (HSDP) over fsdp x cp; cp_forward and value_and_grad unchanged, against one process."""

import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import cpshard
from cpshard.comm.record import recording
from cpshard.layouts.registry import resolve_layout
from cpshard.optim import adamw_init, adamw_update
from cpshard.parallel.fsdp import block_shape, full_tensors, gather_axis
from cpshard.parallel.placement import param_mesh
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5
STEPS = 3
VOCAB = 130  # embedding and head rows do not divide over 4 ranks: uneven shards
#: Adam divides by sqrt(v) + eps, so a gradient element near zero turns an fp32 rounding difference
#: of ~1e-8 into up to lr * 1e-8 / eps of update; eps = 1e-4 bounds that far below the tolerance,
#: while every real update (~lr = 1e-3) stays far above it
ADAMW = dict(lr=1e-3, eps=1e-4)


def _fsdp_layout_matches(params: dict, mesh, tied: bool) -> bool:
    """The same model under torch's own fully_shard (per decoder layer, then the root) holds the same
    shards."""
    twin = tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=tied)
    for layer in twin.model.layers:
        fully_shard(layer, mesh=param_mesh(mesh))
    fully_shard(twin, mesh=param_mesh(mesh))
    theirs = cpshard.params_of(twin)
    return list(theirs) == list(params) and all(
        theirs[n].placements == params[n].placements
        and theirs[n].device_mesh == params[n].device_mesh
        and torch.equal(theirs[n].to_local(), params[n].to_local())
        for n in params
    )


def _events(log, name: str, op: str) -> int:
    return sum(e.nbytes for e in log.events if (e.name, e.op) == (name, op))


def _gather_bytes(params: dict) -> tuple[int, int]:
    """What one rank sends to gather every parameter over its FSDP axis (each block's chunk, padded to the
    largest) and to reduce-scatter the gradients back (the whole padded block, and in each rank's block one
    element saying whether this rank's backward reached the parameter)."""
    gather = scatter = 0
    for p in params.values():
        block, shards = block_shape(p), p.device_mesh.size(gather_axis(p))
        chunk = -(-block[0] // shards) * math.prod(block[1:]) * p.element_size()
        gather, scatter = gather + chunk, scatter + shards * (chunk + p.element_size())
    return gather, scatter


def run_training(
    sizes: dict,
    tied: bool,
    model_type: str = "llama",
    config: dict | None = None,
    forward: dict | None = None,
    batch: dict | None = None,
):
    """One step against one process on all the dp groups' batches, then three AdamW steps; ``batch``: the
    batches' shape (:func:`cpshard.tiny_batch`'s options; default left-padded)."""
    mesh = cpshard.make_mesh(**sizes)
    options = dict(vocab_size=VOCAB, tie_word_embeddings=tied, **(config or {}))
    model, twin = (tiny_model(model_type, **options) for _ in range(2))
    replicas, fsdp = sizes.get("dp_replicate", 1), sizes.get("fsdp", 1)
    shape = batch or dict(pad="left")
    batches = [tiny_batch(VOCAB, 2, 13, seed=seed, **shape) for seed in range(1, replicas * fsdp + 1)]
    if len(batches) > 1:
        batches[1]["labels"][:, :6] = -100  # different token counts per data group
    mine = batches[mesh.get_local_rank("dp_replicate") * fsdp + mesh.get_local_rank("fsdp")]
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}

    grad_fn = cpshard.value_and_grad(cpshard.make_cp_forward(model, **(forward or {})))
    if resolve_layout(model).name.startswith("derived:"):  # probed once on the plain weights, without tp
        grad_fn(cpshard.params_of(model), whole, cpshard.make_mesh(cp=4))
    params = cpshard.params_of(cpshard.parallelize(model, mesh))
    ref_params = {name: p.detach() for name, p in cpshard.params_of(twin).items()}
    plain_fsdp = max(sizes.get("tp", 1), sizes.get("ep", 1)) == 1
    checks = {
        "fully_shard layout": _fsdp_layout_matches(params, mesh, tied) if plain_fsdp else True,
        "same values": all(torch.equal(params[n].full_tensor(), ref_params[n]) for n in params),
        "tied stays tied": (model.lm_head.weight is model.model.embed_tokens.weight) == tied,
    }
    state, ref_state = adamw_init(params), adamw_init(ref_params)
    for step in range(STEPS):
        with recording() as log:
            output, grads = grad_fn(params, mine, mesh)
        ref_loss, _, ref_grads = reference(twin, ref_params, whole)
        if step == 0:
            checks["loss"] = abs(output.loss.item() - ref_loss.item())
            checks["grads"] = max((grads[n].full_tensor() - ref_grads[n]).abs().max().item() for n in grads)
            checks["grad layout"] = all(
                isinstance(g, DTensor)
                and g.placements == params[n].placements
                and g.device_mesh == params[n].device_mesh
                for n, g in grads.items()
            )
            checks["bytes"] = {
                **log.bytes_by_parallelism(),
                "fsdp all-gather": _events(log, "parameters", "all_gather"),
                "fsdp reduce-scatter": _events(log, "parameters", "reduce_scatter"),
                # the local shards, and one element per parameter saying whether this rank reached it
                "local": sum(p.to_local().numel() * 4 for p in params.values()) + 4 * len(params),
                "padded": _gather_bytes(params),
            }
        params, state = adamw_update(params, grads, state, **ADAMW)
        ref_params, ref_state = adamw_update(ref_params, ref_grads, ref_state, **ADAMW)
    checks["params"] = max((params[n].full_tensor() - ref_params[n]).abs().max().item() for n in params)
    checks["still sharded"] = all(isinstance(p, DTensor) for p in params.values())
    return checks


#: the router's load-balancing loss, weighted so that its share of every gradient is well above the tolerance
ROUTER_LOSS = dict(output_router_logits=True, router_aux_loss_coef=0.5)
#: documents packed in each row (position_ids restart), no padding
PACKED = dict(packed=True)
RING_NO_LOGITS = dict(implementation="ring", logits=False)


def _moe_beside_tp(ep: int, forward: dict | None = None, batch: dict | None = None) -> tuple:
    """Qwen3-MoE with the router loss on cp2 x tp2 x ``ep`` (ep=2: the ep groups are the tp groups)."""
    return dict(cp=2, tp=2, ep=ep), False, "qwen3_moe", ROUTER_LOSS, forward or {}, batch


COMBINATIONS = {
    "fsdp2xcp2": (dict(fsdp=2, cp=2), False, "llama"),
    "hsdp2xcp2-tied": (dict(dp_replicate=2, cp=2), True, "llama"),
    "tp2xcp2": (dict(tp=2, cp=2), False, "llama"),
    "fsdp2xtp2-tied": (dict(fsdp=2, tp=2, cp=1), True, "llama"),
    "tp2xcp2-qwen3-ring-nologits": (dict(tp=2, cp=2), False, "qwen3", {}, RING_NO_LOGITS),
    # derived plans: HunYuan's query_layernorm is one head's width (per head); GLM-4's fused gate_up_proj
    # leaves down_proj without its column-wise half, so its MLP runs whole on every tp rank
    "tp2xcp2-derived-hunyuan": (dict(tp=2, cp=2), False, "hunyuan_v1_dense"),
    "tp2xcp2-derived-glm4": (dict(tp=2, cp=2), False, "glm4"),
    "moe-fsdp2xcp2-ep2": (dict(fsdp=2, cp=2, ep=2), False, "qwen3_moe"),
    "moe-fsdp2xcp2-ep4": (dict(fsdp=2, cp=2, ep=4), False, "qwen3_moe"),
    "moe-hsdp2xcp2-ep2": (dict(dp_replicate=2, cp=2, ep=2), False, "qwen3_moe"),
    "moe-aux-loss-fsdp2xcp2-ep2": (dict(fsdp=2, cp=2, ep=2), False, "qwen3_moe", ROUTER_LOSS),
    "moe-aux-loss-cp2xtp2-ep4": _moe_beside_tp(4),
    "moe-aux-loss-cp2xtp2-ep2-all-reduce": _moe_beside_tp(2),
    "moe-aux-loss-cp2xtp2-ep2-dispatch-packed": _moe_beside_tp(2, dict(expert_plan="dispatch"), PACKED),
    "moe-aux-loss-cp2xtp2-ep2-all-reduce-packed-ring-nologits": _moe_beside_tp(2, RING_NO_LOGITS, PACKED),
    "moe-aux-loss-cp2xtp2-ep4-packed-ring-nologits": _moe_beside_tp(4, RING_NO_LOGITS, PACKED),
    "moe-fsdp2xtp2-ep4": (dict(fsdp=2, tp=2, cp=1, ep=4), False, "qwen3_moe"),
    # the ep groups inside the tp group: each takes half of the pairs (pair_share) for its experts
    "moe-aux-loss-tp4-ep2-all-reduce": (
        dict(tp=4, cp=1, ep=2),
        False,
        "qwen3_moe",
        dict(num_key_value_heads=4, **ROUTER_LOSS),
    ),
}


@pytest.mark.parametrize("name", COMBINATIONS)
def test_parallel_training_is_one_process_over_all_batches(ranks4, name):
    for rank, checks in enumerate(ranks4.run(run_training, *COMBINATIONS[name])):
        sizes = COMBINATIONS[name][0]
        layout = ("fully_shard layout", "same values", "tied stays tied", "grad layout", "still sharded")
        assert all(checks[key] for key in layout), (rank, checks)
        assert max(checks["loss"], checks["grads"], checks["params"]) <= TOLERANCE, (rank, checks)
        nbytes = checks["bytes"]
        # each rank sends its (padded) shard once, and takes in whole blocks of gradients once
        assert (nbytes["fsdp all-gather"], nbytes["fsdp reduce-scatter"]) == nbytes["padded"], nbytes
        assert nbytes["replicas"] == (nbytes["local"] if "dp_replicate" in sizes else 0), nbytes
        for kind in ("tp", "ep", "cp"):
            assert (nbytes[kind] > 0) == (sizes.get(kind, 1) > 1), (kind, nbytes)


def run_uneven_shards():
    """Shards of 1, 1, 1 and 0 rows: whole again after the gather; gradients summed over the group."""
    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    values = {
        "a": torch.arange(6.0).view(3, 2),
        "b": torch.arange(5.0) - 2,
        "c": torch.arange(4.0).view(1, 4),
    }
    module = cpshard.parallelize(
        nn.ParameterDict({k: nn.Parameter(v.clone()) for k, v in values.items()}), mesh
    )
    leaves = {name: p.detach().requires_grad_(True) for name, p in cpshard.params_of(module).items()}
    whole = full_tensors(leaves)
    scale = dist.get_rank() + 1  # each rank's share of the loss differs
    loss = sum((w * values[n] * scale).sum() for n, w in whole.items())
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return {
        "whole": all(torch.equal(whole[n], values[n]) for n in values),
        "local rows": [leaves[n].to_local().shape[0] for n in values],
        "grads": all(torch.equal(g.full_tensor(), 10 * values[n]) for n, g in zip(leaves, grads)),
    }


def test_uneven_and_empty_shards_gather_and_reduce_exactly(ranks4):
    results = ranks4.run(run_uneven_shards)
    assert [r["local rows"] for r in results] == [[1, 2, 1], [1, 2, 0], [1, 1, 0], [0, 0, 0]]
    assert all(r["whole"] and r["grads"] for r in results), results


#: edits of Llama's table that tp cannot serve (the probe runs on a cp-only mesh and never sees the plan)
TP_EDITS = {
    "tp-no-entries": lambda layout: replace(layout, tensor_parallel_inputs=()),
    "tp-norm-per-head": lambda layout: layout.with_rows(tensor_parallel={"input_layernorm": "per_head"}),
    "tp-o-proj-colwise": lambda layout: layout.with_rows(tensor_parallel={"self_attn.o_proj": "colwise"}),
    "tp-per-head-unsplit": lambda layout: replace(
        layout,
        tensor_parallel={p: s for p, s in layout.tensor_parallel.items() if not p.startswith("self_attn.")}
        | {"self_attn.q_norm": "per_head", "self_attn.k_norm": "per_head"},
    ),
    "tp-field-typo": lambda layout: replace(layout, mlp_width="intermediate_sise"),
    "tp-k-unplaced": lambda layout: replace(
        layout, tensor_parallel={p: s for p, s in layout.tensor_parallel.items() if p != "self_attn.k_proj"}
    ),
    "tp-rowwise-alone": lambda layout: replace(
        layout,
        tensor_parallel={
            p: s for p, s in layout.tensor_parallel.items() if p != "mlp.gate_proj" and p != "mlp.up_proj"
        },
    ),
}


def bad_parallel(kind: str):
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 8)
    if kind == "tp-kv-heads":
        cpshard.parallelize(model, cpshard.make_mesh(cp=1, tp=4))
    elif kind == "tp-ulysses-heads":
        model = tiny_model("llama", num_attention_heads=6, hidden_size=48, head_dim=8)
        mesh = cpshard.make_mesh(cp=2, tp=2)
        params = cpshard.params_of(cpshard.parallelize(model, mesh))
        cpshard.make_cp_forward(model, implementation="ulysses")(params, batch, mesh)
    elif kind == "tp-plain-params":
        cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2, tp=2))
    elif kind == "ep-experts":
        cpshard.parallelize(tiny_model("qwen3_moe", num_experts=6), cpshard.make_mesh(cp=2, fsdp=2, ep=4))
    elif kind == "ep-dense-model":
        cpshard.parallelize(model, cpshard.make_mesh(cp=2, fsdp=2, ep=2))
    elif kind == "tp-unknown-style":
        typo = replace(resolve_layout(model), tensor_parallel=(("self_attn.q_proj", "colwsie"),))
        cpshard.parallelize(model, cpshard.make_mesh(cp=2, tp=2), layout=typo)
    elif kind in TP_EDITS:  # a user's edits, which the cp-only probe never sees
        model = tiny_model("qwen3") if kind == "tp-per-head-unsplit" else model
        edited = TP_EDITS[kind](resolve_layout(model))
        cpshard.parallelize(model, cpshard.make_mesh(cp=2, tp=2), layout=edited)
    elif kind == "tp-colwise-rows":
        cpshard.parallelize(tiny_model("llama", intermediate_size=6), cpshard.make_mesh(cp=2, tp=2))
    elif kind in ("tp-derived-olmo2", "tp-derived-stablelm"):
        cpshard.parallelize(tiny_model(kind.rsplit("-", 1)[1]), cpshard.make_mesh(cp=2, tp=2))
    elif kind == "moe-tp-without-ep":
        cpshard.parallelize(tiny_model("qwen3_moe"), cpshard.make_mesh(cp=2, tp=2))
    elif kind == "all-reduce-plan-other-tokens":
        moe, mesh = tiny_model("qwen3_moe"), cpshard.make_mesh(cp=2, tp=2, ep=4)
        params = cpshard.params_of(cpshard.parallelize(moe, mesh))
        cpshard.make_cp_forward(moe, expert_plan="all_reduce")(params, batch, mesh)
    elif kind == "unknown-expert-plan":
        cpshard.make_cp_forward(model, expert_plan="allreduce")
    elif kind == "world":
        cpshard.make_mesh(cp=2, fsdp=3)
    elif kind == "no-dims":
        cpshard.parallelize(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp")))
    elif kind == "twice":
        mesh = cpshard.make_mesh(cp=2, fsdp=2)
        cpshard.parallelize(cpshard.parallelize(model, mesh), mesh)
    elif kind == "other-mesh":
        cpshard.parallelize(model, cpshard.make_mesh(cp=2, fsdp=2))
        mesh = cpshard.make_mesh(cp=2, dp_replicate=2)
        cpshard.value_and_grad(cpshard.make_cp_forward(model))(cpshard.params_of(model), batch, mesh)


BAD = {
    "tp-kv-heads": ("ValueError", "tp=4 must divide num_key_value_heads=2"),
    "tp-ulysses-heads": ("ValueError", "num_attention_heads=6 must divide by tp * cp = 4"),
    "tp-plain-params": (
        "ValueError",
        "cp_forward needs the parameters of cpshard.params_of(cpshard.parallelize",
    ),
    "ep-experts": (
        "ValueError",
        "splits the 6 experts over ep=4 ranks, and 4 does not divide 6; choose ep among 1, 2, 3, 6",
    ),
    "ep-dense-model": (
        "ValueError",
        "ep=2, but the layout 'llama' of model type 'llama' declares no experts",
    ),
    "tp-unknown-style": ("ValueError", "unknown tensor-parallel styles (self_attn.q_proj: 'colwsie')"),
    # the input gradients unsummed over tp, a replicated norm's gradient summed over it: wrong gradients
    "tp-no-entries": (
        "ValueError",
        "the tensor-parallel rows self_attn.q_proj (colwise), self_attn.k_proj (colwise), self_attn.v_proj "
        "(colwise), self_attn.o_proj (rowwise), mlp.gate_proj (colwise), mlp.up_proj (colwise), "
        "mlp.down_proj (rowwise) sit in no block of tensor_parallel_inputs",
    ),
    "tp-norm-per-head": (
        "ValueError",
        "the tensor-parallel rows input_layernorm (per_head) sit in no block of tensor_parallel_inputs",
    ),
    # wrong styles: a shape error inside torch naming no row, before the check
    "tp-o-proj-colwise": (
        "ValueError",
        "model.layers.0.self_attn: holds column-wise layers and no row-wise one here, so its output would "
        "leave it split over tp",
    ),
    "tp-rowwise-alone": (
        "ValueError",
        "model.layers.0.mlp: holds a row-wise layer and no column-wise one here, so the row-wise layer would "
        "take its whole input as its share",
    ),
    # tp's divisibility check skipped, unsaid
    "tp-field-typo": ("ValueError", "names config fields 'intermediate_sise', which LlamaConfig lacks"),
    # a layer the plan forgot (as wide as another's output: a norm's diagnosis would mislead)
    "tp-k-unplaced": (
        "ValueError",
        "model.layers.0.self_attn.k_proj: its weight (32, 64) sits in a block tp splits, placed nowhere",
    ),
    # the per-head gradients summed over tp ranks that each ran every head: tp times too large, silently
    "tp-per-head-unsplit": (
        "ValueError",
        "model.layers.0.self_attn: holds per-head rows and no column-wise layer here: every tp rank runs all "
        "of its heads",
    ),
    # a norm over every head's width (not per head) and a forward that reshapes by the whole head count
    "tp-derived-olmo2": (
        "ValueError",
        "model.layers.0.self_attn.q_norm: its weight (64,) spans the whole output of self_attn.q_proj, "
        "which tp splits",
    ),
    "tp-derived-stablelm": (
        "ValueError",
        "model.layers.0.self_attn: its forward reshapes by self.num_heads, the whole model's head count",
    ),
    # a column-wise weight's strided FSDP shards (3 rows of each tp rank's 6 over cp=2) must be even
    "tp-colwise-rows": (
        "ValueError",
        "model.layers.0.mlp.gate_proj.weight has 6 rows on dim 0; split 2 ways (colwise) and then 2 ways "
        "over fsdp_cp they must divide evenly",
    ),
    "moe-tp-without-ep": (
        "NotImplementedError",
        "(tp=2) for the mixture-of-experts layout 'qwen3_moe' needs",
    ),
    "all-reduce-plan-other-tokens": ("ValueError", "with ep=4 and tp=2 the ep group's ranks hold different"),
    "unknown-expert-plan": (
        "ValueError",
        "expert_plan='allreduce'; choose one of auto, dispatch, all_reduce",
    ),
    "world": ("ValueError", "world size 4 != dp_replicate=1 * fsdp=3 * cp=2 * tp=1"),
    "no-dims": ("ValueError", "this mesh has dimensions dp, cp and lacks dp_replicate, fsdp"),
    "twice": ("ValueError", "is a DTensor already"),
    "other-mesh": (
        "ValueError",
        "with placements (Shard(dim=0),); on this mesh cp_forward (layout 'llama') takes plain tensors or",
    ),
}


@pytest.mark.parametrize("kind", BAD)
def test_impossible_meshes_and_parallelisms_fail_on_every_rank(ranks4, kind):
    error_type, message = BAD[kind]
    with pytest.raises(cpshard.RankError) as caught:
        ranks4.run(bad_parallel, kind)
    assert sorted(caught.value.failures) == [0, 1, 2, 3], (
        f"{kind}: only ranks {sorted(caught.value.failures)} raised"
    )
    for failure in caught.value.failures.values():
        assert failure.kind == error_type and message in failure.message, failure.message
    assert ranks4.alive
