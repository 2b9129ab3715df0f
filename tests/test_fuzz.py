"""Fuzzed parity: random batches, models and implementations, each checked against one process.

Hypothesis draws, with a fixed seed (``derandomize``): the model type and its attention options, the
batch size (1-3), the length (1-24: lengths cp does not divide and lengths below cp included),
padding on either side with any amount per row (whole rows of padding included), packed documents
(position_ids that restart), labels or shift_labels, the implementation (Ulysses and ring; hybrid
at cp=4), the sequence order, and logits=False. Every example is one ``ranks.run`` call that
compares loss, logits and every gradient with the plain model at ``cpshard.tools.parity.RTOL``.
Batches without a single label token are left to tests/test_edge_cases.py (one process's loss is
NaN there, cpshard's is 0 by contract).
"""

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import cpshard
from cpshard.loss.cross_entropy import IGNORE_INDEX
from cpshard.runtime.batch import shifted_labels
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_model

EXAMPLES_PER_CP = 50  # 100 in all
MAX_LENGTH = 24
VOCAB = 128  # cpshard.tools.tiny_sizes.SMALL
MODEL_TYPES = ("llama", "qwen3", "mistral", "gemma3_text")
SLIDING = ("mistral", "gemma3_text")  # a sliding window is a plain config option for these
IMPLEMENTATIONS = {2: ("ring", "ulysses"), 4: ("hybrid", "ring", "ulysses")}


@dataclass(frozen=True)
class FuzzCase:
    model_type: str
    config: dict  # tiny_model options
    forward: dict  # make_cp_forward options
    batch: dict  # the tensors, built here and sent to the ranks

    def __repr__(self):  # whole, so that a failing example printed by hypothesis is its own reproduction
        batch = ", ".join(f"{key!r}: torch.tensor({value.tolist()})" for key, value in self.batch.items())
        return (
            f"FuzzCase({self.model_type!r}, config={self.config}, forward={self.forward}, batch={{{batch}}})"
        )


def _positions(starts: list[bool]) -> list[int]:
    """Position ids that restart at 0 where a document starts."""
    positions = []
    for index, start in enumerate(starts):
        positions.append(0 if start or index == 0 else positions[-1] + 1)
    return positions


@st.composite
def batches(draw) -> dict:
    rows, length = draw(st.integers(1, 3)), draw(st.integers(1, MAX_LENGTH))
    seed = draw(st.integers(0, 2**16))
    ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))
    batch = {"input_ids": ids}
    labels = ids.clone()
    side = draw(st.sampled_from([None, "left", "right"]))
    if side is not None:
        mask = torch.ones(rows, length, dtype=torch.long)
        for row in range(rows):
            amount = draw(st.integers(0, length))  # 0 to the whole row
            mask[row, slice(0, amount) if side == "left" else slice(length - amount, length)] = 0
        batch["attention_mask"] = mask
        labels[mask == 0] = IGNORE_INDEX
    if draw(st.booleans()):  # packed documents
        starts = draw(
            st.lists(st.lists(st.booleans(), min_size=length, max_size=length), min_size=rows, max_size=rows)
        )
        batch["position_ids"] = torch.tensor([_positions(row) for row in starts])
    if draw(st.booleans()):
        batch["shift_labels"] = shifted_labels(labels)
    else:
        batch["labels"] = labels
    return batch


def _label_tokens(batch: dict) -> int:
    labels = batch["shift_labels"] if "shift_labels" in batch else shifted_labels(batch["labels"])
    return int((labels != IGNORE_INDEX).sum())


@st.composite
def cases(draw, cp: int) -> FuzzCase:
    model_type = draw(st.sampled_from(MODEL_TYPES))
    config = {
        "attn_implementation": draw(st.sampled_from(["sdpa", "eager"])),
        "num_key_value_heads": draw(st.sampled_from([1, 2, 4])),
    }
    if model_type in SLIDING:
        config["sliding_window"] = draw(st.sampled_from([2, 5, 4096]))
    forward = {"implementation": draw(st.sampled_from(IMPLEMENTATIONS[cp]))}
    if forward["implementation"] != "ulysses":
        forward["sequence_order"] = draw(st.sampled_from(["head_tail", "contiguous"]))
    batch = draw(batches())
    assume(_label_tokens(batch) > 0)
    if draw(st.integers(0, 3)) == 3:
        forward["logits"] = False
    return FuzzCase(model_type, config, forward, batch)


def run_case(case: FuzzCase):
    model = tiny_model(case.model_type, **case.config)
    mesh = cpshard.make_mesh(cp=dist.get_world_size())
    return check_parity(model, case.batch, mesh, cpshard.make_cp_forward(model, **case.forward))


def _fuzz(ranks, cp: int, tally: Counter) -> None:
    """Run the examples, counting in ``tally`` the cases tried and failed (also when one fails)."""

    @settings(
        derandomize=True,
        max_examples=EXAMPLES_PER_CP,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=cases(cp))
    def check(case):
        tally["tried"] += 1
        try:
            parities = ranks.run(run_case, case)
            failing = failing_rows(parities)
            assert not failing, f"{case}: rows over RTOL: {failing}; diffs {parities[0].diffs}"
            assert all(math.isfinite(p.diffs["loss"]) for p in parities), f"{case}: loss not finite"
            assert all(p.diffs == parities[0].diffs for p in parities), f"{case}: ranks disagree"
        except BaseException:
            tally["failed"] += 1
            raise

    check()


@pytest.mark.parametrize("cp", [2, 4])
def test_fuzzed_batches_match_one_process(cp, ranks2, ranks4, capsys):
    tally = Counter(tried=0, failed=0)
    try:
        _fuzz({2: ranks2, 4: ranks4}[cp], cp, tally)
    finally:
        with capsys.disabled():
            print(f"\nfuzzed parity cp={cp}: {tally['tried']} cases tried, {tally['failed']} failed")
    assert tally["tried"] == EXAMPLES_PER_CP and tally["failed"] == 0
