"""Ring blocks from the model's own whole-sequence mask: who may attend to whom, per block.

The model builds its mask for the whole sequence (causal, padding, packed documents, sliding
windows, per layer); a block is that mask at the block's q and k positions, so every block is
exact. ``None`` is transformers' way of saying plain causal.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpshard.comm.redistribute import axis_size
from cpshard.spec.sequence import chunk_width, group_positions


def allowed(mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """``[B or 1, 1, Sq, Sk]`` booleans: True where q may attend to k."""
    if mask is None:
        return (q_pos[:, None] >= k_pos[None, :])[None, None]
    block = mask.index_select(-2, q_pos.to(mask.device)).index_select(-1, k_pos.to(mask.device))
    if block.dtype == torch.bool:
        return block
    hidden = torch.finfo(block.dtype).min
    if not ((block == 0) | (block == hidden)).all():
        raise ValueError(
            "ring attention needs a mask of allowed / hidden positions (booleans, or 0 and the dtype's "
            "minimum as transformers builds them); this mask carries other additive values, which only "
            "implementation='ulysses' can honour"
        )
    return block == 0


def rows_without_keys(mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """``[B or 1, 1, L]``: the rows that may attend to no real key at all (left padding), or None."""
    if mask is None:
        return None
    real = allowed(mask, torch.arange(mask.shape[-2]), torch.arange(length))
    return ~real.any(-1)


def tiles(allowed: torch.Tensor, tile: int) -> list[tuple[slice, slice]]:
    """The ``(q, k)`` tile slices of a block in which some q may attend to some k, row by row: only those
    are computed. A tile is one chunk of the sequence order, so under head-tail a causal block's hidden
    quarters are skipped, and under the striped order exactly the tiles one process would need are
    computed."""
    rows, cols = allowed.shape[-2:]
    across = allowed.reshape(-1, rows, cols).any(0)  # any row of the batch, any head
    whole = across.new_zeros(-(-rows // tile) * tile, -(-cols // tile) * tile)
    whole[:rows, :cols] = across
    hit = whole.reshape(whole.shape[0] // tile, tile, whole.shape[1] // tile, tile).any(3).any(1)
    return [
        (slice(q * tile, (q + 1) * tile), slice(k * tile, (k + 1) * tile)) for q, k in hit.nonzero().tolist()
    ]


@dataclass(frozen=True)
class RingBlocks:
    """The masks of this rank's q against each ring peer's k, and which blocks anyone needs."""

    masks: list[torch.Tensor]
    needed: list[list[bool]]
    skipped: int
    #: ``[B or 1, 1, Sq]``: this rank's rows that attend evenly to every real key (scores forced to 0)
    uniform: torch.Tensor | None
    #: per peer, the tiles of this rank's block against it that some query may see (one chunk of the
    #: sequence order wide): only those are computed
    tiles: list[list[tuple[slice, slice]]]


def ring_blocks(
    mask, q_positions: list[torch.Tensor], length: int, rank: int, uniform_rows: bool, tile: int
) -> RingBlocks:
    """Blocks for ring peers holding ``q_positions[j]`` (q and k positions coincide per peer).

    ``uniform_rows``: rows with no real key attend evenly to every real key (what eager
    attention gives them); otherwise they see nothing and come out as zeros (what sdpa gives).
    """
    empty = rows_without_keys(mask, length) if uniform_rows else None

    def block(q_pos, k_pos):
        ok = allowed(mask, q_pos, k_pos)
        if empty is not None:
            q_pos, k_pos = q_pos.to(empty.device), k_pos.to(empty.device)
            rows = empty.index_select(-1, q_pos)[..., None]
            ok = torch.where(rows, (k_pos < length)[None, None, None, :], ok)
        return ok

    size = len(q_positions)
    needed = [[bool(block(q_positions[a], q_positions[b]).any()) for b in range(size)] for a in range(size)]
    masks = [block(q_positions[rank], q_positions[b]) for b in range(size)]
    uniform = None if empty is None else empty.index_select(-1, q_positions[rank].to(empty.device))
    needed_tiles = [tiles(m, tile) if need else [] for m, need in zip(masks, needed[rank])]
    return RingBlocks(masks, needed, sum(not flag for row in needed for flag in row), uniform, needed_tiles)


def call_blocks(call, mask, uniform_rows: bool) -> RingBlocks:
    """The ring blocks of this rank in ``call`` (a :class:`cpshard.call.CallPlan` running ring or hybrid),
    derived once per call and mask."""
    mesh, degree = call.split_mesh, call.ulysses
    held = [
        group_positions(call.order, call.padded_length, call.cp_size, range(g * degree, (g + 1) * degree))
        for g in range(axis_size(mesh, "cp_ring"))
    ]
    tile = chunk_width(call.order, call.padded_length, call.cp_size)
    rank = mesh.get_local_rank("cp_ring")
    make = lambda: ring_blocks(mask, held, call.length, rank, uniform_rows, tile)  # noqa: E731
    return call.shared(("ring blocks", id(mask), uniform_rows), make)
