"""Plain-text tables, as the commands print them (no torch: `deltalab presets` uses them)."""

from __future__ import annotations

__all__ = ["format_table"]


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """A plain-text table with right-aligned columns."""
    cells = [headers] + [[_format(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 else f"{value:.2e}"
    return str(value)
