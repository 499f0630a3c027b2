from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queued_requests; retry later."""


class EngineShutdownError(RuntimeError):
    """The engine has been shut down."""
