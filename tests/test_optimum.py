"""The analytic optimum: q, k, v and output both ways per layer, gradients, the loss."""

import pytest

from cpshard.debug.optimum import optimum_for, optimum_of, ring_optimum_of, ulysses_optimum
from cpshard.tools.tiny import tiny_model


def test_optimum_counts_q_k_v_and_output_both_ways():
    optimum = ulysses_optimum(
        batch=2, length=10, cp=2, layers=3, heads=4, kv_heads=2, head_dim=8, param_bytes=1000
    )
    per_layer = 2 * 5 * 8 * 4 * (4 + 2 + 2 + 4)  # B * L/cp * head_dim * fp32 * (q + k + v + out heads)
    assert optimum.all_to_all == 2 * 3 * per_layer
    assert (optimum.all_reduce, optimum.total) == (1004, optimum.all_to_all + 1004)


def test_optimum_pads_and_replicates_kv():
    padded = ulysses_optimum(
        batch=1, length=7, cp=4, layers=1, heads=4, kv_heads=1, head_dim=1, param_bytes=0
    )
    assert padded.all_to_all == 2 * (8 // 4) * 4 * (4 + 4 + 4 + 4)  # L 7 -> 8; 1 kv head -> 4 copies
    assert (
        ulysses_optimum(
            batch=1, length=7, cp=1, layers=1, heads=4, kv_heads=1, head_dim=1, param_bytes=9
        ).total
        == 0
    )


@pytest.mark.parametrize(
    "implementation, order, cp, expected",
    [
        ("auto", "auto", 2, lambda m: optimum_of(m, 2, 64, 2)),
        ("ring", "auto", 2, lambda m: ring_optimum_of(m, 2, 64, 2, 1, "head_tail")),
        ("ring", "contiguous", 4, lambda m: ring_optimum_of(m, 2, 64, 4, 1, "contiguous")),
        ("hybrid", "auto", 4, lambda m: ring_optimum_of(m, 2, 64, 4, 2, "head_tail")),
    ],
)
def test_optimum_for_takes_the_implementation_and_order_make_cp_forward_would(
    implementation, order, cp, expected
):
    model = tiny_model("llama")
    assert optimum_for(model, 2, 64, cp, implementation, order) == expected(model)
