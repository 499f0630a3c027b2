"""hicache's serving engine: `from engine import Engine`.

Imports are lazy so that the client and CLI start without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "GenerateResult", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "GenerateResult"):
        from engine.runtime import engine as _engine

        return getattr(_engine, name)
    if name == "ServerArgs":
        from engine.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)
