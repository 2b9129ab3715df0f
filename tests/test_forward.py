"""cp_forward against one process: loss, logits and every gradient, fp32, on real gloo groups."""

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import cpshard
from cpshard.runtime.plan import choose_order
from cpshard.tools.parity import check_parity
from cpshard.tools.tiny import tiny_batch, tiny_model

TOLERANCE = 1e-5
LAYOUT_TYPES = ("llama", "mistral", "qwen3", "gemma3_text", "qwen2")  # qwen2: the generic decoder layout


@dataclass(frozen=True)
class Case:
    model_type: str
    length: int = 16
    batch: dict = field(default_factory=dict)  # tiny_batch options
    config: dict = field(default_factory=dict)  # tiny_model options
    rows: int = 2
    forward: dict = field(default_factory=dict)  # make_cp_forward options

    def __str__(self):
        options = ",".join(f"{k}={v}" for k, v in {**self.forward, **self.batch, **self.config}.items())
        return f"{self.model_type}-L{self.length}-{options}"

    def using(self, implementation: str) -> "Case":
        return Case(
            self.model_type,
            self.length,
            self.batch,
            self.config,
            self.rows,
            {"implementation": implementation},
        )


def run_case(case: Case):
    model = tiny_model(case.model_type, **case.config)
    embeds = model.config.hidden_size if case.batch.get("embeds") else None
    options = {k: v for k, v in case.batch.items() if k != "embeds"}
    batch = tiny_batch(model.config.vocab_size, case.rows, case.length, embeds_dim=embeds, **options)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    return check_parity(model, batch, mesh, cpshard.make_cp_forward(model, **case.forward))


def assert_exact(parities, case):
    for rank, parity in enumerate(parities):
        bad = {row: diff for row, diff in parity.diffs.items() if not diff <= TOLERANCE}
        assert not bad, f"{case} rank {rank}: differences over {TOLERANCE}: {bad}"
        assert parity.comm_bytes > 0, f"{case}: nothing was communicated, so nothing was split"
        flat = {row: scale for row, scale in parity.scales.items() if 0 < scale < 1e-3}
        assert not flat, f"{case}: reference values too small for the tolerance to mean anything: {flat}"
        assert parity.diffs == parities[0].diffs, f"{case}: ranks disagree"


BATCH_VARIANTS = {
    "divisible": dict(length=16),
    "not-divisible": dict(length=13),
    "right-pad": dict(batch=dict(pad="right"), length=15, rows=3),
    "left-pad": dict(batch=dict(pad="left"), length=15, rows=3),
    "packed": dict(batch=dict(packed=True), length=17),
    "embeds": dict(batch=dict(embeds=True), length=11),
    "shift-labels": dict(batch=dict(shift=True), length=14),
}

CASES_2 = [Case(t, **v) for t in LAYOUT_TYPES for v in BATCH_VARIANTS.values()] + [
    Case("llama", 15, dict(pad="left"), dict(attn_implementation="eager"), rows=3),
    Case("gemma3_text", 13, dict(packed=True), dict(attn_implementation="eager", attn_logit_softcapping=5.0)),
    Case("mistral", 16, config=dict(sliding_window=3)),
    Case("mistral", 16, dict(pad="right"), dict(sliding_window=12), rows=3),
    Case("mistral", 16, dict(packed=True), dict(sliding_window=5, attn_implementation="eager")),
    Case(
        "qwen3",
        16,
        config=dict(
            use_sliding_window=True, sliding_window=3, layer_types=["sliding_attention", "full_attention"]
        ),
    ),
    Case(
        "gemma3_text", 16, config=dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"])
    ),
    Case(
        "gemma3_text",
        19,
        dict(pad="left"),
        dict(
            sliding_window=12,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
        rows=3,
    ),
    Case("llama", 12, config=dict(num_key_value_heads=1)),
    Case("qwen2", 12, dict(pad="left"), dict(num_key_value_heads=1, attn_implementation="eager"), rows=3),
    Case("llama", 2, dict(pad="right"), rows=3),
]

CASES_4 = [
    Case("llama", 10),
    Case(
        "gemma3_text",
        10,
        dict(pad="left"),
        dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"]),
        rows=3,
    ),
    Case("llama", 5, dict(pad="right")),  # rank 3 holds padding only
    Case("llama", 12, config=dict(num_key_value_heads=2)),  # kv heads replicated 2x
    Case("qwen3", 9, dict(packed=True), dict(num_key_value_heads=1)),
    Case(
        "mistral",
        13,
        dict(shift=True),
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, attn_implementation="eager"),
    ),
    Case("llama", 3),  # L smaller than cp
]


