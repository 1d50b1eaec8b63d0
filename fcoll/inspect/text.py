"""Aligned plain-text tables and human-readable units, shared by the inspection tables."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["text_table", "fmt_bytes", "fmt_us"]


def fmt_bytes(n: int | None) -> str:
    """``512 B``, ``4.0 KiB``, ``1.5 MiB``, ``2.0 GiB`` (binary units, 2**10)."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def fmt_us(x: float | None) -> str:
    """Microseconds with one decimal, ``-`` when unknown."""
    return "-" if x is None else f"{x:.1f}"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               right: Sequence[bool] | None = None) -> str:
    """Columns padded to their widest cell, separated by two spaces; a dashed rule under the
    header. ``right[i]`` right-aligns column ``i`` (numbers). No trailing spaces."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    right = right if right is not None else [False] * len(headers)

    def line(r: list[str]) -> str:
        parts = [c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(r, widths, right)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])
