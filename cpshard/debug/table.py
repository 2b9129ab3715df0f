"""Aligned text columns: every debug view prints as one, so they read alike in a terminal."""

from __future__ import annotations

from collections.abc import Callable


def table(rows: list[tuple], header: tuple | None = None, right: frozenset[int] = frozenset()) -> str:
    """``rows`` as aligned columns (two spaces apart); columns in ``right`` align right, as numbers do."""
    cells = [tuple(str(cell) for cell in row) for row in ([header] if header else []) + list(rows)]
    if not cells:
        return ""
    widths = [max(len(row[i]) for row in cells if i < len(row)) for i in range(max(map(len, cells)))]
    lines = []
    for row in cells:
        padded = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)
        ]
        lines.append("  ".join(padded).rstrip())
    if header:
        lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def table_of(items: list, columns: tuple[tuple[str, Callable], ...], text: frozenset[str]) -> str:
    """``items`` under ``columns``, each a header beside the cell it gives an item (so neither can drift from
    the other); the ``text`` columns align left, the others right, as numbers do."""
    header = tuple(name for name, _ in columns)
    rows = [tuple(cell(item) for _, cell in columns) for item in items]
    return table(rows, header, right=frozenset(i for i, name in enumerate(header) if name not in text))


def grouped(n: int) -> str:
    """An integer with thousands separators: byte counts are read at a glance."""
    return f"{n:,}"
