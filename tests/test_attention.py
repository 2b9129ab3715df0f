"""Ulysses attention: kv replication, padding keys, and its place in transformers' registries."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import cpshard
from cpshard.attention import ulysses
from cpshard.attention.cp_attention import cp_attention_name
from cpshard.attention.ulysses import kv_replication, without_padding_keys
from cpshard.spec.masks import additive_mask
from cpshard.tools.parity import check_parity
from cpshard.tools.tiny import tiny_batch, tiny_model


@pytest.mark.parametrize(
    "heads,kv_heads,cp,replicas",
    [
        (4, 4, 2, 1),
        (4, 2, 2, 1),
        (4, 1, 2, 2),
        (4, 2, 4, 2),
        (4, 1, 4, 4),
        (8, 2, 4, 2),
        (6, 3, 2, 2),
        (6, 2, 3, 3),
    ],
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
    with pytest.raises(
        ValueError, match=r"num_attention_heads=6 is not divisible by cp=4; cp sizes that work: 1, 2, 3, 6"
    ):
        kv_replication(6, 2, 4)


def test_without_padding_keys_keeps_the_real_sequence():
    key, value = torch.randn(2, 3, 8, 4), torch.randn(2, 3, 8, 4)
    mask = torch.randn(2, 1, 8, 8)
    k, v, m = without_padding_keys(key, value, mask, 5)
    assert (
        torch.equal(k, key[:, :, :5])
        and torch.equal(v, value[:, :, :5])
        and torch.equal(m, mask[:, :, :, :5])
    )


@pytest.mark.parametrize("inner", ["sdpa", "eager"])
def test_registered_for_attention_and_for_masks(inner):
    name = cp_attention_name(inner)
    assert name == f"cpshard_{inner}" and cp_attention_name(name) == name
    assert name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is ALL_MASK_ATTENTION_FUNCTIONS[inner]


def test_an_implementation_without_a_mask_function_is_refused():
    with pytest.raises(ValueError, match="not in transformers' registry"):
        cp_attention_name("no_such_attention")


@pytest.mark.parametrize("fully_masked_row", [False, True])
def test_additive_mask_is_what_sdpa_computes_from_the_boolean_one(fully_masked_row):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 8, generator=generator) for _ in range(3))
    mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None].clone()
    if fully_masked_row:
        mask[..., 3, :] = False
    ours = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(mask, q.dtype))
    assert torch.equal(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def saved_masks(block_bytes: int) -> dict:
    """Under Ulysses with right padding: parity, and the float sequence x sequence tensors that autograd
    keeps (distinct storages), with sdpa's float mask built whole (shared) or per block of queries."""
    ulysses.MASK_BLOCK_BYTES, before = block_bytes, ulysses.MASK_BLOCK_BYTES
    try:
        model = tiny_model("llama", num_hidden_layers=3)
        batch = tiny_batch(model.config.vocab_size, 2, 15, pad="right")
        mesh, cp_forward = cpshard.make_mesh(cp=dist.get_world_size()), cpshard.make_cp_forward(model)
        storages = set()

        def pack(tensor):
            if (
                tensor.is_floating_point() and tensor.dim() == 4 and tensor.shape[-2:] == (16, 15)
            ):  # 16 padded queries
                storages.add(tensor.untyped_storage().data_ptr())
            return tensor

        params = {name: p.detach().requires_grad_(True) for name, p in cpshard.params_of(model).items()}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            cp_forward(params, batch, mesh)
        parity = check_parity(model, batch, mesh, cp_forward)
        return dict(storages=len(storages), layers=model.config.num_hidden_layers, worst=parity.worst)
    finally:
        ulysses.MASK_BLOCK_BYTES = before


@pytest.mark.parametrize("block_bytes, kept", [(1 << 26, 1), (2 * 3 * 15 * 4, 0)], ids=["shared", "blocked"])
def test_layers_keep_one_float_mask_between_them_or_none(ranks2, block_bytes, kept):
    """Small masks: one float copy serves every layer. Above MASK_BLOCK_BYTES (here: 3 rows of 15 keys a
    block of the 2 rows of the batch), the float rows exist one block at a time and none is kept; parity
    is exact either way."""
    for result in ranks2.run(saved_masks, block_bytes):
        assert result["layers"] > 1 and result["storages"] == kept, result
        assert result["worst"] <= 1e-5, result


def bidirectional(implementation: str) -> str:
    """A BERT that is not a decoder attends both ways: Ulysses serves it exactly, ring refuses it."""
    mesh = cpshard.make_mesh(cp=2)
    model = tiny_model("bert", is_decoder=False)
    batch = tiny_batch(model.config.vocab_size, 2, 9)
    cp_forward = cpshard.make_cp_forward(model, implementation=implementation)
    try:
        parity = check_parity(model, batch, mesh, cp_forward)
    except ValueError as error:  # the probe's cp run raises cpshard's refusal as it is
        return str(error)
    return f"worst {parity.worst}"


def test_attention_both_ways_is_exact_under_ulysses_and_refused_by_ring(ranks2):
    for said in ranks2.run(bidirectional, "ulysses"):
        assert float(said.split()[-1]) <= 1e-5, said
    for said in ranks2.run(bidirectional, "ring"):
        assert "attends in both directions" in said and "implementation='ulysses'" in said, said