CASES_4 += [
    Case(
        "llama",
        14,
        dict(pad="left"),
        dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96),
        rows=3,
    )
]


@pytest.mark.parametrize("case", [c.using(i) for i in ("ulysses", "ring") for c in CASES_2], ids=str)
def test_parity_cp2(ranks2, case):
    assert_exact(ranks2.run(run_case, case), case)


WITHOUT_LOGITS = [
    Case("llama", 13, dict(pad="right"), dict(tie_word_embeddings=True), rows=3, forward=dict(logits=False)),
    Case(
        "gemma3_text",
        14,
        dict(packed=True),
        dict(final_logit_softcapping=3.0),
        forward=dict(logits=False, implementation="ring"),
    ),
    Case("granite", 11, config=dict(logits_scaling=2.0), forward=dict(logits=False)),
]


@pytest.mark.parametrize("case", WITHOUT_LOGITS, ids=str)
def test_parity_without_logits(ranks2, case):
    assert_exact(ranks2.run(run_case, case), case)
    assert "logits" not in ranks2.run(run_case, case)[0].diffs


def _fits(case: Case, implementation: str) -> bool:
    """Ulysses needs cp to divide the heads; hybrid (2 x 2 here) needs 2 to."""
    heads = case.config.get("num_attention_heads", 4)
    return {"ulysses": heads % 4 == 0, "hybrid": heads % 2 == 0, "ring": True}[implementation]


@pytest.mark.parametrize(
    "case", [c.using(i) for i in ("ulysses", "ring", "hybrid") for c in CASES_4 if _fits(c, i)], ids=str
)
def test_parity_cp4(ranks4, case):
    assert_exact(ranks4.run(run_case, case), case)


def run_without_label_tokens():
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 1)  # one token per row: nothing to predict
    output, grads = cpshard.value_and_grad(cpshard.make_cp_forward(model))(
        cpshard.params_of(model), batch, cpshard.make_mesh(cp=dist.get_world_size())
    )
    return output.loss.item(), output.num_tokens.item(), max(g.abs().max().item() for g in grads.values())


def test_no_label_tokens_gives_zero_loss_not_nan(ranks2):
    for loss, num_tokens, largest_grad in ranks2.run(run_without_label_tokens):
        assert (loss, num_tokens, largest_grad) == (0.0, 0, 0.0)


def bad_call(kind: str):
    """Make one kind of bad call; every rank must raise before any collective could hang."""
    rank = dist.get_rank()
    model = tiny_model(
        "llama",
        **(
            {"num_attention_heads": 3, "num_key_value_heads": 1, "hidden_size": 48} if kind == "heads" else {}
        ),
    )
    batch = tiny_batch(model.config.vocab_size, 2, 8)
    mesh = cpshard.make_mesh(cp=2)
    if kind == "no-cp-axis":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    elif kind == "mesh-as-size":  # an AttributeError on 'mesh_dim_names' before
        mesh = 2
    elif kind == "both-inputs":
        batch["inputs_embeds"] = torch.zeros(2, 8, model.config.hidden_size)
    elif kind == "no-inputs":
        del batch["input_ids"]
    elif kind == "shapes":
        batch["labels"] = batch["labels"][:, :5]
    elif kind == "mask-4d":
        batch["attention_mask"] = torch.ones(2, 1, 8, 8)
    elif kind == "differs":
        batch["input_ids"] = batch["input_ids"] + rank
    elif kind == "differs-shape":
        batch["input_ids"] = batch["input_ids"][:, : 8 - rank]
        batch["labels"] = batch["labels"][:, : 8 - rank]
    elif kind == "labels-vocab":
        batch["labels"][1, 6] = model.config.vocab_size  # on rank 1's half only
    elif kind == "labels-negative":
        batch["labels"][0, 1] = -5
    elif kind == "labels-dtype":
        batch["labels"] = batch["labels"].float()
    elif kind == "world":
        cpshard.make_mesh(cp=3)
    elif kind == "unserved":
        cpshard.make_cp_forward(tiny_model("xlnet", attn_implementation="eager"))
    elif kind == "implementation":
        cpshard.make_cp_forward(model, implementation="magic")
    forward_options = {
        "heads": dict(implementation="ulysses"),
        "hybrid-degree": dict(implementation="hybrid"),
        "ulysses-order": dict(implementation="ulysses", sequence_order="head_tail"),
    }
    cp_forward = cpshard.make_cp_forward(model, **forward_options.get(kind, {}))
    if kind == "replaced-layer":  # a module cpshard did not set up: it ran, and differed, without a word
        model.model.layers[0].self_attn = type(model.model.layers[0].self_attn)(model.config, 0)
    params = cpshard.params_of(model)
    if kind == "other-params":  # a model of another vocabulary: it would run on these without a word
        params = cpshard.params_of(tiny_model("llama", vocab_size=200))
    elif kind == "unknown-params":
        params = {**params, "lm_head.scale": torch.ones(1)}
    elif kind == "missing-params":  # the model's own norm weight ran in its place, changed in place or not
        params = {name: value for name, value in params.items() if name != "model.norm.weight"}
    elif kind == "params-generator":
        params = model.named_parameters()
    if kind == "grad-of-model":  # before, the embedding's TypeError: "indices ... must be Tensor, not dict"
        cp_forward = cpshard.value_and_grad(model)
    cp_forward(params, batch, mesh)


