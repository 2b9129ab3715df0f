"""BLT's causal LM under cp, against its own code run in one process (a second model on the same weights
that cpshard never touched): loss, logits and every gradient, at cp 2 and 4, plain and left- and
right-padded, on lengths cp does not divide; patches from its patcher's entropies (of 1 to 7 bytes, rows of
fewer patches than others), patches given with the batch (precomputed), every byte its own patch, patches
split at a longest length, the encoder cross-attending at every layer, a window over the bytes, embeddings
in place of bytes, Ulysses, ring and hybrid, and a rank that holds no real patch. Its bytes are the analytic
ones; what it does not serve is refused on every rank.
"""

import importlib

import pytest
import torch

import cpshard
from cpshard.comm.record import recording
from cpshard.recurrent.blt import WRITTEN_AGAINST, Patching, _check_read_patches, gathered_bytes
from cpshard.tools.parity import beyond_own_rounding, check_parity, failing_rows, reference
from cpshard.tools.tiny import tiny_batch, tiny_model

PHASES = ("forward", "backward")
#: every byte its own patch (the model's patching without its patcher)
ONE_BYTE_PATCHES = {"patch_in_forward": False, "patching_mode": "static"}


def failing_against_own_code(
    cp: int, lengths=(13, 40), embeds=False, make=None, checkpointed=False, packed=False, **overrides
) -> list[str]:
    """cp on a prepared BLT against its own code, plain, left- and right-padded, at each of ``lengths``
    (``embeds``: embeddings in place of bytes; ``checkpointed``: both models training under activation
    checkpointing; ``packed``: documents restarting their positions). Gradient rows beyond 1e-5 of their
    scale count only where cp lies farther from a float64 run than one process does: with patches of one
    byte, a patch's query sees one key, and the gradient of its softmax, zero in exact arithmetic, is
    rounding in both."""
    mesh = cpshard.make_mesh(cp=cp)
    own, prepared = (tiny_model("blt", attn_implementation="auto", **overrides) for _ in range(2))
    if checkpointed:
        for model in (own, prepared):
            model.train()
            model.activation_checkpointing_enable()
    cp_forward, params = cpshard.make_cp_forward(prepared, **(make or {})), cpshard.params_of(prepared)
    width = own.config.encoder_config.hidden_size if embeds else None
    rows = []
    for length in lengths:
        for pad in (None, "left", "right"):
            batch = tiny_batch(own.config.vocab_size, 2, length, pad=pad, embeds_dim=width, packed=packed)
            found = failing_rows([check_parity(own, batch, mesh, cp_forward, params)])
            if any(row.startswith("grad ") for row in found):
                twin = tiny_model("blt", attn_implementation="auto", **overrides)
                found = beyond_own_rounding(twin, own, params, batch, mesh, cp_forward, found)
            rows += [f"L={length} pad={pad}: {row}" for row in found]
    return rows


def test_blt_is_exact_at_cp2(ranks2):
    assert ranks2.run(failing_against_own_code, 2) == [[], []]


def test_blt_is_exact_at_cp4(ranks4):
    assert ranks4.run(failing_against_own_code, 4) == [[]] * 4


def test_every_byte_its_own_patch_is_exact_and_a_rank_may_hold_no_real_patch(ranks4):
    """One patch a byte and one past the last: at L=5 and cp 4, six patches, two a rank, the last rank's
    both cp padding."""
    assert ranks4.run(failing_against_own_code, 4, (5, 13), **ONE_BYTE_PATCHES) == [[]] * 4


def test_patches_split_at_a_longest_length_and_cross_attention_at_every_layer_are_exact(ranks2):
    overrides = {"max_patch_length": 2, "encoder_config": {"cross_attn_all_layers": True}}
    assert ranks2.run(failing_against_own_code, 2, (13,), **overrides) == [[], []]


@pytest.mark.parametrize("make", [{}, {"implementation": "ring"}])
def test_a_window_over_the_bytes_is_exact(ranks2, make):
    """The byte stacks' sliding window (8 bytes) shorter than the sequence, under Ulysses and the ring."""
    overrides = {"local_attention_window_len": 8}
    assert ranks2.run(failing_against_own_code, 2, (40,), make=make, **overrides) == [[], []]


def test_memory_modes_on_the_global_transformer_are_exact(ranks2):
    """``mlp_tile`` and ``attention_recompute`` on the layout's layers, the global transformer's."""
    make = {"mlp_tile": 4, "attention_recompute": True, "attention_block_bytes": 4096}
    assert ranks2.run(failing_against_own_code, 2, (40,), make=make) == [[], []]


@pytest.mark.parametrize(
    "make", [{}, {"implementation": "ring"}, {"implementation": "hybrid", "ulysses_degree": 2}]
)
def test_activation_checkpointing_recomputes_each_stack_in_its_own_sequence(ranks4, make):
    """The global transformer's layers recompute in the call of the patches' length they ran in, the byte
    stacks' in the bytes' (the ring reads the lengths: a recompute in the other call would not fit)."""
    assert ranks4.run(failing_against_own_code, 4, (13,), make=make, checkpointed=True) == [[]] * 4


