"""Sequence orders: which positions each rank holds, and the plan to move between orders."""

import pytest
import torch

from cpshard.spec.sequence import (
    STRIPE,
    chunk_positions,
    chunk_width,
    exchange_plan,
    group_positions,
    padded_length_for,
    positions,
    row_blocks,
)


@pytest.mark.parametrize("order", ["contiguous", "head_tail", "striped"])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_every_position_is_held_once(order, size):
    held = torch.cat([positions(order, 8 * size, size, r) for r in range(size)])
    assert sorted(held.tolist()) == list(range(8 * size))


def test_head_tail_pairs_an_early_chunk_with_a_late_one():
    assert [positions("head_tail", 16, 4, r).tolist() for r in (0, 3)] == [[0, 1, 14, 15], [6, 7, 8, 9]]
    causal_work = [sum(p + 1 for p in positions("head_tail", 64, 4, r).tolist()) for r in range(4)]
    assert len(set(causal_work)) == 1, causal_work  # every rank: the same number of (q, k) pairs


def test_striped_deals_stripes_round_robin():
    assert [positions("striped", 16, 2, r).tolist() for r in (0, 1)] == [
        [0, 1, 4, 5, 8, 9, 12, 13],
        [2, 3, 6, 7, 10, 11, 14, 15],
    ]  # at least four stripes a rank: two tokens wide here


@pytest.mark.parametrize("size", [1, 2, 3, 8])
@pytest.mark.parametrize("length", [1, 5, 100, 1000, 4 * STRIPE * 8 + 1, 131_072, 131_073])
def test_striped_padding_gives_stripes_of_at_most_a_tile(length, size):
    padded = padded_length_for(length, size, "striped")
    width = chunk_width("striped", padded, size)
    assert length <= padded < length + size * max(4, -(-length // (size * STRIPE)))  # under a token a stripe
    assert padded_length_for(padded, size, "striped") == padded  # the padded length keeps its stripes
    assert 1 <= width <= STRIPE and padded % (size * width) == 0
    held = torch.cat([positions("striped", padded, size, r) for r in range(size)])
    assert sorted(held.tolist()) == list(range(padded))


def test_bad_orders_and_lengths_are_named():
    with pytest.raises(ValueError, match="unknown sequence order 'zigzag'"):
        positions("zigzag", 8, 2, 0)
    with pytest.raises(ValueError, match="12 tokens does not split into 8 equal chunks"):
        positions("head_tail", 12, 4, 0)


def test_chunks_follow_dtensor_uneven_sharding():
    for length, size in [(13, 2), (10, 4), (5, 4), (3, 4)]:
        sizes = [len(chunk_positions(length, size, r)) for r in range(size)]
        expected = [len(c) for c in torch.arange(length).chunk(size)] + [0] * size
        assert sizes == expected[:size]


def test_group_positions_concatenate_in_rank_order():
    assert group_positions("contiguous", 8, 4, [2, 3]).tolist() == [4, 5, 6, 7]


def test_exchange_plan_moves_every_token_to_its_new_holder():
    length, size = 16, 4
    src = [positions("head_tail", length, size, r) for r in range(size)]
    dst = [chunk_positions(13, size, r) for r in range(size)]  # to chunks of the real 13, padding dropped
    plans = [exchange_plan(src, dst, r) for r in range(size)]
    for receiver in range(size):
        got = torch.full((len(dst[receiver]),), -1)
        for sender in range(size):
            send, _ = plans[sender]
            _, receive = plans[receiver]
            got[receive[sender]] = src[sender][send[receiver]]
        assert torch.equal(got, dst[receiver])


def test_row_blocks_cover_every_row_once():
    for rows, width, elements in ((51, 50, 100), (51, 50, 1), (0, 50, 100), (7, 3, 1 << 20)):
        covered = [r for block in row_blocks(rows, width, elements) for r in range(rows)[block]]
        assert covered == list(range(rows))
    assert len(row_blocks(51, 50, 100)) == 26  # two rows a block, the last one alone
