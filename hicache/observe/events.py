"""CacheEventLog: a thread-safe ring buffer of cache events (stored / removed / demoted /
promoted / cleared), read by the daemon's WatchCacheEvents stream and resumable by sequence number.

Sequence numbers start at 1 and never repeat; `since(seq)` returns the retained events after `seq`.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from hicache.tier import TIERS

EVENT_KINDS = ("stored", "removed", "demoted", "promoted", "cleared")


@dataclass(frozen=True)
class CacheEvent:
    seq: int
    kind: str  # stored | removed | demoted | promoted | cleared
    tier: str  # l1 | l2 | l3
    num_tokens: int
    node_id: int | None
    namespace: str | None
    time: float  # unix seconds


class CacheEventLog:
    """Keeps the newest `capacity` events. emit() is cheap and never blocks on readers."""

    def __init__(self, capacity: int = 65536):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._events: collections.deque[CacheEvent] = collections.deque(maxlen=capacity)
        self._cond = threading.Condition()
        self._last_seq = 0
        self._closed = False  # its cache has stopped: no wait blocks any more

    @property
    def last_seq(self) -> int:
        """The sequence number of the newest event (0 when none was emitted)."""
        with self._cond:
            return self._last_seq

    @property
    def first_seq(self) -> int:
        """The oldest retained sequence number (last_seq + 1 when the log is empty)."""
        with self._cond:
            return self._events[0].seq if self._events else self._last_seq + 1

    def emit(
        self,
        kind: str,
        tier: str,
        num_tokens: int,
        node_id: int | None = None,
        namespace: str | None = None,
    ) -> CacheEvent:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown cache event kind {kind!r}")
        if tier not in TIERS:
            raise ValueError(f"unknown cache tier {tier!r}")
        with self._cond:
            self._last_seq += 1
            ev = CacheEvent(
                self._last_seq, kind, tier, int(num_tokens), node_id, namespace, time.time()
            )
            self._events.append(ev)
            self._cond.notify_all()
        return ev

    def since(self, seq: int, limit: int | None = None) -> list[CacheEvent]:
        """The retained events with a sequence number > seq, oldest first."""
        with self._cond:
            if not self._events or seq >= self._last_seq:
                return []
            start = max(0, seq + 1 - self._events[0].seq)
            stop = len(self._events) if limit is None else min(len(self._events), start + limit)
            return [self._events[i] for i in range(start, stop)]

    def missed(self, seq: int) -> int:
        """How many events after seq were dropped from the ring (0 when none)."""
        with self._cond:
            first = self._events[0].seq if self._events else self._last_seq + 1
            return max(0, first - seq - 1)

    def wait_for(self, seq: int, timeout: float | None = None) -> bool:
        """Blocks until an event with a sequence number > seq exists; False on timeout, and
        at once once the log is closed (when there is none)."""
        with self._cond:
            self._cond.wait_for(lambda: self._last_seq > seq or self._closed, timeout)
            return self._last_seq > seq

    def close(self) -> None:
        """Its cache has stopped: the waits end, now and later (the events stay readable)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def clear(self) -> None:
        """Drops the retained events (sequence numbers keep increasing)."""
        with self._cond:
            self._events.clear()

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)
