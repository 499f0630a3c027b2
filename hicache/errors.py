"""Errors the cache raises to its callers. Torch-free: the daemon's API server process maps them
to status codes (and unpickles them from the scheduler process) without loading the cache."""

from __future__ import annotations


class StorageBusyError(RuntimeError):
    """L3 cannot be attached / detached now (one is attached; work is still in flight)."""
