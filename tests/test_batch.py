"""The batch: validation, padding to a multiple of cp, shifted labels, and the cross-rank check."""

import itertools

import pytest
import torch
import torch.distributed as dist

import cpshard
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.runtime.batch import (
    BatchError,
    check_batch,
    continued_positions,
    fingerprint,
    fingerprint_differences,
    packed_documents,
    pad_batch,
    shifted_labels,
    validate,
    without_varlen_keys,
)
from cpshard.spec.sequence import padded_length_for
from cpshard.tools.tiny import tiny_batch, tiny_model

B, L, D, VOCAB = 2, 5, 3, 50


def _ids(*shape, seed=0):
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _batch(**extra):
    return {"input_ids": _ids(B, L), **extra}


# ---- validate ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch, words",
    [
        (
            {"input_ids": _ids(B, L), "inputs_embeds": torch.zeros(B, L, D)},
            ["exactly one", "input_ids", "inputs_embeds"],
        ),
        ({"labels": _ids(B, L)}, ["exactly one", "neither"]),
        ({}, ["exactly one", "neither"]),
        ({"input_ids": None, "inputs_embeds": None}, ["neither"]),
        (_batch(labels=_ids(B, L + 1)), ["'labels'", "[2, 6]", "[2, 5]"]),
        (_batch(shift_labels=_ids(B + 1, L)), ["'shift_labels'", "[3, 5]", "[2, 5]"]),
        (_batch(position_ids=_ids(3, L)), ["'position_ids'", "[3, 5]"]),
        (
            _batch(attention_mask=torch.ones(B, 1, L, L)),
            ["'attention_mask'", "2-D", "[2, 1, 5, 5]", "4-D mask"],
        ),
        (_batch(attention_mask=[[1] * L] * B), ["'attention_mask'", "tensor", "list"]),
        (_batch(foo=1, token_type_ids=_ids(B, L)), ["unknown batch keys", "'foo'", "'token_type_ids'"]),
        ({"input_ids": _ids(B, L), 3: 1}, ["unknown batch keys", "3"]),
        ({"input_ids": _ids(B, 0)}, ["at least one", "[2, 0]"]),
        ({"input_ids": _ids(0, L)}, ["at least one", "[0, 5]"]),
        ({"input_ids": _ids(L)}, ["'input_ids'", "2-D", "[5]"]),
        ({"input_ids": torch.zeros(B, L)}, ["integer token ids", "inputs_embeds"]),
        ({"inputs_embeds": torch.zeros(B, L)}, ["'inputs_embeds'", "3-D", "[2, 5]"]),
        ([("input_ids", _ids(B, L))], ["dict", "list"]),
    ],
)
def test_validate_errors(batch, words):
    with pytest.raises(BatchError) as info:
        validate(batch)
    missing = [word for word in words if word not in str(info.value)]
    assert not missing, f"{info.value} lacks {missing}"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "labels, words",
    [
        (torch.tensor([[3, 9, -100, 10, 1]] * 2), ["holds 10 at [0, 3]", "below the vocabulary size 10"]),
        (
            torch.tensor([[3, -1, -100, 4, 1]] * 2),
            ["holds -1 at [0, 1]", "or -100 for tokens without a loss"],
        ),
        (torch.ones(2, 5), ["integer token ids", "torch.float32"]),
        (torch.ones(2, 5, dtype=torch.bool), ["integer token ids", "torch.bool"]),
    ],
)
@pytest.mark.parametrize("key", ["labels", "shift_labels"])
def test_validate_labels(labels, words, key):
    batch = {"input_ids": _ids(B, L), key: labels}
    with pytest.raises(BatchError) as info:
        validate(batch, vocab_size=10)
    missing = [word for word in words if word not in str(info.value)]
    assert not missing, f"{info.value} lacks {missing}"
    assert f"batch[{key!r}]" in str(info.value)
    ok = torch.tensor([[3, 9, -100, 0, 1]] * 2)
    assert validate({"input_ids": _ids(B, L), key: ok}, vocab_size=10) == (B, L)


