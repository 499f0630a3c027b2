"""Log once per outage: which problems have been logged and are not over yet.

A backend that meets the same trouble on every object (a read-only directory, a server out of
memory) logs its first occurrence and counts the rest in ``stats`` errors. A problem is a
hashable whose first element is the operation it hit (``("write", errno)``, ``("read",
"ResponseError OOM")``); it is over when an operation of that kind succeeds after the problem
was last met at least ``quiet_s`` ago, and a later occurrence is logged again.

    met(p)      True when p starts an outage (log it), False while it lasts
    ok(op, s)   an op succeeded: the problems of op quiet for s seconds are over (returned)
    reset()     everything over (the whole store came back)

Safe to call from several threads; the clock is injectable so that tests need not wait.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable


class OutageLog:
    """The problems logged in their current outage, each with the last time it was met."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last_met: dict[tuple[Hashable, ...], float] = {}

    def met(self, problem: tuple[Hashable, ...]) -> bool:
        """Meet ``problem``; True when it was not already in an outage (the caller logs it)."""
        with self._lock:
            first = problem not in self._last_met
            self._last_met[problem] = self._clock()
        return first

    def ok(self, op: Hashable, quiet_s: float = 0.0) -> list[tuple[Hashable, ...]]:
        """An operation ``op`` succeeded: its problems not met for ``quiet_s`` are over; returns
        them (the caller may log that they are)."""
        with self._lock:
            if not self._last_met:
                return []
            now = self._clock()
            over = [p for p, t in self._last_met.items() if p[0] == op and now - t >= quiet_s]
            for p in over:
                del self._last_met[p]
        return over

    def reset(self) -> None:
        """Every problem is over."""
        with self._lock:
            self._last_met.clear()

    def __contains__(self, problem: object) -> bool:
        with self._lock:
            return problem in self._last_met
