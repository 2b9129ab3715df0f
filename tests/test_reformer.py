"""Reformer as a causal LM under cp (its heads split over the ranks, :mod:`cpshard.recurrent.reformer`),
against its own code run in one process (a second model on the same weights that cpshard never touched,
its reversible backward's gradients included): loss, logits and every gradient in training mode, at cp 2 and
4, with local and LSH layers (hashing and chunking: sequences longer than the chunks), ``hash_seed`` set and
unset (the ranks' generators made to disagree: cp takes rank 0's, as one process has it), axial position
embeddings, left padding; in eval mode the generator one process leaves. Refused on every rank: heads cp
does not divide, lengths the model or cp would pad where a layer hashes or chunks, a changed release.
"""

import importlib
import itertools
from unittest import mock

import pytest
import torch

import cpshard
from cpshard.comm.record import recording
from cpshard.recurrent.reformer import WRITTEN_AGAINST, layer_bytes
from cpshard.tools.parity import reference, tensor_group
from cpshard.tools.tiny import tiny_batch, tiny_model

#: chunked layers short enough that the test sequences hash, sort and chunk
CHUNKED = dict(lsh_attn_chunk_length=4, local_attn_chunk_length=4, num_buckets=4, num_hashes=2)
CONFIGS = {
    "local": dict(CHUNKED, attn_layers=["local", "local"]),
    "lsh seeded": dict(CHUNKED, attn_layers=["lsh", "lsh"], hash_seed=7),
    "lsh": dict(CHUNKED, attn_layers=["lsh", "lsh"]),
    "local and lsh": dict(CHUNKED, attn_layers=["local", "lsh"], num_buckets=None),
    "axial": dict(
        CHUNKED,
        attn_layers=["lsh", "local"],
        axial_pos_embds=True,
        axial_pos_shape=[4, 4],
        axial_pos_embds_dim=[32, 32],
    ),
}


def _seeded(start: int):
    """``torch.seed`` made deterministic from ``start`` (a training layer reseeds from it before its hash)."""
    counter = itertools.count(start)

    def seed() -> int:
        value = next(counter)
        torch.manual_seed(value)
        return value

    return mock.patch.object(torch, "seed", seed)


#: each row's tolerance, relative to its scale: fp32's 1e-5, but 3e-5 for gradients, where one process's
#: reversible backward rebuilds each layer's input by subtraction (measured: 1.3e-5 of scale at the
#: embeddings; cp, plain autograd, is 1.7e-7 from a float64 run there, one process 2.7e-6); in float64, with
#: that rounding gone, every row within 1e-6 (measured: 6e-8, cpshard's fp32 loss)
TOLERANCES = {torch.float32: (1e-5, 3e-5), torch.float64: (1e-6, 1e-6)}


