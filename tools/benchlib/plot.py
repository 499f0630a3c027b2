"""A matplotlib figure drawn without a display (the Agg backend, chosen before pyplot loads)
and its PNG. matplotlib is imported on the first figure: a benchmark without --plot runs
without it (it comes with the project's ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots(nrows, ncols, **kwargs)`` on the Agg backend: (figure, axes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, **kwargs)


def save_figure(fig: Any, path: str | Path, dpi: int = 100) -> str:
    """Lays the figure out, writes it to ``path`` (its folder made), closes it; the path."""
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path)
