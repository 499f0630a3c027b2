"""hicache's serving engine: `from engine import Engine`.

Imports are lazy so that the client and CLI start without loading torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "GenerateResult", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from engine.runtime.engine import Engine

        return Engine
    if name == "GenerateResult":
        from engine.front import GenerateResult

        return GenerateResult
    if name == "ServerArgs":
        from engine.config import ServerArgs

        return ServerArgs
    raise AttributeError(name)
