"""The one additive-mask helper: 0 where a key is allowed, the hidden value elsewhere, floats as given."""

import torch

from cpshard.spec.masks import additive_mask


def test_a_boolean_mask_becomes_zeros_and_the_hidden_value():
    allowed = torch.tensor([[True, False], [True, True]])
    assert additive_mask(allowed, torch.float32).tolist() == [[0.0, float("-inf")], [0.0, 0.0]]
    lowest = torch.finfo(torch.bfloat16).min
    got = additive_mask(allowed, torch.bfloat16, lowest)
    assert got.dtype == torch.bfloat16 and got[0, 1].item() == lowest and got[1].tolist() == [0.0, 0.0]


def test_a_float_mask_is_additive_already():
    bias = torch.tensor([[0.0, -2.5]])
    assert additive_mask(bias, torch.float64) is bias
