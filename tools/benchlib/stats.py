"""Percentiles and medians of a benchmark's samples. numpy's linear interpolation (its default
``np.percentile``) throughout; no samples gives NaN, or None in a ``summary`` (JSON has no NaN),
and NaN samples (a failed request's time) are left out."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np


def _finite(xs: Iterable[float]) -> list[float]:
    return [float(x) for x in xs if not math.isnan(x)]


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of the samples that are not NaN; NaN for none."""
    v = _finite(xs)
    return float(np.percentile(v, q)) if v else math.nan


def median(xs: Iterable[float]) -> float:
    """The median of the samples that are not NaN; NaN for none."""
    return percentile(xs, 50)


def summary(
    xs: Iterable[float], scale: float = 1.0, qs: Sequence[int] = (50, 90, 99)
) -> dict[str, float | None]:
    """``{"p50": ..., "p90": ..., "p99": ..., "mean": ...}`` of the samples times ``scale``
    (e.g. 1000 for seconds -> ms); every value None for no samples."""
    v = np.asarray(_finite(xs)) * scale
    if not v.size:
        return {**{f"p{q}": None for q in qs}, "mean": None}
    return {
        **{f"p{q}": float(p) for q, p in zip(qs, np.percentile(v, list(qs)), strict=True)},
        "mean": float(v.mean()),
    }
