"""Ring blocks cut from the whole-sequence mask: exact entries, needed blocks, rows without keys."""

import pytest
import torch

from cpshard.attention.blocks import allowed, ring_blocks, rows_without_keys
from cpshard.spec.sequence import positions


def causal(length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril()[None, None]


def test_none_is_plain_causal_and_blocks_index_the_mask():
    q_pos, k_pos = torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])
    assert torch.equal(allowed(None, q_pos, k_pos), causal(8)[..., q_pos, :][..., k_pos])
    window = causal(8) & ~torch.ones(8, 8, dtype=torch.bool).tril(-3)[None, None]
    assert torch.equal(allowed(window, q_pos, k_pos), window[:, :, q_pos][:, :, :, k_pos])


def test_additive_masks_of_zero_and_minimum_are_read_other_biases_refused():
    bias = torch.zeros(1, 1, 4, 4).masked_fill(~causal(4), torch.finfo(torch.float32).min)
    assert torch.equal(allowed(bias, torch.arange(4), torch.arange(4)), causal(4))
    with pytest.raises(ValueError, match="only implementation='ulysses' can honour"):
        allowed(bias + 0.5, torch.arange(4), torch.arange(4))


def test_rows_without_keys_are_the_left_padding():
    mask = causal(6).repeat(2, 1, 1, 1)
    mask[1, :, :, :2] = False  # row 1: two tokens of left padding
    empty = rows_without_keys(mask, 6)
    assert empty[0].sum() == 0 and empty[1, 0].tolist() == [True, True, False, False, False, False]
    assert rows_without_keys(None, 6) is None


def test_sliding_window_skips_all_but_two_blocks_per_rank():
    length, size = 32, 4
    window = causal(length) & ~torch.ones(length, length, dtype=torch.bool).tril(-2)[None, None]
    held = [positions("contiguous", length, size, r) for r in range(size)]
    blocks = ring_blocks(window, held, length, rank=1, uniform_rows=False, tile=8)
    assert blocks.needed == [[q - 1 <= k <= q for k in range(size)] for q in range(size)]
    assert blocks.skipped == size * size - (2 * size - 1)
    assert not blocks.masks[3].any() and blocks.masks[1].any() and blocks.uniform is None


def test_uniform_rows_may_look_at_every_real_key():
    mask = causal(8)
    mask[..., :3] = False  # three tokens of left padding
    held = [positions("contiguous", 8, 2, r) for r in range(2)]
    blocks = ring_blocks(mask, held, 6, rank=0, uniform_rows=True, tile=4)  # 6 real tokens, 2 of cp padding
    assert blocks.uniform[0, 0].tolist() == [True, True, True, False]
    assert blocks.masks[1][0, 0, 0].tolist() == [True, True, False, False]  # keys 4, 5 real; 6, 7 padding
