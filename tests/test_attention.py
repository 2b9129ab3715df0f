"""Ulysses attention: kv replication, padding keys, and its place in transformers' registries."""

import pytest
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from cpshard.attention import kv_replication, ulysses_name, without_padding_keys


@pytest.mark.parametrize(
    "heads,kv_heads,cp,replicas",
    [(4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (4, 2, 4, 2), (4, 1, 4, 4), (8, 2, 4, 2), (6, 3, 2, 2), (6, 2, 3, 3)],
)
def test_kv_replication_lets_every_rank_find_its_kv_heads(heads, kv_heads, cp, replicas):
    assert kv_replication(heads, kv_heads, cp) == replicas
    replicated = kv_heads * replicas
    assert replicated % cp == 0
    per_rank_q, per_rank_kv = heads // cp, replicated // cp
    for rank in range(cp):
        for local_q in range(per_rank_q):
            global_q = rank * per_rank_q + local_q
            # the kv head this q head uses on one process, and the one the rank holds for it
            wanted = global_q // (heads // kv_heads)
            held = (rank * per_rank_kv + local_q // (per_rank_q // per_rank_kv)) // replicas
            assert held == wanted


def test_kv_replication_names_the_cp_sizes_that_work():
    with pytest.raises(ValueError, match=r"num_attention_heads=6 is not divisible by cp=4; cp sizes that work: 1, 2, 3, 6"):
        kv_replication(6, 2, 4)


def test_without_padding_keys_keeps_the_real_sequence():
    key, value = torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 4)
    mask = torch.randn(2, 1, 8, 8)
    k, v, m = without_padding_keys(key, value, mask, 5)
    assert torch.equal(k, key[:, :, :5]) and torch.equal(v, value[:, :, :5]) and torch.equal(m, mask[:, :, :, :5])


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
def test_registered_for_attention_and_for_masks(inner):
    name = ulysses_name(inner)
    assert name == f"cpshard_{inner}" and ulysses_name(name) == name
    assert name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is ALL_MASK_ATTENTION_FUNCTIONS[inner]


def test_an_implementation_without_a_mask_function_is_refused():
    with pytest.raises(ValueError, match="not in transformers' registry"):
        ulysses_name("no_such_attention")