BAD_INPUTS = {
    "no-cp-axis": ("ValueError", "no 'cp' dimension (its dimensions: dp)"),
    "mesh-as-size": ("TypeError", "the mesh is int 2, not a DeviceMesh: build it with cpshard.make_mesh"),
    "grad-of-model": (
        "TypeError",
        "value_and_grad takes a cp forward, not the model: value_and_grad(cpshard.make_cp_forward(model))",
    ),
    "heads": ("ValueError", "num_attention_heads=3 is not divisible by cp=2; cp sizes that work: 1, 3"),
    "hybrid-degree": (
        "ValueError",
        "hybrid needs a Ulysses degree that divides cp=2 and num_attention_heads=4",
    ),
    "both-inputs": ("BatchError", "exactly one of input_ids or inputs_embeds"),
    "no-inputs": ("BatchError", "exactly one of input_ids or inputs_embeds, got neither"),
    "shapes": ("BatchError", "batch['labels'] has shape [2, 5] but the inputs are [B, L] = [2, 8]"),
    "mask-4d": ("BatchError", "batch['attention_mask'] must be 2-D"),
    "differs": ("BatchError", "the batch differs across the cp group: ranks [1]"),
    "differs-shape": ("BatchError", "the batch differs across the cp group: ranks [1]"),
    "labels-vocab": (
        "BatchError",
        "batch['labels'] holds 128 at [1, 6]: labels must be token ids below the vocabulary size 128",
    ),
    "labels-negative": ("BatchError", "batch['labels'] holds -5 at [0, 1]"),
    "labels-dtype": ("BatchError", "batch['labels'] must hold integer token ids, got dtype torch.float32"),
    "world": ("ValueError", "world size 2 != dp_replicate=1 * fsdp=1 * cp=3 * tp=1"),
    "unserved": ("LayoutError", "model type 'xlnet'"),
    "implementation": ("ValueError", "implementation='magic'"),
    "other-params": (
        "ValueError",
        "params differ in shape from LlamaForCausalLM's: model.embed_tokens.weight",
    ),
    "unknown-params": ("ValueError", "params holds 1 entries that are not LlamaForCausalLM's parameters"),
    "replaced-layer": (
        "ValueError",
        "model.layers.0.self_attn, model.layers.0.self_attn.q_proj, model.layers",
    ),
    "missing-params": (
        "ValueError",
        "params lacks 1 of LlamaForCausalLM's parameters (e.g. ['model.norm.weight'])",
    ),
    "params-generator": ("TypeError", "params must be a dict of the model's tensors by name"),
    "ulysses-order": ("ValueError", "sequence_order='head_tail' balances ring's causal work; Ulysses"),
}


@pytest.mark.parametrize("kind", BAD_INPUTS)
def test_bad_input_fails_clearly_on_every_rank(ranks2, kind):
    error_type, message = BAD_INPUTS[kind]
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(bad_call, kind)
    failures = caught.value.failures
    assert sorted(failures) == [0, 1], f"{kind}: only ranks {sorted(failures)} raised"
    for failure in failures.values():
        assert failure.kind == error_type and message in failure.message, failure.message
    assert ranks2.alive


