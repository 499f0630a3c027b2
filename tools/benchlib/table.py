"""Markdown tables as docs/benchmarks.md shows them, and the cells' number formats."""

from __future__ import annotations

import math
from collections.abc import Sequence


def cell(x: float | None, spec: str = ".1f", scale: float = 1.0, missing: str = "—") -> str:
    """``x * scale`` formatted by ``spec``; ``missing`` for None or NaN (a failed step)."""
    if x is None or math.isnan(x):
        return missing
    return format(x * scale, spec)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A header line, its separator and one line a row; a row shorter than the header is
    padded with empty cells (e.g. one FAILED cell for a configuration that did not run)."""

    def line(cells: Sequence[object]) -> str:
        padded = [str(c) for c in cells] + [""] * (len(header) - len(cells))
        return "| " + " | ".join(padded) + " |"

    return "\n".join([line(header), "|" + "---|" * len(header), *(line(r) for r in rows)])
