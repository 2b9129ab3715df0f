"""Ring work on packed documents: the analytic tile counts against the ring's own plan, and the orders
compared on the distribution of issue 18."""

import pytest
import torch

from cpshard.attention.blocks import ring_blocks
from cpshard.bench.balance import lognormal_documents, packed_mask, ring_work
from cpshard.spec.sequence import chunk_width, padded_length_for, positions


def ring_plan_tiles(order: str, lengths: list[int], size: int) -> list[int]:
    """The tiles each rank's ring computes, from the ring's own plan on the dense mask."""
    padded = padded_length_for(sum(lengths), size, order)
    held = [positions(order, padded, size, rank) for rank in range(size)]
    mask, tile = packed_mask(lengths, padded), chunk_width(order, padded, size)
    plans = [ring_blocks(mask, held, padded, rank, False, tile) for rank in range(size)]
    return [sum(len(needed) for needed in plan.tiles) for plan in plans]


@pytest.mark.parametrize("order", ["contiguous", "head_tail", "striped"])
@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("seed", range(3))
def test_counts_match_the_rings_plan(order, size, seed):
    lengths = lognormal_documents(
        int(torch.randint(40, 200, (), generator=torch.Generator().manual_seed(seed))), 9, 1.2, seed
    )
    padded = padded_length_for(sum(lengths), size, order)
    work = ring_work(order, lengths, size, tile=chunk_width(order, padded, size))
    assert list(work.per_rank) == ring_plan_tiles(order, lengths, size)


def test_a_query_sees_its_own_document_up_to_itself():
    mask = packed_mask([2, 3], 6)[0, 0].int()  # the last position is padding: it continues the last document
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 1],
    ]


def test_one_causal_document():
    contiguous = ring_work("contiguous", [64], 4, tile=16)
    assert contiguous.per_rank == (1, 2, 3, 4) and contiguous.one_process == 10  # rank r: r + 1 tiles
    assert contiguous.busiest == pytest.approx(1.6) and contiguous.extra_tiles == 1.0
    head_tail = ring_work("head_tail", [64], 4, tile=8)
    assert len(set(head_tail.per_rank)) == 1 and head_tail.extra_tiles == 1.0


def test_tiles_must_be_runs_of_the_order():
    with pytest.raises(ValueError, match="a tile of 16 tokens spans two chunks of the head_tail order"):
        ring_work("head_tail", [64], 4, tile=16)
    with pytest.raises(ValueError, match="a tile of 5 tokens spans"):
        ring_work("contiguous", [64], 4, tile=5)


def test_documents_fill_the_row():
    lengths = lognormal_documents(131_072, 1024, 1.2, seed=0)
    assert sum(lengths) == 131_072 and min(lengths) >= 1 and len(lengths) > 50


def test_striped_balances_packed_rows_where_head_tail_does_not():
    """Issue 18's distribution: 131,072-token rows, documents log-normal around 1K (sigma 1.2), cp=8,
    128 x 128 tiles; the mean over a few rows (one row's largest documents decide its spread)."""
    rows = [lognormal_documents(131_072, 1024, 1.2, seed) for seed in range(4)]
    mean = {
        order: [
            sum(getattr(ring_work(order, row, 8), m) for row in rows) / len(rows)
            for m in ("busiest", "extra_tiles")
        ]
        for order in ("contiguous", "head_tail", "striped")
    }
    assert mean["striped"][0] <= 1.05 and mean["striped"][1] == 1.0
    assert mean["head_tail"][0] > 1.5 and mean["contiguous"][0] > mean["head_tail"][0]
