"""Verify before trusting: a layout that is not a tested file is probed once, and a mismatch is an error
on every rank naming the first layer that differs."""

import pytest

import cpshard
from cpshard.layouts.decoder import LAYOUT as DECODER
from cpshard.tools.parity import check_parity, failing_rows
from cpshard.tools.tiny import tiny_batch, tiny_model


def run_probe_case(kind: str):
    model = tiny_model("gpt_oss" if kind == "sinks-ring" else "llama", attn_implementation="auto")
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    mesh = cpshard.make_mesh(cp=2)
    if kind == "sinks-ring":
        forward = cpshard.make_cp_forward(model, implementation="ring")
        return forward(cpshard.params_of(model), batch, mesh)
    forward = cpshard.make_cp_forward(model, layout=DECODER.with_rows(name="renamed"))
    return failing_rows([check_parity(model, batch, mesh, forward)])


CASES = {
    "sinks-ring": "the ring's merge has no place for the per-head parameters ('sinks',)",
}


@pytest.mark.parametrize("kind", CASES)
def test_a_layout_cp_cannot_vouch_for_fails_on_every_rank(ranks2, kind):
    with pytest.raises(cpshard.RankError) as caught:
        ranks2.run(run_probe_case, kind)
    failures = caught.value.failures
    assert sorted(failures) == [0, 1]
    for failure in failures.values():
        assert failure.kind == "LayoutError" and CASES[kind] in failure.message, failure.message


def test_a_right_layout_passes_the_probe_and_stays_exact(ranks2):
    assert ranks2.run(run_probe_case, "right") == [[], []]
