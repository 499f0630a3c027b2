"""A benchmark's result as JSON: its folder made, values JSON cannot hold (a path, a dtype)
written as their strings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: str | Path, result: dict[str, Any], indent: int = 1) -> str:
    """Writes ``result`` to ``path``; the path."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=indent, default=str) + "\n")
    return str(path)
