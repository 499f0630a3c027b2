"""The errors an engine raises to its callers, beside ValueError for bad input; the daemon
maps each to a status code (engine/server/state.py). Torch-free: they cross the engine
boundary (engine/front.py), pickled from the scheduler process in a split daemon."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue is at max_queued_requests; retry later."""


class EngineShutdownError(RuntimeError):
    """The engine has been shut down."""


class NotIdleError(RuntimeError):
    """The operation needs an idle scheduler (nothing running or waiting)."""


class TierUnavailableError(RuntimeError):
    """The tier is not configured in this engine."""
