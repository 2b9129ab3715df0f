"""The analytic optimum: q, k, v and output both ways per layer, gradients, the loss."""

from cpshard.optimum import ulysses_optimum


def test_optimum_counts_q_k_v_and_output_both_ways():
    optimum = ulysses_optimum(batch=2, length=10, cp=2, layers=3, heads=4, kv_heads=2, head_dim=8, param_bytes=1000)
    per_layer = 2 * 5 * 8 * 4 * (4 + 2 + 2 + 4)  # B * L/cp * head_dim * fp32 * (q + k + v + out heads)
    assert optimum.all_to_all == 2 * 3 * per_layer
    assert (optimum.all_reduce, optimum.total) == (1004, optimum.all_to_all + 1004)


def test_optimum_pads_and_replicates_kv():
    padded = ulysses_optimum(batch=1, length=7, cp=4, layers=1, heads=4, kv_heads=1, head_dim=1, param_bytes=0)
    assert padded.all_to_all == 2 * (8 // 4) * 4 * (4 + 4 + 4 + 4)  # L 7 -> 8; 1 kv head -> 4 copies
    assert ulysses_optimum(batch=1, length=7, cp=1, layers=1, heads=4, kv_heads=1, head_dim=1, param_bytes=9).total == 0
