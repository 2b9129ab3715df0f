"""Aligned text columns: every debug view prints as one, so they read alike in a terminal."""

from __future__ import annotations


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


def grouped(n: int) -> str:
    """An integer with thousands separators: byte counts are read at a glance."""
    return f"{n:,}"
