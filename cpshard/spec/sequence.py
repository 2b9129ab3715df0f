"""Sequence orders: which token positions each cp rank holds.

``contiguous``: rank r holds chunk r of P. ``head_tail``: the sequence is cut into 2P chunks and
rank r holds chunks r and 2P-1-r, so that under a causal mask every rank has the same work
(the early chunk sees few keys, the late one many). ``striped``: the sequence is cut into stripes
of at most :data:`STRIPE` tokens dealt round-robin (rank r holds stripes r, r+P, r+2P, ...): with
packed documents, whose causal work head-tail cannot see, every document's tiles spread over the
ranks, and a stripe is one ring tile, so the ring computes exactly the tiles one process would.
Pure functions of sizes and ranks.

Three words, used one way throughout cpshard: a **chunk** is one of the equal pieces of the sequence
that an order hands out; a **block** is a piece of work cut to a memory budget (:func:`row_blocks`:
rows of the loss, queries of Ulysses' sdpa; in ring attention, one q chunk against one k chunk); a
**tile** is the unit inside a ring block that a mask can skip whole.
"""

from __future__ import annotations

import torch

ORDERS = ("contiguous", "head_tail", "striped")
#: the striped order's widest stripe, in tokens (one ring tile; the analytic balance is measured at 128)
STRIPE = 128
#: the striped order's fewest stripes per rank, so that short sequences interleave too
MIN_STRIPES = 4


def check_order(order: str) -> None:
    """Raise a ValueError naming the orders when ``order`` is not one of them."""
    if order not in ORDERS:
        raise ValueError(f"unknown sequence order {order!r}; choose one of {', '.join(ORDERS)}")


def chunks_per_rank(order: str, length: int, size: int) -> int:
    """How many equal chunks each rank holds of a ``length``-token sequence (the padded length must divide
    into ``size`` times this; :func:`padded_length_for` gives one that does, and the same count)."""
    check_order(order)
    if order == "striped":  # stripes of at most STRIPE tokens, at least MIN_STRIPES a rank
        return max(MIN_STRIPES, -(-length // (size * STRIPE)))
    return 2 if order == "head_tail" else 1


def chunk_width(order: str, length: int, size: int) -> int:
    """The tokens of one chunk: the ring's tile, so that a tile never mixes two chunks."""
    return length // (size * chunks_per_rank(order, length, size))


def positions(order: str, length: int, size: int, rank: int) -> torch.Tensor:
    """The global token positions rank ``rank`` of ``size`` holds, in its local order."""
    pieces = size * chunks_per_rank(order, length, size)
    if length % pieces:
        raise ValueError(f"a {order} sequence of {length} tokens does not split into {pieces} equal chunks")
    chunk = length // pieces
    starts = {
        "contiguous": [rank],
        "head_tail": [rank, pieces - 1 - rank],
        "striped": list(range(rank, pieces, size)),
    }[order]
    return (torch.tensor(starts)[:, None] * chunk + torch.arange(chunk)).reshape(-1)


def group_positions(order: str, length: int, size: int, ranks) -> torch.Tensor:
    """The positions a group of ranks holds together, concatenated in the order of ``ranks``."""
    return torch.cat([positions(order, length, size, r) for r in ranks])


def exchange_plan(src: list[torch.Tensor], dst: list[torch.Tensor], rank: int):
    """How to go from holding ``src[rank]`` to holding ``dst[rank]``: for every peer, which of
    my local indices I send it (in its order), and the local positions where what each peer
    sends me lands. One all-to-all with uneven splits."""
    where_src = {int(p): (r, i) for r, held in enumerate(src) for i, p in enumerate(held.tolist())}
    send = []
    for _peer, wanted in enumerate(dst):
        send.append(
            torch.tensor(
                [where_src[p][1] for p in wanted.tolist() if where_src[p][0] == rank], dtype=torch.long
            )
        )
    receive = []
    mine = dst[rank].tolist()
    for peer in range(len(src)):
        receive.append(
            torch.tensor([i for i, p in enumerate(mine) if where_src[p][0] == peer], dtype=torch.long)
        )
    return send, receive


def chunk_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """The real positions rank ``rank`` holds as DTensor's ``Shard`` chunks them: ceil(L / P) each,
    the last ranks fewer or none. Logits and the loss come out in this layout."""
    width = -(-length // size)
    return torch.arange(min(rank * width, length), min((rank + 1) * width, length))


def padded_length_for(length: int, size: int, order: str = "contiguous") -> int:
    """The smallest length >= ``length`` that splits into equal chunks for ``order`` over ``size`` ranks
    (striped: as many stripes as ``length`` needs, each as narrow as they allow)."""
    pieces = size * chunks_per_rank(order, length, size)
    return -(-length // pieces) * pieces


def row_blocks(rows: int, width: int, budget: int) -> list[slice]:
    """Slices of ``rows`` rows of ``width`` each (values, bytes), each within about ``budget`` (at
    least a row): how the work done a block of tokens or queries at a time is cut."""
    step = max(1, budget // max(1, width))
    return [slice(start, start + step) for start in range(0, rows, step)]
