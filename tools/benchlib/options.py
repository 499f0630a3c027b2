"""``--opt KEY=VALUE`` (``--arg name=value``): engine options from the command line, each value
parsed as JSON when it parses (numbers, true / false, null, lists) and kept as a string when
not."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def parse_options(pairs: Iterable[str]) -> dict[str, Any]:
    """``["page_size=16", "hicache_storage_backend=file"]`` -> ``{"page_size": 16, ...}``."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{pair!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out