def test_packed_documents_are_exact(ranks2):
    """Positions that restart per document: the byte stacks' mask and rotary pair from them."""
    assert ranks2.run(failing_against_own_code, 2, (40,), packed=True) == [[], []]


@pytest.mark.parametrize("stack", ["encoder_config", "global_config", "decoder_config"])
def test_a_rope_that_rescales_by_the_longest_position_is_refused(stack):
    """Each stack's rotary pair is computed on the rank's positions: a dynamic rope would see a shorter
    sequence than one process's."""
    rope = {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
    model = tiny_model("blt", attn_implementation="auto", **{stack: rope})
    with pytest.raises(cpshard.LayoutError, match="rescales its rotary pair"):
        cpshard.make_cp_forward(model)


def test_blt_is_exact_from_embeddings(ranks2):
    """Embeddings in place of bytes (no byte-group hashes; the model patches them a byte each)."""
    assert ranks2.run(failing_against_own_code, 2, (13,), True, **ONE_BYTE_PATCHES) == [[], []]


@pytest.mark.parametrize(
    "make", [{"implementation": "ring"}, {"implementation": "hybrid", "ulysses_degree": 2}]
)
def test_ring_and_hybrid_are_exact(ranks4, make):
    """The ring over the bytes and over the patches alike (each a sequence of its own length)."""
    assert ranks4.run(failing_against_own_code, 4, (13,), make=make) == [[]] * 4


#: precomputed patches of a batch of 13 bytes: rows of five and four patches (the second zero-padded on the
#: right, as the model's own patching pads rows of fewer)
GIVEN_PATCHES = [[1, 3, 2, 4, 3], [1, 2, 5, 5, 0]]


def given_patches(cp: int, lengths: list[list[int]]) -> list[str]:
    """cp against one process on a batch that carries its patch lengths (``patch_lengths``), plain and
    left-padded; or the error cp raises."""
    mesh = cpshard.make_mesh(cp=cp)
    own, prepared = (tiny_model("blt", attn_implementation="auto") for _ in range(2))
    cp_forward = cpshard.make_cp_forward(prepared)
    rows = []
    for pad in (None, "left"):
        batch = {**tiny_batch(own.config.vocab_size, 2, 13, pad=pad), "patch_lengths": torch.tensor(lengths)}
        try:
            found = failing_rows([check_parity(own, batch, mesh, cp_forward)])
        except ValueError as error:
            return [str(error)]
        rows += [f"pad={pad}: {row}" for row in found]
    return rows


def test_patches_given_with_the_batch_are_exact(ranks2):
    """Precomputed patching (how BLT trains: entropies from the patcher ahead of time), the model's patcher
    not run."""
    assert ranks2.run(given_patches, 2, GIVEN_PATCHES) == [[], []]


def test_given_patches_with_an_empty_one_that_bytes_read_are_refused_on_every_rank(ranks2):
    for rows in ranks2.run(given_patches, 2, [[1, 3, 0, 4, 5], [1, 2, 5, 5, 0]]):
        assert len(rows) == 1 and "patch 2 of row 0 holds no byte" in rows[0], rows


def patch_lengths_refusal(model_type: str, lengths) -> str:
    model = tiny_model(model_type, attn_implementation="auto")
    batch = {**tiny_batch(model.config.vocab_size, 2, 13), "patch_lengths": lengths}
    try:
        cpshard.make_cp_forward(model)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=2))
    except cpshard.BatchError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "model_type, lengths, says",
    [
        ("llama", torch.tensor(GIVEN_PATCHES), "this model's layout takes no patch_lengths"),
        ("blt", torch.tensor(GIVEN_PATCHES, dtype=torch.float32), "must be a 2-D integer tensor of 2 rows"),
        ("blt", torch.tensor(GIVEN_PATCHES[:1]), "must be a 2-D integer tensor of 2 rows"),
    ],
)
def test_patch_lengths_where_they_do_not_fit_are_refused_on_every_rank(ranks2, model_type, lengths, says):
    for message in ranks2.run(patch_lengths_refusal, model_type, lengths):
        assert says in message, message


def fsdp_beside_cp() -> tuple[float, list[str]]:
    """One step on fsdp=2 x cp=2 (each fsdp rank's own batch, the parameters sharded by
    ``cpshard.parallelize``) against one process on both batches: the loss's difference and the gradients
    beyond 1e-5 of their scale."""
    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    model, twin = (tiny_model("blt", attn_implementation="auto") for _ in range(2))
    batches = [tiny_batch(model.config.vocab_size, 2, 13, seed=seed, pad="left") for seed in (1, 2)]
    whole = {key: torch.cat([b[key] for b in batches]) for key in batches[0]}
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    output, grads = step(
        cpshard.params_of(cpshard.parallelize(model, mesh)), batches[mesh.get_local_rank("fsdp")], mesh
    )
    loss, _, expected = reference(twin, {n: p.detach() for n, p in cpshard.params_of(twin).items()}, whole)
    failing = [
        name
        for name, grad in grads.items()
        if (grad.full_tensor() - expected[name]).abs().max() > 1e-5 * expected[name].abs().max()
    ]
    return abs(output.loss.item() - loss.item()), failing