@pytest.mark.parametrize(
    "batch",
    [
        _batch(),
        _batch(labels=_ids(B, L), attention_mask=torch.ones(B, L, dtype=torch.long), position_ids=_ids(B, L)),
        _batch(position_ids=torch.arange(L)[None]),  # one row of positions for every row
        _batch(shift_labels=_ids(B, L), labels=None),
        {"inputs_embeds": torch.zeros(B, L, D), "labels": _ids(B, L)},
    ],
)
def test_validate_accepts(batch):
    assert validate(batch) == (B, L)


# ---- the pure pieces -----------------------------------------------------------------------------


@pytest.mark.parametrize("length, cp", list(itertools.product([1, 2, 3, 7, 8, 9, 1023], [1, 2, 3, 4, 8])))
def test_padded_length_for(length, cp):
    assert padded_length_for(length, cp) == next(n for n in itertools.count(length) if n % cp == 0)


@pytest.mark.parametrize("length", [1, 2, 7])
def test_shifted_labels(length):
    labels = _ids(B, length)
    labels[0, -1] = IGNORE_INDEX
    shifted = shifted_labels(labels)
    for b, i in itertools.product(range(B), range(length)):
        assert shifted[b, i] == (labels[b, i + 1] if i + 1 < length else IGNORE_INDEX)


def test_shifted_labels_give_the_causal_loss():
    """The loss over shifted labels is transformers' causal loss over the unshifted ones."""
    logits, labels = torch.randn(B, L, VOCAB, generator=torch.Generator().manual_seed(1)), _ids(B, L)
    cross_entropy = torch.nn.functional.cross_entropy
    ours = cross_entropy(logits.flatten(0, 1), shifted_labels(labels).flatten(), ignore_index=IGNORE_INDEX)
    causal = cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(ours, causal)


@pytest.mark.parametrize("extra", [0, 1, 3])
def test_continued_positions(extra):
    positions = torch.tensor([[0, 1, 2, 0, 1], [5, 6, 7, 8, 9]])
    result = continued_positions(positions, extra)
    assert result.shape == (2, L + extra) and result.dtype == positions.dtype
    assert torch.equal(result[:, :L], positions)
    for row in range(2):
        assert result[row, L:].tolist() == [positions[row, -1].item() + k for k in range(1, extra + 1)]


# ---- pad_batch -----------------------------------------------------------------------------------


def _padded(x: torch.Tensor, length: int, value) -> torch.Tensor:
    """``x`` with dim 1 filled up to ``length`` with ``value`` (the reference, built by assignment)."""
    out = torch.full((x.shape[0], length, *x.shape[2:]), value, dtype=x.dtype)
    out[:, : x.shape[1]] = x
    return out


@pytest.mark.parametrize("cp", [1, 2, 4, 5])
@pytest.mark.parametrize("pad_token_id", [None, 7])
def test_pad_batch_input_ids(cp, pad_token_id):
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    batch = _batch(labels=_ids(B, L, seed=1), attention_mask=mask, position_ids=positions)
    padded = pad_batch(batch, cp, pad_token_id)
    length = padded_length_for(L, cp)
    assert (padded.length, padded.padded_length) == (L, length)
    assert set(padded.model_inputs) == {"input_ids", "attention_mask", "position_ids"}
    assert torch.equal(
        padded.model_inputs["input_ids"], _padded(batch["input_ids"], length, pad_token_id or 0)
    )
    assert torch.equal(padded.model_inputs["attention_mask"], _padded(mask, length, 0))
    assert torch.equal(padded.model_inputs["position_ids"], continued_positions(positions, length - L))
    assert torch.equal(padded.shift_labels, _padded(shifted_labels(batch["labels"]), length, IGNORE_INDEX))