def _distance(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def failing_against(own, prepared, batch: dict, mesh, rank_start: int) -> list[str]:
    """The rows where cp differs from one process (its seeds from 1000; rank 0's from 1000, the other
    ranks' elsewhere: cp takes rank 0's generator) beyond :data:`TOLERANCES`."""
    params = cpshard.params_of(prepared)
    with _seeded(1000):
        loss, logits, grads = reference(own, params, batch)
    with _seeded(rank_start):
        output, got = cpshard.value_and_grad(cpshard.make_cp_forward(prepared))(params, batch, mesh)
    values, gradients = TOLERANCES[own.dtype]
    rows = {"loss": [(output.loss, loss, values)], "logits": [(output.logits.full_tensor(), logits, values)]}
    for name in grads:
        rows.setdefault("grad " + tensor_group(name), []).append((got[name], grads[name], gradients))
    return [
        row
        for row, pairs in rows.items()
        if any(_distance(value, want) > rtol * want.abs().max().item() for value, want, rtol in pairs)
    ]


def failing(cp: int, name: str, length: int = 16, overrides: dict | None = None) -> list[str]:
    """Every row that differs from one process for the config ``name`` (with ``overrides``), on this rank, in
    fp32 and fp64, plain and left-padded."""
    mesh = cpshard.make_mesh(cp=cp)
    rank, config = torch.distributed.get_rank(), {**CONFIGS[name], **(overrides or {})}
    rows = []
    for dtype in TOLERANCES:
        own, prepared = (
            tiny_model("reformer", attn_implementation="eager", dtype=dtype, **config) for _ in range(2)
        )
        for pad in (None, "left"):
            batch = tiny_batch(own.config.vocab_size, 2, length, pad=pad)
            found = failing_against(own, prepared, batch, mesh, 1000 if rank == 0 else 7000 + rank)
            rows += [f"{name} {dtype} pad={pad}: {row}" for row in found]
    return rows


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reformer_is_exact_at_cp2(ranks2, name):
    assert ranks2.run(failing, 2, name) == [[], []]


@pytest.mark.parametrize("name", ["local and lsh", "lsh"])
def test_reformer_is_exact_at_cp4(ranks4, name):
    assert ranks4.run(failing, 4, name) == [[]] * 4


def test_a_sequence_cp_pads_is_exact_within_the_shortest_chunk(ranks2):
    """11 tokens (cp pads to 12) with chunks of 16: every layer attends over the whole sequence, cp's
    padding left out of it (a left-padded row's first query sees no key and averages over every position);
    the zoo's batch."""
    chunks = dict(lsh_attn_chunk_length=16, local_attn_chunk_length=16)
    assert ranks2.run(failing, 2, "local and lsh", 11, chunks) == [[], []]


def eval_outcome(cp: int) -> list[float]:
    """In eval mode (no reseeding), the ranks' generators apart: loss and logits, and the generator state
    after the call, against one process."""
    mesh = cpshard.make_mesh(cp=cp)
    own, prepared = (
        tiny_model("reformer", attn_implementation="eager", **CONFIGS["local and lsh"]).eval()
        for _ in range(2)
    )
    batch = tiny_batch(own.config.vocab_size, 2, 16)
    torch.manual_seed(3)
    with torch.no_grad():
        want = own(**batch)
    after = torch.get_rng_state()
    torch.manual_seed(3 + 100 * torch.distributed.get_rank())
    with torch.no_grad():
        got = cpshard.make_cp_forward(prepared)(cpshard.params_of(prepared), batch, mesh)
    return [
        (got.loss - want.loss).abs().item(),
        (got.logits.full_tensor() - want.logits).abs().max().item(),
        float(not torch.equal(torch.get_rng_state(), after)),
    ]


def test_eval_draws_one_process_rotations_and_leaves_its_generator(ranks2):
    for loss, logits, generator_differs in ranks2.run(eval_outcome, 2):
        assert loss < 1e-5 and logits < 1e-5 and generator_differs == 0


def blocked_loss_difference() -> list[float]:
    """``logits=False`` (the loss a block of tokens at a time, Reformer's head run by cpshard): the loss and
    its largest gradient difference from one process, relative to their scales."""
    model = tiny_model("reformer", attn_implementation="eager", **CONFIGS["lsh seeded"])
    batch, params = tiny_batch(model.config.vocab_size, 2, 16, pad="left"), cpshard.params_of(model)
    loss, _, grads = reference(model, params, batch)
    output, got = cpshard.value_and_grad(cpshard.make_cp_forward(model, logits=False))(
        params, batch, cpshard.make_mesh(cp=2)
    )
    worst = max(_distance(got[n], g) / max(g.abs().max().item(), 1e-12) for n, g in grads.items())
    return [_distance(output.loss, loss) / loss.abs().item(), worst]


def test_the_loss_without_logits_is_exact(ranks2):
    for loss, gradients in ranks2.run(blocked_loss_difference):
        assert loss < 1e-5 and gradients < TOLERANCES[torch.float32][1]


def layer_traffic(cp: int, length: int) -> dict:
    """Bytes this rank put into each collective of the first layer's attention, forward and backward."""
    mesh = cpshard.make_mesh(cp=cp)
    model = tiny_model("reformer", attn_implementation="eager", **CONFIGS["lsh seeded"])
    batch = tiny_batch(model.config.vocab_size, 2, length)
    with recording() as log:
        cpshard.value_and_grad(cpshard.make_cp_forward(model))(cpshard.params_of(model), batch, mesh)
    first = "reformer.encoder.layers.0.attention"
    events = [e for e in log.events if e.name.startswith(first)]
    return {(e.op, e.phase): e.nbytes for e in events}


def test_each_layer_sends_one_all_gather_and_one_reduce_scatter_of_the_stream(ranks2):
    """Per layer and rank, forward and backward alike: the rank's rows (``B * L/cp * d`` fp32) into an
    all-gather, the partial sums of the whole sequence (``B * L * d``) into a reduce-scatter."""
    want = layer_bytes(2, 64, 64, 2)
    for traffic in ranks2.run(layer_traffic, 2, 64):
        assert traffic == {(op, phase): want[op] for op in want for phase in ("forward", "backward")}, traffic


def refusal(cp: int, overrides: dict, length: int, train: bool = True) -> str:
    model = tiny_model("reformer", attn_implementation="eager", **{**CHUNKED, **overrides}).train(train)
    batch = tiny_batch(model.config.vocab_size, 2, length)
    params, mesh = cpshard.params_of(model), cpshard.make_mesh(cp=cp)
    try:
        if train:
            cpshard.value_and_grad(cpshard.make_cp_forward(model))(params, batch, mesh)
        else:  # the model pads to its chunks itself in eval mode only (training, it raises)
            cpshard.make_cp_forward(model)(params, batch, mesh)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "overrides, length, train, reason",
    [
        (dict(num_attention_heads=3), 16, True, "num_attention_heads=3 does not divide by cp=2"),
        (dict(attn_layers=["lsh", "lsh"]), 15, True, "cp pads 15 tokens to 16"),
        (dict(attn_layers=["local", "local"]), 15, False, "cp pads 15 tokens to 16"),
        (
            dict(attn_layers=["local", "lsh"], lsh_attn_chunk_length=8),
            12,
            False,
            "pads 12 tokens to a multiple",
        ),
    ],
)
def test_what_cp_cannot_serve_is_refused_on_every_rank(ranks2, overrides, length, train, reason):
    for message in ranks2.run(refusal, 2, overrides, length, train):
        assert reason in message, message