def run_outside_and_pure(attn: str):
    """After setup and a cp call, the model and the params are as they were and the model's
    own forward gives bit-identical results to an untouched twin."""
    model, twin = (
        tiny_model("gemma3_text", attn_implementation=attn),
        tiny_model("gemma3_text", attn_implementation=attn),
    )
    batch = tiny_batch(model.config.vocab_size, 3, 11, pad="left")
    params = {name: p.detach().clone() for name, p in cpshard.params_of(model).items()}
    before = {name: p.clone() for name, p in params.items()}
    cp_forward = cpshard.make_cp_forward(model)
    first = cp_forward(params, batch, cpshard.make_mesh(cp=2))
    second = cp_forward(params, batch, cpshard.make_mesh(cp=2))
    ours, theirs = model(**batch), twin(**batch)
    return {
        "outside": torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss),
        "params unchanged": all(torch.equal(params[n], before[n]) for n in params),
        "repeatable": torch.equal(first.logits.to_local(), second.logits.to_local())
        and torch.equal(first.loss, second.loss),
        "no grad flags changed": not any(p.requires_grad for p in params.values()),
    }


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_is_untouched_outside_cp_forward(ranks2, attn):
    for checks in ranks2.run(run_outside_and_pure, attn):
        assert all(checks.values()), checks


#: per row, the lengths of the documents packed in it (45 tokens): one-token documents, documents over
#: several stripes and ranks, none a multiple of any stripe
PACKED_DOCUMENTS = ([1, 9, 2, 30, 3], [40, 5])


def packed_batch(vocab_size: int, pad: str | None = None) -> dict:
    """Rows packed with :data:`PACKED_DOCUMENTS`, their position_ids restarting at each document."""
    batch = tiny_batch(vocab_size, len(PACKED_DOCUMENTS), sum(PACKED_DOCUMENTS[0]), pad=pad)
    batch["position_ids"] = torch.stack(
        [torch.cat([torch.arange(n) for n in row]) for row in PACKED_DOCUMENTS]
    )
    return batch


def run_packed(model_type: str, forward: dict, config: dict, pad: str | None):
    """Parity on packed rows, and the sequence order the call takes."""
    model = tiny_model(model_type, **config)
    batch = packed_batch(model.config.vocab_size, pad)
    cp_forward = cpshard.make_cp_forward(model, **forward)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    order = choose_order(cp_forward.options.sequence_order, forward["implementation"], batch)
    return check_parity(model, batch, mesh, cp_forward), order


RING = dict(implementation="ring")
PACKED_CASES = {  # ranks, model type, make_cp_forward options, model config, padding
    "cp2-ring": (2, "llama", RING, {}, None),
    "cp2-ring-eager-left-pad": (2, "llama", RING, dict(attn_implementation="eager"), "left"),
    "cp2-ring-no-logits": (2, "llama", dict(RING, logits=False), {}, None),
    "cp4-ring": (4, "llama", RING, {}, None),
    "cp4-hybrid": (4, "llama", dict(implementation="hybrid"), {}, None),
    "cp4-ring-sliding-window": (4, "mistral", RING, dict(sliding_window=7), None),
}


@pytest.mark.parametrize("name", PACKED_CASES)
def test_packed_documents_take_the_striped_order_exactly(ranks2, ranks4, name):
    nprocs, *case = PACKED_CASES[name]
    results = (ranks2 if nprocs == 2 else ranks4).run(run_packed, *case)
    assert_exact([parity for parity, _ in results], name)
    assert {order for _, order in results} == {"striped"}


def run_order(order: str, packed: bool):
    model = tiny_model("llama")
    batch = packed_batch(model.config.vocab_size) if packed else tiny_batch(model.config.vocab_size, 2, 45)
    cp_forward = cpshard.make_cp_forward(model, implementation="ring", sequence_order=order)
    return check_parity(model, batch, cpshard.make_mesh(cp=dist.get_world_size()), cp_forward)


@pytest.mark.parametrize("order,packed", [("striped", False), ("head_tail", True), ("contiguous", True)])
def test_every_order_is_exact_on_any_rows(ranks4, order, packed):
    assert_exact(ranks4.run(run_order, order, packed), f"{order} packed={packed}")
