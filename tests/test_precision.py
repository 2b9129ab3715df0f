"""Mixed precision by ``torch.autocast`` (cpshard.precision): a cp step under autocast computes what one
process computes under the same autocast, to the autocast type's rounding. A row is within bf16's tolerance
of one process under autocast, or (the library's own second look) no farther from one process without
autocast, in fp32, than twice one process under autocast is: a cp error keeps its size in any precision."""

import pytest
import torch
from torch.distributed.tensor import DTensor

import cpshard
from cpshard.precision import autocast_dtype, autocast_inputs, autocast_off, own_precision
from cpshard.runtime.plan import check_no_autocast
from cpshard.tools.parity import reference
from cpshard.tools.tiny import tiny_batch, tiny_model

#: the first look's tolerance (the check's for bf16), and the second look's rule
BF16_RTOL, ROUNDING = 5e-2, 2


def test_autocast_inputs_are_cast_as_a_matmul_s_under_autocast_only():
    fp32, fp64, ids = torch.ones(2), torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.long)
    assert [t.dtype for t in autocast_inputs(fp32, fp64, ids, None) if t is not None] == [
        torch.float32,
        torch.float64,
        torch.long,
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = autocast_inputs(fp32, fp64, ids, None)
        assert autocast_dtype("cpu") == torch.bfloat16
    assert [None if t is None else t.dtype for t in cast] == [torch.bfloat16, torch.float64, torch.long, None]
    assert autocast_dtype("cpu") is None


def test_own_precision_computes_in_the_inputs_types_and_gives_autocast_back():
    matmul = own_precision(torch.matmul)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.float32
        assert torch.matmul(torch.ones(2, 2), torch.ones(2, 2)).dtype == torch.bfloat16
        with autocast_off():
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")


def test_check_no_autocast_still_refuses_where_autocast_is_on():
    """Promised in turn 19 (cpshard's own calls no longer use it: they serve autocast)."""
    check_no_autocast("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="torch.autocast"):
        check_no_autocast("cpu")


def _rows(loss, logits, grads: dict) -> dict:
    rows = {"loss": loss, **({} if logits is None else {"logits": logits}), **grads}
    return {row: value.full_tensor() if isinstance(value, DTensor) else value for row, value in rows.items()}


def _cp_under_autocast(params: dict, batch: dict, mesh, cp_forward, backward: str) -> dict:
    """cp's loss, logits and gradients with the forward under autocast, the backward inside it
    (``value_and_grad``) or after it (``backward()`` outside, as a training loop writes it)."""
    if backward == "inside":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output, grads = cpshard.value_and_grad(cp_forward)(params, batch, mesh)
        logits = None if output.logits is None else output.logits.full_tensor()
        return _rows(output.loss.detach(), None if logits is None else logits.detach(), grads)
    leaves = {name: value.detach().requires_grad_(True) for name, value in params.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = cp_forward(leaves, batch, mesh)
    output.loss.backward()
    logits = None if output.logits is None else output.logits.full_tensor().detach()
    return _rows(output.loss.detach(), logits, {name: leaf.grad for name, leaf in leaves.items()})


def _one_process(model, params: dict, batch: dict, backward: str, autocast: bool) -> dict:
    if backward == "inside" or not autocast:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return _rows(*reference(model, params, batch))
    leaves = {name: value.detach().requires_grad_(True) for name, value in params.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = torch.func.functional_call(
            model, leaves, (), {**batch, "use_cache": False}, tie_weights=True
        )
    output.loss.backward()
    grads = {
        name: torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for name, leaf in leaves.items()
    }
    return _rows(output.loss.detach(), output.logits.detach(), grads)


def distances_under_autocast(model_type: str, options: dict, backward: str = "inside", sizes=None) -> dict:
    """Per row: cp under autocast against one process under autocast, and each of them against one process
    in fp32 without autocast, relative to that row's scale. ``sizes``: a mesh with more than cp, the model
    parallelized over it (the references run a twin of the same weights)."""
    torch.manual_seed(0)
    model, twin = tiny_model(model_type), tiny_model(model_type)
    batch, params = tiny_batch(model.config.vocab_size, 2, 14, pad="left"), cpshard.params_of(twin)
    mesh = cpshard.make_mesh(**(sizes or {"cp": torch.distributed.get_world_size()}))
    if sizes:
        cpshard.parallelize(model, mesh)
    cp_forward = cpshard.make_cp_forward(model, **options)
    cp = _cp_under_autocast(cpshard.params_of(model), batch, mesh, cp_forward, backward)
    one = _one_process(twin, params, batch, backward, autocast=True)
    exact = _one_process(twin, params, batch, backward, autocast=False)

    def distance(a, b, scale):
        return float((a.float() - b.float()).abs().max() / scale)

    rows = {}
    for row, right in exact.items():
        if row in cp:
            scale = float(right.abs().max().clamp(min=1e-6))
            rows[row] = tuple(distance(*pair, scale) for pair in ((cp[row], one[row]), (cp[row], right)))
            rows[row] += (distance(one[row], right, scale),)
    return rows


def check_distances(rows: dict) -> None:
    # autocast acted: one process under it lies away from fp32 (a test of fp32 against fp32 would pass anyway)
    assert max(own for _, _, own in rows.values()) > 1e-3, rows
    # per row: (cp to one process under autocast, cp to fp32, one process under autocast to fp32)
    beyond = {row: d for row, d in rows.items() if d[0] > BF16_RTOL and d[1] > ROUNDING * d[2]}
    assert not beyond, beyond


CASES = {
    "llama ulysses": ("llama", {}),
    "llama ring": ("llama", {"implementation": "ring"}),
    "llama ring, compiled": ("llama", {"implementation": "ring", "compile": True}),
    "llama without logits": ("llama", {"logits": False}),
    "gpt2, a probed layout": ("gpt2", {}),
    "qwen3_next, gated delta rule": ("qwen3_next", {}),
    "nemotron_h, mamba2": ("nemotron_h", {}),
    "minimax, lightning attention, probed": ("minimax", {}),
    # its keys (fp32 after the rotary embedding) and values (bf16) gathered whole in one all-gather
    "doge, keys gathered": ("doge", {}),
    # its probe's second look runs in float64, its experts eager there (grouped matmuls take no float64)
    "deepseek_v4, experts in the probe's look": ("deepseek_v4", {}),
}


@pytest.mark.parametrize("case", CASES)
def test_a_step_under_autocast_is_one_process_s_under_autocast(ranks2, case):
    """Under autocast cpshard's loss raised deep in its backward (a bf16 matmul into an fp32 buffer), and a
    probed layout was refused with the blame on the layout; then it was refused clearly. Now it is served."""
    for rows in ranks2.run(distances_under_autocast, *CASES[case]):
        check_distances(rows)


@pytest.mark.parametrize("implementation", ["ulysses", "ring"])
def test_a_backward_outside_autocast_is_one_process_s(ranks2, implementation):
    """A training loop's way: the forward under autocast, ``loss.backward()`` after it."""
    for rows in ranks2.run(distances_under_autocast, "llama", {"implementation": implementation}, "outside"):
        check_distances(rows)


FOUR_RANKS = {
    # q, k and v cast to bf16 before hybrid's Ulysses exchange, the ring over the groups in bf16
    "hybrid": ("llama", {"implementation": "hybrid"}, None),
    "fsdp x cp": ("llama", {}, {"fsdp": 2, "cp": 2}),
    "tp x cp": ("llama", {}, {"tp": 2, "cp": 2}),
    "experts over fsdp x cp": ("qwen3_moe", {}, {"fsdp": 2, "cp": 2, "ep": 4}),
}


@pytest.mark.parametrize("case", FOUR_RANKS)
def test_under_autocast_at_cp4_and_with_the_other_parallelisms(ranks4, case):
    model_type, options, sizes = FOUR_RANKS[case]
    for rows in ranks4.run(distances_under_autocast, model_type, options, "inside", sizes):
        check_distances(rows)


def bytes_under_autocast() -> dict:
    """A cp step's bytes on every collective: an fp32 llama under bf16 autocast, and the same llama cast to
    bf16 (sdpa)."""
    model = tiny_model("llama", attn_implementation="sdpa")
    batch, mesh = tiny_batch(model.config.vocab_size, 2, 64), cpshard.make_mesh(cp=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = cpshard.debug.trace_comms(
            cpshard.make_cp_forward(model), cpshard.params_of(model), batch, mesh
        )
    bf16 = tiny_model("llama", attn_implementation="sdpa", dtype=torch.bfloat16)
    cast = cpshard.debug.trace_comms(cpshard.make_cp_forward(bf16), cpshard.params_of(bf16), batch, mesh)
    return {"autocast": autocast.total_bytes, "bf16": cast.total_bytes}


def test_under_autocast_ulysses_moves_bf16_s_bytes(ranks2):
    """sdpa casts q, k and v to bf16 at its entry under autocast; cast before the exchange, q and k (fp32
    after the rotary embedding) move as bf16, as a bf16 model's do: 74188 bytes were 49612."""
    for sizes in ranks2.run(bytes_under_autocast):
        assert sizes["autocast"] == sizes["bf16"], sizes


def experts_around_the_probe() -> tuple[str, str]:
    """DeepSeek-V4's experts implementation before and after a first cp call under autocast, whose probe
    takes its float64 look with the experts eager."""
    model = tiny_model("deepseek_v4")
    before = model.config._experts_implementation
    batch, mesh = tiny_batch(model.config.vocab_size, 2, 14, pad="left"), cpshard.make_mesh(cp=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, mesh)
    return before, model.config._experts_implementation


def test_the_probe_s_float64_look_gives_the_experts_implementation_back(ranks2):
    for before, after in ranks2.run(experts_around_the_probe):
        assert before == after != "eager", (before, after)