def test_pad_batch_inputs_embeds_and_shift_labels():
    embeds = torch.randn(B, L, D)
    given = _ids(B, L, seed=2)
    padded = pad_batch({"inputs_embeds": embeds, "shift_labels": given, "labels": _ids(B, L, seed=3)}, 4, 0)
    assert set(padded.model_inputs) == {"inputs_embeds"}
    assert torch.equal(padded.model_inputs["inputs_embeds"], _padded(embeds, 8, 0.0))
    assert torch.equal(padded.shift_labels, _padded(given, 8, IGNORE_INDEX))  # shift_labels win over labels


def test_pad_batch_without_labels():
    padded = pad_batch(_batch(), 2, 0)
    assert padded.shift_labels is None and padded.padded_length == 6


# ---- fingerprint ---------------------------------------------------------------------------------


def _long_row_swapped():
    ids = torch.arange(2000)[None] % VOCAB
    swapped = ids.clone()
    swapped[0, 0], swapped[0, 997] = ids[0, 997], ids[0, 0]
    assert not torch.equal(ids, swapped)
    return {"input_ids": ids}, {"input_ids": swapped}


DIFFERENT = {
    "value": ({"input_ids": _ids(B, L)}, {"input_ids": _ids(B, L).index_fill(1, torch.tensor(4), 1)}),
    "shape": ({"input_ids": _ids(B, L)}, {"input_ids": _ids(B, L + 1)}),
    "shape, same values": (
        {"input_ids": torch.arange(12).reshape(2, 6)},
        {"input_ids": torch.arange(12).reshape(3, 4)},
    ),
    "key": (_batch(), _batch(labels=_ids(B, L))),
    "key name": (_batch(labels=_ids(B, L)), _batch(shift_labels=_ids(B, L))),
    "unknown key": (_batch(), _batch(extra=1)),
    "embeds": (
        {"inputs_embeds": torch.ones(B, L, D)},
        {"inputs_embeds": torch.ones(B, L, D).index_fill(2, torch.tensor(2), 2)},
    ),
    "swapped 997 apart": _long_row_swapped(),
    # its gradient's all-reduce (cpshard.runtime.grad.inputs_summed_in_backward) would run on one rank only
    "embeds requiring a gradient": (
        {"inputs_embeds": torch.ones(B, L, D)},
        {"inputs_embeds": torch.ones(B, L, D).requires_grad_()},
    ),
}


@pytest.mark.parametrize("case", DIFFERENT)
def test_fingerprint_differs(case):
    first, second = DIFFERENT[case]
    assert not torch.equal(fingerprint(first), fingerprint(second))


SAID = {
    "value": "other values of input_ids",
    "shape": f"input_ids: shape [{B}, {L}] on rank 0, shape [{B}, {L + 1}] on rank 1",
    "shape, same values": "input_ids: shape [2, 6] on rank 0, shape [3, 4] on rank 1",
    "key": f"keys: 1 on rank 0, 2 on rank 1; labels: absent (or not a tensor) on rank 0, shape [{B}, {L}] on",
    "key name": f"labels: shape [{B}, {L}] on rank 0, absent (or not a tensor) on rank 1; shift_labels: ",
    "unknown key": "keys: 1 on rank 0, 2 on rank 1",
    "embeds requiring a gradient": "inputs_embeds: requires a gradient on rank 1 only",
}


@pytest.mark.parametrize("case", SAID)
def test_what_differs_is_read_off_the_fingerprints(case):
    """A message that named only the ranks sent the user to print both batches to find a length off by one."""
    first, second = DIFFERENT[case]
    rows = {0: fingerprint(first), 1: fingerprint(second)}
    assert fingerprint_differences(rows, 0, 1).startswith(SAID[case])


def test_the_same_nan_values_are_not_said_to_differ():
    """``torch.equal`` finds a NaN unequal to itself; the fingerprints are compared bit for bit."""
    embeds = torch.full((B, L, D), float("nan"))
    rows = {
        0: fingerprint({"inputs_embeds": embeds}),
        1: fingerprint({"inputs_embeds": embeds, "labels": _ids(B, L)}),
    }
    assert fingerprint_differences(rows, 0, 1) == (
        "keys: 1 on rank 0, 2 on rank 1; labels: absent (or not a tensor) on rank 0, "
        f"shape [{B}, {L}] on rank 1"
    )


