"""Ulysses attention: kv replication, padding keys, and its place in transformers' registries."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cpshard
from cpshard.attention import additive_mask, kv_replication, ulysses_name, without_padding_keys
from cpshard.tiny import tiny_batch, tiny_model


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


@pytest.mark.parametrize("fully_masked_row", [False, True])
def test_additive_mask_is_what_sdpa_computes_from_the_boolean_one(fully_masked_row):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=generator) for _ in range(3))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].clone()
    if fully_masked_row:
        mask[..., 3, :] = False
    ours = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, q.dtype))
    assert torch.equal(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def saved_mask_storages(implementation: str) -> tuple[int, int]:
    """Distinct storages among the sequence x sequence tensors autograd keeps, and the decoder layers."""
    model = tiny_model("llama", num_hidden_layers=3)
    batch = tiny_batch(model.config.vocab_size, 2, 15, pad="right")
    storages = set()

    def pack(tensor):
        if tensor.dim() == 4 and tensor.shape[-2:] == (16, 15):  # queries padded to 16 for cp=2, real keys 15
            storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    cp_forward = cpshard.make_cp_forward(model, implementation=implementation)
    params = {name: p.detach().requires_grad_(True) for name, p in cpshard.params_of(model).items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        cp_forward(params, batch, cpshard.make_mesh(cp=dist.get_world_size()))
    return len(storages), model.config.num_hidden_layers


def test_layers_keep_one_mask_between_them_not_one_each(ranks2):
    for storages, layers in ranks2.run(saved_mask_storages, "ulysses"):
        assert layers > 1 and storages == 1, f"{storages} masks kept for the backward by {layers} layers"
