"""cp_forward under transformers' activation checkpointing: the recompute re-runs the collectives, exactly;
make_cp_forward(attention_recompute=True) checkpoints each attention on its own, with or without the
layers'; make_cp_forward(attention_block_bytes=...) runs Ulysses' attention in checkpointed blocks of
queries."""

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.attention.ulysses import attend_in_blocks, block_rows, check_blocked
from cpshard.layouts.family_eager import eager_for
from cpshard.runtime.recompute import checkpointing_modules
from cpshard.tools.parity import check_parity, failing_rows, reference
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
        assert not failing_rows([parity]), (parity.diffs, parity.scales)
        assert parity.comm_bytes > baseline.comm_bytes, (
            "the backward did not re-run the forward's collectives"
        )


def parity_of_nested_checkpoints():
    """Zamba2 under checkpointing: each hybrid layer, checkpointed, holds a checkpointed Mamba layer."""
    model = tiny_model("zamba2", layers_block_type=["hybrid", "mamba", "hybrid"], num_hidden_layers=3)
    model.train().activation_checkpointing_enable()
    batch = tiny_batch(model.config.vocab_size, 2, 19, pad="left")
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    return check_parity(model, batch, mesh, cpshard.make_cp_forward(model))


def test_checkpoints_nested_in_a_checkpointed_layer_recompute_as_they_ran(ranks2):
    """The hybrid layer's recompute, after the call's wrapping of the checkpoint functions had ended, ran the
    Mamba layer's checkpoint unwrapped, without the parameters it took as inputs in the forward: torch
    refused ("a different number of tensors was saved", 48 and 39). The recompute wraps them again."""
    for parity in ranks2.run(parity_of_nested_checkpoints):
        assert not failing_rows([parity]), (parity.diffs, parity.scales)


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


def blocked_attention(cases: list[tuple[str, str | None, bool]]) -> list[dict]:
    """Ulysses with ``attention_block_bytes`` against one process, for each (attention, padding, lean) case:
    the worst difference of loss, logits and every gradient, and how many float storages of the whole
    sequence (4 dims, the padded length second to last: exchanged q, k, v, the function's output, its
    scores) autograd keeps from the forward. Lean is the memory-lean configuration (layers checkpointed,
    ``mlp_tile``, ``attention_recompute``, ``logits=False``). Blocks of 3 queries (of every head, over every
    key) under eager and under sdpa's padding mask; one block under sdpa without a mask."""
    results = []
    for attention, pad, lean in cases:
        model = tiny_model("llama", num_hidden_layers=2, head_dim=8, attn_implementation=attention).train()
        batch = tiny_batch(model.config.vocab_size, 2, 15, pad=pad)
        mesh = cpshard.make_mesh(cp=dist.get_world_size())
        heads = model.config.num_attention_heads // dist.get_world_size()
        options = dict(mlp_tile=8, attention_recompute=True, logits=False) if lean else {}
        if lean:
            model.activation_checkpointing_enable()
        cp_forward = cpshard.make_cp_forward(
            model, implementation="ulysses", attention_block_bytes=2 * heads * 16 * 4 * 3, **options
        )
        params = {name: p.detach().requires_grad_(True) for name, p in cpshard.params_of(model).items()}
        with torch.autograd.graph.saved_tensors_hooks(*whole_sequence_storages(kept := set())):
            cp_forward(params, batch, mesh)
        parity = check_parity(model, batch, mesh, cp_forward)
        results.append(dict(case=(attention, pad, lean), worst=parity.worst, kept=len(kept)))
    return results


def whole_sequence_storages(kept: set) -> tuple:
    """Saved-tensor hooks that add to ``kept`` the storage of each float tensor of the whole (padded to
    16) sequence with 4 dims that autograd keeps."""

    def pack(tensor):
        if tensor.is_floating_point() and tensor.dim() == 4 and tensor.shape[-2] == 16:
            kept.add(tensor.untyped_storage().data_ptr())
        return tensor

    return pack, lambda tensor: tensor