def test_fingerprint_equal_for_equal_batches():
    batch = _batch(labels=_ids(B, L), attention_mask=torch.ones(B, L))
    copy = {key: value.clone() for key, value in reversed(batch.items())}
    assert torch.equal(fingerprint(batch), fingerprint(copy))
    assert fingerprint(batch).dtype == torch.float64


@pytest.mark.parametrize("odd", [None, [1, 2], {"input_ids": [1, 2]}, {"input_ids": torch.zeros(2, 3, 4, 5)}])
def test_fingerprint_is_safe_on_anything(odd):
    assert fingerprint(odd).shape == fingerprint({}).shape


# ---- across ranks --------------------------------------------------------------------------------


def _rank_batch(case: str, rank: int):
    """The batch a rank holds: ``DIFFERENT[case]`` puts rank 1 on the second batch."""
    if case == "same":
        return _batch(labels=_ids(B, L))
    if case == "same with NaN":
        return {"inputs_embeds": torch.full((B, L, D), float("nan"))}
    return DIFFERENT[case][min(rank, 1)]


def _check(case: str):
    check_batch(_rank_batch(case, dist.get_rank()), cpshard.make_mesh(cp=dist.get_world_size()))


def _check_every_case():
    """Each case once, every error caught: (case -> message or None) on this rank."""
    outcomes = {}
    for case in ["same", "same with NaN", *DIFFERENT]:
        try:
            _check(case)
            outcomes[case] = None
        except BatchError as error:
            outcomes[case] = str(error)
    return outcomes


def test_a_batch_that_differs_in_the_cp_group_raises_on_every_rank(ranks2):
    with pytest.raises(cpshard.RankError) as info:
        ranks2.run(_check, "value")
    failures = info.value.failures
    assert sorted(failures) == [0, 1]
    for failure in failures.values():
        assert failure.kind == "BatchError"
        assert (
            "ranks [1]" in failure.message and "rank 0" in failure.message and "dp ranks" in failure.message
        )
        assert "check_batch" in failure.traceback
    for outcomes in ranks2.run(_check_every_case):
        assert outcomes["same"] is None and outcomes["same with NaN"] is None
        for case in DIFFERENT:
            assert outcomes[case] is not None and "ranks [1]" in outcomes[case], case


# ---- across a mesh larger than the cp group ------------------------------------------------------


def _dp_group_batch(case: str, rank: int) -> dict:
    """On fsdp=2 x cp=2 (cp groups: ranks 0-1 and 2-3) the dp groups hold different batches; ``case`` spoils
    the second one: rank 3 alone ("differs"), or both its ranks alike ("invalid")."""
    batch = _batch(labels=_ids(B, L)) if rank < 2 else {"input_ids": _ids(B + 1, L + 2, seed=5)}
    if case == "differs" and rank == 3:
        batch["input_ids"] = batch["input_ids"] + 1
    if case == "invalid" and rank >= 2:
        batch["attention_mask"] = torch.ones(B + 1, 1, L + 2, L + 2)
    return batch


def _check_batch_on_fsdp_cp(case: str):
    try:
        return check_batch(_dp_group_batch(case, dist.get_rank()), cpshard.make_mesh(fsdp=2, cp=2))
    except BatchError as error:
        return str(error)


def test_check_batch_passes_different_batches_in_different_dp_groups(ranks4):
    assert ranks4.run(_check_batch_on_fsdp_cp, "fine") == [(B, L), (B, L), (B + 1, L + 2), (B + 1, L + 2)]


def test_a_batch_differing_in_one_cp_group_stops_every_dp_group(ranks4):
    own, other = "ranks [3] hold other keys, shapes or values than rank 2", "in the dp group of ranks [2, 3]"
    messages = ranks4.run(_check_batch_on_fsdp_cp, "differs")
    assert all(own in message and other in message for message in messages[:2]), messages
    assert all(own in message and other not in message for message in messages[2:]), messages


