"""Ring work on packed documents, counted: the tiles each rank computes under a sequence order.

A row packs documents (position_ids restart at each); a query sees the keys of its own document up
to itself. The ring computes a ``tile x tile`` tile of q against k only where some query may see
some key, so a rank's work is the count of such tiles among its queries against every key, and
the step waits for the busiest rank. Pure functions of document lengths, the rank count and the
tile size: how the orders of :mod:`cpshard.spec.sequence` compare, without running anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cpshard.spec.sequence import padded_length_for, positions


@dataclass(frozen=True)
class RingWork:
    """The tiles each rank computes under one order, and those one process computes alone."""

    per_rank: tuple[int, ...]
    one_process: int

    @property
    def busiest(self) -> float:
        """The busiest rank's tiles over the mean: what the step waits for, against perfect balance."""
        return max(self.per_rank) * len(self.per_rank) / sum(self.per_rank)

    @property
    def extra_tiles(self) -> float:
        """All ranks' tiles over one process's (padding and tiles that straddle chunks cost more)."""
        return sum(self.per_rank) / self.one_process


def document_ends(lengths: list[int], padded_length: int) -> torch.Tensor:
    """For every position, where its document ends (exclusive); cp's padding continues the last document,
    as :func:`cpshard.runtime.batch.continued_positions` does."""
    ends = torch.tensor(lengths).cumsum(0)
    ends[-1] = padded_length
    return ends[torch.searchsorted(ends, torch.arange(padded_length), right=True)]


def packed_mask(lengths: list[int], padded_length: int) -> torch.Tensor:
    """``[1, 1, L, L]`` booleans, the model's mask of the packed row: a query sees the keys of its own
    document up to itself."""
    ends = document_ends(lengths, padded_length)
    query, key = torch.arange(padded_length)[:, None], torch.arange(padded_length)[None, :]
    return ((key <= query) & (query < ends[None, :]))[None, None]


def needed_tiles(q_starts: torch.Tensor, k_starts: torch.Tensor, tile: int, ends: torch.Tensor):
    """``[Q, K]`` booleans: whether some query of tile ``[q, q + tile)`` may see some key of tile
    ``[k, k + tile)``. The key that sees furthest is the last one at or before the last query
    (documents end later the later they start): it is in the tile, and its document reaches the
    first query."""
    last = torch.minimum(k_starts[None, :], q_starts[:, None]) + tile - 1
    return (last >= k_starts[None, :]) & (ends[last] > q_starts[:, None])


def tile_starts(held: torch.Tensor, tile: int, order: str) -> torch.Tensor:
    """The first position of each ``tile``-token tile of a rank's positions (each must be one run)."""
    runs = held.view(-1, tile) if len(held) % tile == 0 else None
    if runs is None or not torch.equal(runs - runs[:, :1], torch.arange(tile).expand_as(runs)):
        raise ValueError(
            f"a tile of {tile} tokens spans two chunks of the {order} order here; count with a tile that "
            "divides its chunks (cpshard.spec.sequence.chunk_width)"
        )
    return runs[:, 0]


def ring_work(order: str, lengths: list[int], size: int, tile: int = 128) -> RingWork:
    """The tiles each of ``size`` ranks computes over one row packing documents of ``lengths`` tokens,
    held in ``order`` (padded as cp pads it), and the tiles one process computes over the same row."""
    length = sum(lengths)
    padded = padded_length_for(length, size, order)
    ends = document_ends(lengths, padded)
    starts = [tile_starts(positions(order, padded, size, rank), tile, order) for rank in range(size)]
    every = torch.cat(starts)
    per_rank = tuple(int(needed_tiles(mine, every, tile, ends).sum()) for mine in starts)
    alone = -(-length // tile) * tile
    whole = torch.arange(0, alone, tile)
    one_process = int(needed_tiles(whole, whole, tile, document_ends(lengths, alone)).sum())
    return RingWork(per_rank, one_process)


def lognormal_documents(length: int, median: int, sigma: float, seed: int) -> list[int]:
    """Document lengths of one packed row of ``length`` tokens: log-normal around ``median`` (at least one
    token each), the last one cut where the row ends."""
    generator = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < length:
        draw = math.exp(math.log(median) + sigma * float(torch.randn((), generator=generator)))
        size = min(max(1, round(draw)), length - total)
        lengths.append(size)
        total += size
    return lengths