BLOCKED_CASES = [
    (a, pad, lean) for a in ("sdpa", "eager") for pad in (None, "left") for lean in (False, True)
]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_attention_in_blocks_of_queries_is_exact_and_keeps_only_q_k_v(ranks2, ranks4, nprocs):
    """GQA (4 heads, 2 kv heads: at cp 4 each kv head is repeated), plain and left-padded, sdpa and eager,
    with and without the lean configuration: exact, and of the whole sequence autograd keeps the exchanged
    q, k and v of each layer (the blocks' checkpoints' inputs), not the function's output or its scores."""
    ranks, cases = (ranks2, BLOCKED_CASES) if nprocs == 2 else (ranks4, BLOCKED_CASES[::3])
    for result in (r for rank in ranks.run(blocked_attention, cases) for r in rank):
        assert result["worst"] <= TOLERANCE, result
        assert result["kept"] <= 3 * 2, result  # q, k, v of 2 layers


def copies_of_the_output_into_place(blocks: bool) -> int:
    """How many copies into place (``[b, s@cp, cp, heads@cp, d]``: what arrived from each rank, merged
    into the rank's sequence) the output's exchange back makes in a forward of two layers: the blocks'
    output is saved by no backward, and donates its storage to what arrives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.append(tuple(out.shape) if func is torch.ops.aten.clone.default else None)
            return out

    model, shapes = tiny_model("llama", num_hidden_layers=2, head_dim=8).train(), []
    cp = dist.get_world_size()
    heads, batch = model.config.num_attention_heads // cp, tiny_batch(model.config.vocab_size, 2, 16)
    options = dict(attention_block_bytes=1 << 20) if blocks else {}
    cp_forward = cpshard.make_cp_forward(model, implementation="ulysses", **options)
    with Copies():
        cp_forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=cp))
    return shapes.count((2, 16 // cp, cp, heads, 8))


def test_blocks_output_goes_back_into_its_own_storage(ranks2):
    assert ranks2.run(copies_of_the_output_into_place, False) == [2, 2]  # one a layer: the probe sees them
    assert ranks2.run(copies_of_the_output_into_place, True) == [0, 0]


def test_block_rows_hold_the_budgets_scores():
    """A block's scores (batch x heads x queries x keys x 4 bytes, in half precision too) within the
    budget, at least one query; sdpa without a mask, whose kernel holds no scores, in one block."""
    query, key = torch.zeros(2, 3, 100, 8), torch.zeros(2, 1, 90, 8)
    per_query = 2 * 3 * 90 * 4
    assert block_rows("eager", query, key, None, 10 * per_query + 1) == 10
    assert block_rows("sdpa", query, key, torch.ones(2, 1, 100, 90, dtype=torch.bool), per_query - 1) == 1
    assert block_rows("sdpa", query, key, None, per_query) == 100
    # bf16 scores are softmaxed in fp32 (eager): a block is sized by the fp32 copy, not by bf16's 2 bytes
    assert block_rows("eager", query.bfloat16(), key.bfloat16(), None, 10 * per_query + 1) == 10


@pytest.mark.parametrize(
    "options, said",
    [
        (dict(attention_block_bytes=0), "not a positive number of bytes"),
        (dict(attention_block_bytes=True), "not a positive number of bytes"),
        (dict(attention_block_bytes=1 << 20, compile=True), "compile=True does not trace"),
    ],
)
def test_attention_block_bytes_refused_where_it_cannot_serve(options, said):
    with pytest.raises(ValueError, match=said):
        cpshard.make_cp_forward(tiny_model("llama"), **options)


def test_blocks_recompute_with_the_parameters_of_the_forward():
    """A block's backward runs after ``functional_call`` has put the module's own parameters back: an
    attention function that reads a parameter of its module (here a temperature) must recompute with
    the call's, and give the call's its gradient."""
    module, generator = torch.nn.Module(), torch.Generator().manual_seed(0)
    module.temperature = torch.nn.Parameter(torch.tensor(2.0))
    q, k, v = (torch.randn(1, 2, 7, 4, generator=generator, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 1, 7, 7, generator=generator)

    def attention(module, query, key, value, mask, **kwargs):
        scores = query @ key.transpose(-1, -2) * module.temperature + mask
        return (scores.softmax(-1) @ value).transpose(1, 2), None

    grads = []
    for rows in (7, 3):  # the function whole, then in checkpointed blocks of 3 queries
        temperature = torch.tensor(3.0, requires_grad=True)  # the call's, not the module's own
        with torch.nn.utils.stateless._reparametrize_module(module, {"temperature": temperature}):
            if rows == 7:
                out, _ = attention(module, q, k, v, mask)
            else:
                out, _ = attend_in_blocks(False, attention, module, q, k, v, mask, rows)
        grads.append(torch.autograd.grad(out.pow(2).sum(), (q, k, v, temperature)))
    assert module.temperature.grad is None
    for whole, blocked in zip(*grads):
        torch.testing.assert_close(blocked, whole)


def test_blocks_take_a_mask_of_one_row_broadcast_over_the_queries():
    """A padding mask ``[B, 1, 1, K]`` holds one row for every query: each block takes it whole."""
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 7, 4, generator=generator, requires_grad=True) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 7)
    mask[0, ..., :2] = float("-inf")  # the first row's two left-padded keys

    def attention(module, query, key, value, mask, **kwargs):
        scores = query @ key.transpose(-1, -2) + mask
        return (scores.softmax(-1) @ value).transpose(1, 2), None

    whole = attention(None, q, k, v, mask)[0]
    blocked = attend_in_blocks(False, attention, torch.nn.Module(), q, k, v, mask, 3)[0]
    torch.testing.assert_close(blocked, whole)
    for a, b in zip(*(torch.autograd.grad(out.pow(2).sum(), (q, k, v)) for out in (whole, blocked))):
        torch.testing.assert_close(a, b)


def test_blocks_serve_sdpa_and_eager_under_a_tensor_mask_or_none():
    check_blocked("sdpa", None, "model.layers.0.self_attn")
    check_blocked("eager", torch.zeros(1, 1, 4, 4), "model.layers.0.self_attn")
    for inner, mask in (("flex_attention", None), ("sdpa", object())):
        with pytest.raises(ValueError, match="model.layers.0.self_attn: attention_block_bytes runs sdpa and"):
            check_blocked(inner, mask, "model.layers.0.self_attn")


def blocks_of_xlm() -> str:
    """What a cp forward of XLM (eager, causal from its scores' shape) in blocks of one query gives."""
    model = tiny_model("xlm", attn_implementation="eager")
    batch = tiny_batch(model.config.vocab_size, 2, 12)
    cp_forward = cpshard.make_cp_forward(model, implementation="ulysses", attention_block_bytes=64)
    try:
        cp_forward(cpshard.params_of(model), batch, cpshard.make_mesh(cp=dist.get_world_size()))
    except ValueError as error:
        return str(error)
    return "no error"


def test_blocks_refuse_attention_causal_by_the_shape_of_its_scores(ranks2):
    """XLM's and OpenAI GPT's eager attention hide a later key by the scores' shape, the queries the last of
    the keys: a block of queries would see the keys after it (XLM's loss and logits were wrong). Refused, on
    every rank."""
    from transformers.models.openai.modeling_openai import Attention
    from transformers.models.xlm.modeling_xlm import MultiHeadAttention

    for family in (Attention, MultiHeadAttention):
        with pytest.raises(ValueError, match="by the shape of its scores"):
            check_blocked("eager", None, "transformer.attentions.0", eager_for(family))
    for message in ranks2.run(blocks_of_xlm):
        assert "hides later keys by the shape of its scores" in message, message