def test_an_invalid_batch_in_one_dp_group_stops_every_dp_group(ranks4):
    messages = ranks4.run(_check_batch_on_fsdp_cp, "invalid")
    assert all("ranks [2, 3] hold a batch that is not valid" in message for message in messages[:2]), messages
    assert all("batch['attention_mask'] must be 2-D" in message for message in messages[2:]), messages


def _step_on_fsdp_cp(case: str):
    model = tiny_model("llama")
    batch = tiny_batch(model.config.vocab_size, 2, 8, seed=1 + dist.get_rank() // 2)  # one batch per dp group
    if case == "differs" and dist.get_rank() == 3:
        batch["input_ids"] = batch["input_ids"] + 1
    mesh = cpshard.make_mesh(fsdp=2, cp=2)
    output, _ = cpshard.value_and_grad(cpshard.make_cp_forward(model))(cpshard.params_of(model), batch, mesh)
    return output.loss.item()


def test_a_step_whose_batch_differs_in_one_cp_group_raises_on_every_rank_without_hanging(ranks4):
    """Checked within the cp group alone, ranks 0-1 went on into the loss all-reduce and waited there for
    ranks 2-3 until the timeout; now every rank raises at once and the group stays usable."""
    with pytest.raises(cpshard.RankError) as info:
        ranks4.run(_step_on_fsdp_cp, "differs")
    assert sorted(info.value.failures) == [0, 1, 2, 3], str(info.value)
    assert all(f.kind == "BatchError" for f in info.value.failures.values())
    assert ranks4.alive
    losses = ranks4.run(_step_on_fsdp_cp, "same")
    assert len(set(losses)) == 1


def test_packed_documents_are_restarts_between_real_tokens():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    generated = (mask.cumsum(1) - 1).masked_fill(mask == 0, 0)  # as generate makes them: padding at 0
    assert not packed_documents({"position_ids": generated, "attention_mask": mask})
    assert packed_documents({"position_ids": generated})  # without the mask, the zeros read as restarts
    restarted = torch.tensor([[0, 0, 0, 1, 0], [0, 1, 2, 0, 1], [0, 1, 2, 0, 0]])
    assert packed_documents({"position_ids": restarted, "attention_mask": mask})


def _flattened(lengths: list[int]) -> dict:
    """A packing collator's one row (as TRL's padding-free collator and transformers' flattening one make
    it): documents of ``lengths`` with their positions and the varlen keys that mark them."""
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return {
        "input_ids": torch.arange(sum(lengths))[None],
        "position_ids": position_ids,
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
        "seq_idx": torch.repeat_interleave(
            torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths)
        )[None],
    }


def test_varlen_keys_that_mark_the_position_restarts_are_dropped():
    batch = _flattened([3, 1, 4])
    kept = without_varlen_keys(batch)
    assert set(kept) == {"input_ids", "position_ids"} and kept["position_ids"] is batch["position_ids"]
    assert without_varlen_keys({"input_ids": batch["input_ids"]}) == {"input_ids": batch["input_ids"]}


@pytest.mark.parametrize(
    "change, words",
    [
        (
            lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 4, 8], dtype=torch.int32)),
            "'cu_seq_lens_q'] does not",
        ),
        (lambda b: b.update(max_length_k=3), "'max_length_k'] does not mark"),
        (lambda b: b.update(seq_idx=torch.zeros(1, 8, dtype=torch.int32)), "'seq_idx'] does not mark"),
        (lambda b: b.pop("position_ids"), "must give as [1, L]"),
        (lambda b: b.update(position_ids=b["position_ids"].expand(2, -1)), "must give as [1, L]"),
    ],
    ids=["other boundaries", "other longest", "other document index", "no positions", "two rows"],
)
def test_varlen_keys_that_mark_other_documents_are_refused(change, words):
    batch = _flattened([3, 1, 4])
    change(batch)
    with pytest.raises(BatchError) as caught:
        without_varlen_keys(batch)
    assert words in str(caught.value)
