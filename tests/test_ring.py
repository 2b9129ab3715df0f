"""Ring attention: the block math against one softmax, the schedule, and skipped transfers on real ranks."""

import pytest
import torch

import cpshard
from cpshard.attention.blocks import ring_blocks
from cpshard.attention.ring import Block, Merged, Scoring, block_attention, block_grads, grouped, hops, merge
from cpshard.comm.record import recording
from cpshard.spec.sequence import chunk_width, positions
from cpshard.tools.tiny import tiny_batch, tiny_model


def whole_row_attention(q, k, v, allowed, scale, softcap=None):
    """Plain attention over all keys at once, rows that see nothing give 0 (sdpa's answer)."""
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)
    return torch.einsum("bhgqk,bhkd->bhgqd", probs, v)


def random_problem(dtype, generator):
    q = torch.randn(2, 4, 6, 8, generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, 10, 8, generator=generator).to(dtype) for _ in range(2))
    allowed = torch.rand(2, 1, 6, 10, generator=generator) > 0.4
    allowed[0, 0, 1] = False  # a row that sees no key at all
    allowed[1, 0, 2, :5] = False  # a row that sees nothing in the first block only
    return q, k, v, allowed


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_merged_blocks_equal_one_softmax_over_the_row(dtype, tolerance, softcap):
    q, k, v, allowed = random_problem(dtype, torch.Generator().manual_seed(0))
    qg = grouped(q.float(), k.shape[1])
    whole = Block(qg, k, v, allowed, Scoring(0.3, softcap))
    first = block_attention(whole.tile(slice(None), slice(0, 5)))
    second = block_attention(whole.tile(slice(None), slice(5, None)))
    out, lse = merge(*first, *second)
    expected = whole_row_attention(qg, k.float(), v.float(), allowed, 0.3, softcap)
    assert not out.isnan().any() and torch.isinf(lse[0, :, :, 1]).all()
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_block_gradients_equal_autograd_of_one_softmax(softcap):
    q, k, v, allowed = random_problem(torch.float64, torch.Generator().manual_seed(1))
    q, k, v = (x.float().requires_grad_() for x in (q, k, v))
    qg = grouped(q, k.shape[1])
    expected = whole_row_attention(qg, k, v, allowed, 0.3, softcap)
    grad_out = torch.randn_like(expected)
    want_q, want_k, want_v = torch.autograd.grad(expected, (q, k, v), grad_out)
    with torch.no_grad():
        whole, everything = Block(qg, k, v, allowed, Scoring(0.3, softcap)), slice(None)
        blocks = [whole.tile(everything, cols) for cols in (slice(0, 5), slice(5, 10))]
        out, lse = merge(*block_attention(blocks[0]), *block_attention(blocks[1]))
        merged = Merged(lse, out, grad_out, (grad_out * out).sum(-1))
        grads = [block_grads(block, merged) for block in blocks]
    torch.testing.assert_close(sum(g[0] for g in grads).reshape(q.shape), want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g[1] for g in grads], 2), want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g[2] for g in grads], 2), want_v, atol=1e-5, rtol=1e-5)


def test_blocks_travel_only_as_far_as_someone_needs_them():
    causal = [[kv <= q for kv in range(4)] for q in range(4)]
    assert [hops(causal, source) for source in range(4)] == [3, 2, 1, 0]
    window = [[q - 1 <= kv <= q for kv in range(4)] for q in range(4)]
    assert [hops(window, source) for source in range(4)] == [1, 1, 1, 0]
    everyone = [[True] * 4 for _ in range(4)]
    assert [hops(everyone, source) for source in range(4)] == [3, 3, 3, 3]


def run_sliding_window_ring(order: str):
    """A window much smaller than L/cp: each rank needs only its own block and its left neighbour's."""
    model = tiny_model("mistral", sliding_window=2, num_hidden_layers=1)
    batch = tiny_batch(model.config.vocab_size, 1, 32)
    cp_forward = cpshard.make_cp_forward(model, implementation="ring", sequence_order=order)
    with recording() as log:
        output, _ = cpshard.value_and_grad(cp_forward)(
            cpshard.params_of(model), batch, cpshard.make_mesh(cp=4)
        )
    sends = [e for e in log.events if e.op == "send"]
    return {
        phase: sum(e.nbytes for e in sends if e.phase == phase) for phase in ("forward", "backward")
    }, output.loss.item()


def test_hidden_blocks_are_neither_computed_nor_sent(ranks4):
    """Sliding window 2, L=32 over 4 ranks, contiguous: blocks j travel 1 hop (j < 3) or none (j = 3)."""
    results = ranks4.run(run_sliding_window_ring, "contiguous")
    kv_block = 2 * 1 * 2 * 8 * 16 * 4  # k and v, B=1, 2 kv heads, 8 tokens, head_dim 16, fp32
    hops_of = [1, 1, 1, 0]  # rank r sends its own block once, if anyone after it needs it
    for rank, (sent, _) in enumerate(results):
        assert sent["forward"] == hops_of[rank] * kv_block
        # backward: k, v travel again with dk, dv (fp32, the same size); dk, dv then go home from the
        # last visitor
        assert sent["backward"] == (2 * hops_of[rank] + _home(rank, hops_of)) * kv_block


def _home(rank: int, hops_of: list[int]) -> int:
    """dk, dv blocks this rank sends home: those whose travel ends here, coming from another rank."""
    return sum(
        1
        for source in range(4)
        if source != rank and hops_of[source] and (source + hops_of[source]) % 4 == rank
    )


def computed_tiles(order: str, size: int = 4, length: int = 64) -> list[int]:
    """Tiles each rank computes for a causal mask (the work that decides the step time)."""
    held = [positions(order, length, size, r) for r in range(size)]
    tile = chunk_width(order, length, size)
    work = []
    for rank in range(size):
        blocks = ring_blocks(None, held, length, rank, uniform_rows=False, tile=tile)
        work.append(sum(len(needed) * tile * tile for needed in blocks.tiles))
    return work


def test_head_tail_balances_causal_work():
    assert computed_tiles("contiguous") == [256, 512, 768, 1024]  # rank r computes r + 1 blocks of 16 x 16
    balanced = computed_tiles("head_tail")
    assert len(set(balanced)) == 1 and balanced[0] < 1024  # equal, and less than contiguous's busiest rank
