"""Checks that every rank decides alike (cpshard.comm.consensus), on the cp rows of a 2 x 2 mesh, so that
the ranks they name are global ranks, not places in the group."""

import torch
import torch.distributed as dist

import cpshard
from cpshard.comm.consensus import (
    TEXT_BYTES,
    differing_ranks,
    gather_checked,
    gather_texts,
    items_text,
    what_differs,
)


def _text(rank: int) -> str:
    """A text of each rank's own length: rank 0's empty, rank 3's longer than what is carried (cut inside a
    character)."""
    return f"rank {rank} " + "é" * (2100 if rank == 3 else 100 * rank) if rank else ""


def _consensus_cases() -> dict:
    rank = dist.get_rank()
    group = cpshard.make_mesh(cp=2, fsdp=2).get_group("cp")
    ranks = dist.get_process_group_ranks(group)
    texts = gather_texts(_text(rank), group, "texts")
    row = torch.tensor([7, rank // 2, rank % 2])
    every, failing = gather_checked(row, group, "passing", None, -1)
    failure = ValueError(f"rank {rank}'s own error") if rank == 3 else None
    try:
        _, failing_here = gather_checked(row, group, "failing", failure, -1)
    except ValueError as error:
        failing_here = str(error)
    return {
        "ranks": ranks,
        "texts": texts,
        "every": every.tolist(),
        "failing": failing,
        "differing": differing_ranks(every[:, 2:], ranks),
        "failing here": failing_here,
    }


def test_rows_and_texts_gathered_name_global_ranks(ranks4):
    for rank, case in enumerate(ranks4.run(_consensus_cases)):
        ranks = [0, 1] if rank < 2 else [2, 3]
        assert case["ranks"] == ranks
        expected = [_text(r) for r in ranks]
        if rank >= 2:  # rank 3's text cut at TEXT_BYTES, inside a two-byte character: dropped whole
            assert len(_text(3).encode()) > TEXT_BYTES
            expected[1] = _text(3).encode()[:TEXT_BYTES].decode(errors="ignore")
            assert _text(3).startswith(expected[1]) and len(expected[1].encode()) == TEXT_BYTES - 1
        assert case["texts"] == expected
        assert case["every"] == [[7, r // 2, r % 2] for r in ranks]
        assert case["failing"] == [] and case["differing"] == [ranks[1]]
        assert case["failing here"] == {0: [], 1: [], 2: [3], 3: "rank 3's own error"}[rank]


def test_what_differs_names_the_items_that_differ_each_rank_s():
    first = items_text({"layout": "llama", "implementation": "ulysses", "mlp_tile": None})
    assert first == "layout='llama'\nimplementation='ulysses'\nmlp_tile=None"
    other = items_text({"layout": "llama", "implementation": "ring", "mlp_tile": 4, "extra": ()})
    texts, ranks = [first, first, other], [4, 5, 6]
    assert what_differs(texts, ranks, 6) == (
        "rank 4: implementation='ulysses', mlp_tile=None, extra=<absent>; "
        "rank 6: implementation='ring', mlp_tile=4, extra=()"
    )
    # an item more at the start (another release's options) shifts no other item into the message
    shifted = items_text({"new": 1, "layout": "llama", "implementation": "ulysses", "mlp_tile": None})
    assert what_differs([first, shifted], [0, 1], 1) == "rank 0: new=<absent>; rank 1: new=1"
    # texts that differ only beyond what was carried
    assert what_differs([first, first], [0, 1], 1) == (
        f"rank 0 and rank 1 differ beyond the first {TEXT_BYTES} bytes of their texts"
    )
