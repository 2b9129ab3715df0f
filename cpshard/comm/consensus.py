"""Checks that every rank decides alike: rows of the same length gathered from every rank, so that each
rank sees what the others hold and all of them raise, or none does (a rank that raised alone would leave
the others waiting in its next collective until the process group's timeout).

Not differentiable and off the hot path: each runs once per call at most, before the call's collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cpshard.comm.collectives import all_gather_rows


def gather_checked(
    row: torch.Tensor, group, name: str, failed: Exception | None, mark
) -> tuple[torch.Tensor, list[int]]:
    """Every rank's ``row`` (one dimension) stacked and the global ranks whose own checks failed.
    A rank that failed (``failed``: what it raised) sends ``mark`` as its row's first entry, a value no
    passing rank sends, and raises ``failed`` once the rows are gathered: every rank learns of it in the same
    collective, and the others name it (the rows stay of one length whatever each rank holds)."""
    if failed is not None:
        row = row.clone()
        row[0] = mark
    every = all_gather_rows(row, group, name=name)
    if failed is not None:
        raise failed
    ranks = dist.get_process_group_ranks(group)
    return every, [rank for rank, value in zip(ranks, every[:, 0].tolist()) if value == mark]


def differing_ranks(rows: torch.Tensor, ranks: list[int]) -> list[int]:
    """The ranks whose row is not bit for bit the first one's (so that a NaN equals itself)."""
    every = rows.view(torch.int64)
    return [ranks[i] for i in range(every.shape[0]) if not torch.equal(every[i], every[0])]


#: the bytes of each rank's text that :func:`gather_texts` carries
TEXT_BYTES = 4096


def gather_texts(text: str, group, name: str) -> list[str]:
    """Every rank's ``text`` (its first :data:`TEXT_BYTES` bytes), in group order: one all-gather of a row of
    fixed length (two bytes of length, then the text's), so that each rank may hold a text of its own
    length. For messages that name what the other ranks hold, once the ranks know they differ."""
    data = text.encode()[:TEXT_BYTES]
    row = torch.tensor(
        [len(data) >> 8, len(data) & 255, *data, *[0] * (TEXT_BYTES - len(data))], dtype=torch.uint8
    )
    every = all_gather_rows(row, group, name=name).tolist()
    return [bytes(r[2 : 2 + (r[0] << 8 | r[1])]).decode(errors="ignore") for r in every]


def items_text(items: dict) -> str:
    """``items`` as a text of one ``name=repr(value)`` line each, which :func:`what_differs` compares."""
    return "\n".join(f"{name}={value!r}" for name, value in items.items())


def what_differs(texts: list[str], ranks: list[int], other: int) -> str:
    """``"rank 0: a=1; rank 3: a=2"``: the items (:func:`items_text`'s lines) in which rank ``other``'s text
    differs from the first rank's, each rank's own (an item one of them lacks: ``<absent>``); ``texts`` in
    the order of ``ranks``."""
    first, theirs = (
        dict(line.partition("=")[::2] for line in text.split("\n"))
        for text in (texts[0], texts[ranks.index(other)])
    )
    names = [name for name in {**first, **theirs} if first.get(name) != theirs.get(name)]
    if not names:
        return f"rank {ranks[0]} and rank {other} differ beyond the first {TEXT_BYTES} bytes of their texts"
    said = [", ".join(f"{name}={items.get(name, '<absent>')}" for name in names) for items in (first, theirs)]
    return f"rank {ranks[0]}: {said[0]}; rank {other}: {said[1]}"