def test_fsdp_beside_cp_is_exact(ranks4):
    for loss_difference, failing in ranks4.run(fsdp_beside_cp):
        assert loss_difference <= 1e-5 and failing == [], (loss_difference, failing)


def recorded_and_analytic(cp: int, length: int, overrides: dict) -> tuple[dict, dict]:
    """The all-gathers' and reduce-scatters' bytes on this rank, at the encoder's cross-attention and at the
    decoder, and the analytic figures for the batch's patches."""
    model = tiny_model("blt", attn_implementation="auto", **overrides)
    batch = tiny_batch(model.config.vocab_size, 2, length)
    with torch.no_grad():
        patches = model.model.patcher(
            batch["input_ids"], patch_size=model.config.patch_size, threshold=model.config.patching_threshold
        )[1].shape[1]
    with recording() as log:
        cp_forward = cpshard.make_cp_forward(model)
        cpshard.value_and_grad(cp_forward)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=cp))
    places = {
        "encoder": "model.local_encoder.cross_attn_layers.",  # every crossing's
        "decoder": "model.local_decoder ",
        "global": "model.global_transformer.layers.0.self_attn ",
    }
    recorded = {}
    for event in log.events:
        for place, prefix in places.items():
            if event.name.startswith(prefix):
                key = (place, event.op, event.phase)
                recorded[key] = recorded.get(key, 0) + event.nbytes
    analytic = gathered_bytes(model.config, 2, length, patches, cp)
    stack = model.config.global_config
    width = stack.hidden_size // stack.num_attention_heads
    # q and the output of every head, k and v of the kv heads (cp divides them): the rank's patches' rows
    per_patch = (2 * stack.num_attention_heads + 2 * stack.num_key_value_heads) * width * 4
    return recorded, {
        **{(place, "all_gather", "forward"): nbytes for place, nbytes in analytic.items()},
        **{(place, "reduce_scatter", "backward"): cp * nbytes for place, nbytes in analytic.items()},
        **{("global", "all_to_all", phase): 2 * -(-patches // cp) * per_patch for phase in PHASES},
    }


@pytest.mark.parametrize("overrides", [{}, {"encoder_config": {"cross_attn_all_layers": True}}])
def test_bytes_are_the_analytic_ones(ranks2, overrides):
    """The gathers where the sequences meet (their gradients reduce-scattered; of an encoder crossing after
    every layer, the last one's alone: it replaces the others unread), and the global transformer's
    all-to-alls over the rank's patches, not its bytes."""
    for recorded, analytic in ranks2.run(recorded_and_analytic, 2, 64, overrides):
        assert recorded == analytic, (recorded, analytic)


def call_refusal(make: dict, overrides: dict) -> str:
    model = tiny_model("blt", attn_implementation="auto", **overrides)
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    try:
        cpshard.make_cp_forward(model, **make)(cpshard.params_of(model), batch, cpshard.make_mesh(cp=4))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "make, overrides, says",
    [
        ({}, {"output_hidden_states": True}, "output_hidden_states in a cp forward"),
        ({}, {"output_attentions": True}, "output_attentions in a cp forward"),
        (
            {"implementation": "ulysses"},
            {"encoder_config": {"num_attention_heads": 2, "num_key_value_heads": 2}},
            "encoder stack has 2 heads",
        ),
    ],
)
def test_what_it_does_not_serve_is_refused_on_every_rank(ranks4, make, overrides, says):
    for message in ranks4.run(call_refusal, make, overrides):
        assert says in message, message


def test_an_empty_patch_that_bytes_read_is_refused():
    """An empty patch attends to every byte in the model (later ones too): refused where a byte reads it or
    a patch after it, served past the last patch the bytes read (one process's patch past the last byte)."""
    ids = torch.tensor([[0, 1, 1, 2]])  # bytes 0..3 in patches 0, 1, 1, 2; patch 3 empty

    def patching(lengths: list[int], read: list[int]) -> Patching:
        return Patching(torch.tensor([lengths]), ids, torch.tensor([read]), share=4, first=0)

    _check_read_patches(patching([1, 2, 1, 0], [0, 1, 1, 2]), 4)  # patch 3 empty, read by no byte
    with pytest.raises(ValueError, match="patch 3 of row 0 holds no byte"):
        _check_read_patches(patching([1, 2, 1, 0], [0, 1, 2, 3]), 4)


def _changed(*args, **kwargs):
    raise AssertionError("the refusal comes before any run")


@pytest.mark.parametrize("piece", list(WRITTEN_AGAINST[1]))
def test_a_change_in_the_code_the_forward_restates_is_refused(monkeypatch, piece):
    """Each piece the forward restates or relies on, changed, is refused at setup, by name."""
    model = tiny_model("blt", attn_implementation="auto")
    *owner, name = piece.split(".")
    module = importlib.import_module(WRITTEN_AGAINST[0])
    monkeypatch.setattr(getattr(module, owner[0]) if owner else module, name, _changed)
    with pytest.raises(cpshard.LayoutError, match="BltModel"):
        cpshard.make_cp_forward(model)
