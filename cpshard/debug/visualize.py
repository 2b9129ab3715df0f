"""``visualize``: which rank holds which block of a DTensor, drawn as a grid of boxes.

Like ``jax.debug.visualize_array_sharding``: a 1-D tensor is one row of boxes, a 2-D tensor a grid
(rows: dim 0, columns: dim 1); a 3-D tensor shows its two most-split dims, one grid per block of
the third when that one is split too. Each box is labelled with the global ranks that hold it and
headed by its index range; replicated (and Partial) blocks name every rank that holds them.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from cpshard.debug.typeof import tensor_type

Interval = tuple[int, int]


def blocks(x: torch.Tensor) -> dict[int, tuple[Interval, ...]]:
    """Global rank -> the ``(start, stop)`` it holds along each dim (DTensor's own chunking)."""
    if not isinstance(x, DTensor):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return {rank: tuple((0, n) for n in x.shape)}
    if any(type(p).__name__ == "_StridedShard" for p in x.placements):
        raise ValueError(
            f"visualize: {tensor_type(x)} has strided shards, whose blocks interleave; no grid draws them"
        )
    ranks = x.device_mesh.mesh
    result = {}
    for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
        shape, offset = _compute_local_shape_and_global_offset(
            x.shape, tuple(ranks.shape), list(coordinate), x.placements
        )
        result[int(ranks[coordinate])] = tuple((start, start + size) for start, size in zip(offset, shape))
    return result


def _cuts(held: list[tuple[Interval, ...]], dim: int, size: int) -> list[Interval]:
    """The finest intervals of ``dim`` that every block's edges fall on."""
    edges = sorted({0, size, *(edge for block in held for edge in block[dim])})
    return list(zip(edges, edges[1:]))


def _ranks_label(ranks: list[int]) -> str:
    """``0,1`` or ``0-7``: runs of three or more consecutive ranks are shortened."""
    runs: list[list[int]] = []
    for rank in sorted(ranks):
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ",".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs) or "-"


def _holders(owned: dict[int, tuple[Interval, ...]], cell: dict[int, Interval]) -> str:
    """The ranks whose block covers ``cell`` (dim -> interval)."""
    inside = [
        r
        for r, block in owned.items()
        if all(block[d][0] <= a <= b <= block[d][1] for d, (a, b) in cell.items())
    ]
    return _ranks_label(inside)


def _grid(rows: list[Interval] | None, cols: list[Interval], cell_of) -> list[str]:
    """Boxes for ``rows x cols`` (one row when ``rows`` is None), each labelled by ``cell_of(row, col)``."""
    row_heads = [f"{a}:{b}" for a, b in rows] if rows else [""]
    labels = [[cell_of(row, col) for col in cols] for row in (rows or [None])]
    col_heads = [f"{a}:{b}" for a, b in cols]
    widths = [max(len(col_heads[j]), *(len(line[j]) for line in labels)) + 4 for j in range(len(cols))]
    margin = max(map(len, row_heads)) + (1 if rows else 0)

    def rule(left: str, middle: str, right: str) -> str:
        return " " * margin + left + middle.join("─" * w for w in widths) + right

    lines = [" " * margin + " " + " ".join(h.center(w) for h, w in zip(col_heads, widths))]
    lines.append(rule("┌", "┬", "┐"))
    for index, (head, line) in enumerate(zip(row_heads, labels)):
        if index:
            lines.append(rule("├", "┼", "┤"))
        boxes = "│".join(text.center(width) for text, width in zip(line, widths))
        lines.append(f"{head.rjust(margin - 1)}{' ' if rows else ''}│{boxes}│")
    lines.append(rule("└", "┴", "┘"))
    return lines


def _shown_dims(cuts: list[list[Interval]]) -> tuple[int, ...]:
    """The dims drawn as rows and columns: all of them up to 2-D, else the two most split."""
    if len(cuts) <= 2:
        return tuple(range(len(cuts)))
    most = sorted(range(len(cuts)), key=lambda d: -len(cuts[d]))[:2]
    return tuple(sorted(most))


def picture(x: torch.Tensor) -> str:
    """The text :func:`visualize` prints."""
    if not 1 <= x.dim() <= 3:
        raise ValueError(f"visualize draws 1-D to 3-D tensors; {tensor_type(x)} has {x.dim()} dims")
    every = blocks(x)
    owned = {r: block for r, block in every.items() if all(b > a for a, b in block)}
    cuts = [_cuts(list(owned.values()), d, n) for d, n in enumerate(x.shape)]
    shown = _shown_dims(cuts)
    pages = [d for d in range(x.dim()) if d not in shown]
    lines = [tensor_type(x)]
    names = " x ".join(f"dim {d}" for d in shown)
    lines.append(
        f"{'columns' if len(shown) == 1 else 'rows x columns'}: {names}; each box names the ranks holding it"
    )
    for page in itertools.product(*(cuts[d] for d in pages)):
        fixed = dict(zip(pages, page))
        if pages:
            whole = len(cuts[pages[0]]) == 1
            ((d, (a, b)),) = fixed.items()
            lines.append(f"dim {d} is whole ({b}) in every block" if whole else f"dim {d} = {a}:{b}")
        rows, cols = (None, cuts[shown[0]]) if len(shown) == 1 else (cuts[shown[0]], cuts[shown[1]])

        def cell_of(row, col, fixed=fixed):
            cell = {**fixed, shown[-1]: col}
            if row is not None:
                cell[shown[0]] = row
            return _holders(owned, cell)

        lines.extend(_grid(rows, cols, cell_of))
    empty = sorted(set(every) - set(owned))
    if empty:
        lines.append(f"ranks holding no elements: {_ranks_label(empty)}")
    return "\n".join(line.rstrip() for line in lines)


def visualize(x: torch.Tensor, *, show: bool = True) -> str:
    """Print (unless ``show=False``) and return the picture of which rank holds which block of ``x``.

    Every rank computes the same picture; each prints it, so gate on the rank where that is noise.
    """
    text = picture(x)
    if show:
        print(text)
    return text
