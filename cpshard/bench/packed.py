"""Ring work on rows that pack documents (``cpshard bench --packed ROWS``): how evenly each sequence order
spreads the causal tiles over the ranks, counted and timed.

Counted: :func:`cpshard.bench.balance.ring_work` over ``rows`` packed rows (issue 18's: 131,072 tokens,
documents log-normal around 1K, sigma 1.2, cp=8, 128 x 128 tiles), the busiest rank's tiles over the mean
and all ranks' tiles over one process's. Timed: each rank's ring attention arithmetic (forward and
backward over every block it needs, as the ring runs it) alone, one thread, the ranks alternated in each
round so that a slow spell slows them alike: the busiest rank's CPU seconds and its ratio to the mean.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from cpshard.attention.blocks import ring_blocks
from cpshard.attention.ring import Block, Merged, Scoring, grouped, tiled_attention, tiled_grads
from cpshard.bench.balance import lognormal_documents, packed_mask, ring_work
from cpshard.spec.sequence import chunk_width, padded_length_for, positions

#: issue 18's packed rows: documents log-normal around 1K tokens (sigma 1.2)
DOCUMENTS = dict(median=1024, sigma=1.2)
ORDERS = ("contiguous", "head_tail", "striped")


@dataclass(frozen=True)
class AttentionShape:
    """The q/k/v sizes of the timed ring arithmetic (the attention benchmark's model)."""

    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 16


def _ring_compute(blocks, q, k, v, rank: int, cp: int, scale: float) -> None:
    """One rank's ring attention arithmetic, forward and backward, over every block it needs."""
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    needed = [source for source in range(cp) if blocks.needed[rank][source]]
    against = {source: Block(q, k, v, blocks.masks[source], Scoring(scale)) for source in needed}
    for source in needed:
        tiled_attention(out, lse, against[source], blocks.tiles[source])
    grad_q, grad_kv, merged = (
        torch.zeros_like(q),
        torch.zeros(2, *k.shape),
        Merged(lse, out, out, (out * out).sum(-1)),
    )
    for source in needed:
        tiled_grads(grad_q, grad_kv, against[source], merged, blocks.tiles[source])


def ring_compute_per_rank(
    seq: int, cp: int, order: str, repeats: int = 3, documents=None, shape: AttentionShape = AttentionShape()
) -> list[float]:
    """Each rank's ring attention compute (forward and backward, all its blocks), timed alone, the ranks
    alternated in each round; causal, or ``documents`` packed in the row (their lengths). CPU seconds of
    this process, per rank."""
    length = padded_length_for(seq, cp, order)
    held = [positions(order, length, cp, r) for r in range(cp)]
    mask = None if documents is None else packed_mask(documents, length)
    tile = chunk_width(order, length, cp)
    plans = [ring_blocks(mask, held, seq, rank, uniform_rows=False, tile=tile) for rank in range(cp)]
    q = grouped(torch.randn(1, shape.heads, length // cp, shape.head_dim), shape.kv_heads)
    k, v = torch.randn(2, 1, shape.kv_heads, length // cp, shape.head_dim)
    runs = [[] for _ in range(cp)]
    for _ in range(repeats):
        for rank in range(cp):
            start = time.process_time()
            _ring_compute(plans[rank], q, k, v, rank, cp, shape.head_dim**-0.5)
            runs[rank].append(time.process_time() - start)
    return [statistics.median(r) for r in runs]


def packed_report(
    seqs, cps, repeats: int, rows: int, out=print, counted_length: int = 131_072, counted_cp: int = 8
) -> dict:
    """Print both tables; return the measured ratios by order (``counted``: busiest / mean tiles, mean and
    worst row, tiles / one process; ``timed``: busiest rank's CPU s and busiest / mean, per (cp, L))."""
    out(
        f"tiles per rank on packed {counted_length:,}-token rows, cp={counted_cp}, 128 x 128 tiles "
        f"(mean and worst of {rows} rows):"
    )
    out("| order | busiest / mean, mean | worst | tiles / one process, mean | worst |")
    out("|---|---:|---:|---:|---:|")
    documents = [lognormal_documents(counted_length, seed=seed, **DOCUMENTS) for seed in range(rows)]
    result = {"counted": {}, "timed": {}}
    for order in ORDERS:
        work = [ring_work(order, row, counted_cp) for row in documents]
        busiest, extra = [w.busiest for w in work], [w.extra_tiles for w in work]
        result["counted"][order] = (statistics.mean(busiest), max(busiest), statistics.mean(extra))
        out(
            f"| {order} | {statistics.mean(busiest):.3f} | {max(busiest):.3f} "
            f"| {statistics.mean(extra):.3f} | {max(extra):.3f} |"
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of one thread: what a rank's share of the arithmetic costs
    out("\nring attention compute per rank alone on one packed row (forward + backward, CPU s):")
    out("| ranks | L | order | busiest rank s | busiest / mean | busiest / least | all ranks s |")
    out("|---|---|---|---:|---:|---:|---:|")
    try:
        for cp in cps:
            for seq in seqs:
                row = lognormal_documents(seq, seed=0, **DOCUMENTS)
                for order in ORDERS:
                    times = ring_compute_per_rank(seq, cp, order, repeats, documents=row)
                    balance = max(times) * cp / sum(times)
                    result["timed"][(cp, seq, order)] = (max(times), balance)
                    out(
                        f"| {cp} | {seq} | {order} | {max(times):.3f} | {balance:.2f} "
                        f"| {max(times) / min(times):.2f} | {sum(times):.3f} |"
                    )
    finally:
        torch.set_num_threads(threads)
    return result