def bidirectional_refusal() -> str:
    model = tiny_model("reformer", attn_implementation="eager", **CHUNKED)
    model.reformer.encoder.layers[1].attention.self_attention.is_decoder = False
    try:
        cpshard.make_cp_forward(model)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_causal_lm_only(ranks2):
    for message in ranks2.run(bidirectional_refusal):
        assert "is_decoder=False" in message, message


def _changed(*args, **kwargs):
    raise AssertionError("the refusal comes before any run")


@pytest.mark.parametrize("piece", list(WRITTEN_AGAINST[1]))
def test_a_change_in_the_code_cp_runs_is_refused(monkeypatch, piece):
    module = importlib.import_module(WRITTEN_AGAINST[0])
    owner, _, name = piece.rpartition(".")
    if not owner:  # a class: its forward changed
        owner, name = name, "forward"
    monkeypatch.setattr(getattr(module, owner), name, _changed, raising=False)
    with pytest.raises(cpshard.LayoutError, match="ReformerModel"):
        cpshard.make_cp_forward(tiny_model("reformer", attn_implementation="eager", **CHUNKED))


def test_the_reference_counts_the_reversible_backward():
    """One process's functional reference has the gradients Reformer's reversible backward leaves on the
    parameters (a plain ``loss.backward()``'s), not zeros."""
    model = tiny_model(
        "reformer", attn_implementation="eager", **dict(CONFIGS["lsh seeded"], attn_layers=["local", "lsh"])
    )
    batch = tiny_batch(model.config.vocab_size, 2, 16)
    torch.manual_seed(0)
    _, _, grads = reference(model, cpshard.params_of(model), batch)
    torch.manual_seed(0)
    model(**batch).loss.backward()
    for name, parameter in model.named_parameters():
        own = (
            torch.zeros_like(parameter) if parameter.grad is None else parameter.grad
        )  # lm_head.bias: unused
        assert torch.allclose(grads[name], own, atol=1e-6), name
    assert grads["reformer.encoder.layers.0.attention.self_attention.query.weight"].abs().max() > 0
