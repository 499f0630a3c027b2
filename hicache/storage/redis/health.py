"""ServerHealth: every call of the redis backend to its server goes through ``run``, which knows
whether the server is reachable, counts errors and logs each kind of trouble once.

Nothing connects at construction; calls go to the server until one fails with a connection
error or timeout (a refused password too; on a cluster also when one node is down, or none
answers): that counts one error, marks the server down and logs one warning for the whole
outage. Until a backoff deadline (0.5 s doubling to 30 s) calls answer None at once without
touching the network (the backend answers misses / False); then one caller probes (the others
keep answering at once) and success logs "reachable again". A hung server costs the calls in
flight one socket timeout. Other server errors (OOM under maxmemory with noeviction, READONLY
replica, NOPERM) count one error per call and are logged once per kind until that kind of call
succeeds again. Nothing here raises on I/O trouble.

    up ──(outage error)──> down: answer None until retry_at ──(one probe)──┬─ ok ──> up
                           ^                                                │
                           └────────── failed: backoff doubles (max 30 s) ──┘
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar

import redis
from redis.exceptions import (
    ClusterDownError,
    MaxConnectionsError,
    RedisClusterException,
    RedisError,
)

from hicache.storage.outage import OutageLog

# NOTE: the backend's logger: everything the redis backend logs goes under one name
logger = logging.getLogger("hicache.storage.redis.backend")

BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 30.0
RTT_EWMA = 0.2
# the server cannot be used now: back off; other RedisErrors are answered per call
OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError, RedisClusterException)
_CORRUPT = ("corrupt object",)  # the problem of a corrupt object: no operation of that name
T = TypeVar("T")


class HealthStats(NamedTuple):
    """What ``ServerHealth`` counted, for the backend's ``stats()``."""

    errors: int  # failed round trips (one per call, not per key) and outage errors
    connected: bool  # a call has reached the server since the last outage
    outages: int
    offline_calls: int  # answered without the network during a backoff
    retry_in_ms: int  # until the next attempt while down
    rtt_us: int  # EWMA of small calls (exists, delete)
    io_s: dict[str, float]  # seconds spent in "read" / "write" calls


class ServerHealth:
    """The reachability of one server (or cluster) and the errors of the calls to it; see the
    module docstring. Thread-safe; ``connect()`` gives the client a call runs on (it may do I/O:
    it runs inside the call), ``on_outage()`` is called (without a lock held) whenever a call
    meets an outage error."""

    def __init__(
        self,
        address: str,
        connect: Callable[[], Any],
        on_outage: Callable[[], None],
    ) -> None:
        self.address = address
        self._connect = connect
        self._on_outage = on_outage
        self._lock = threading.Lock()  # everything below
        # up: calls go to the server (optimistic at start: the first failure starts an outage);
        # connected: a call has reached it since the last outage
        self._up = True
        self._connected = False
        self._probing = False
        self._down_since: float | None = None
        self._retry_at = 0.0
        self._backoff = BACKOFF_FIRST_S
        # (op, error kind) logged this outage; _CORRUPT once a corrupt object was logged
        self._problems = OutageLog()
        self._errors = self._outages = self._offline_calls = 0
        self._rtt_us = 0.0
        self._io_s = {"read": 0.0, "write": 0.0}

    def run(self, op: str, fn: Callable[[Any], T]) -> T | None:
        """``fn(client)``, or None when the server is down (at once during a backoff) or the
        call failed."""
        with self._lock:
            if self._up:
                probe = False
            elif self._probing or time.monotonic() < self._retry_at:
                self._offline_calls += 1
                return None
            else:
                probe = self._probing = True
        t0 = time.monotonic()
        try:
            result = fn(self._connect())
        except MaxConnectionsError as e:  # our own pool is exhausted: not an outage
            self.note_errors(op, [e])
            result = None
        except OUTAGE_ERRORS as e:
            self._outage(e, probe)
            return None
        except RedisError as e:  # the server answered: reachable
            self.note_errors(op, [e])
            result = None
        except Exception as e:  # noqa: BLE001 - a client library surprise must not reach the
            # scheduler: counted, logged once with its traceback, answered as a failed call
            self.note_errors(op, [e], unexpected=True)
            if probe:  # the server's state is unknown: try again after the backoff
                with self._lock:
                    self._probing = False
                    self._retry_at = time.monotonic() + self._backoff
            return None
        elapsed = time.monotonic() - t0
        # clean: answered without any error (pipelines leave theirs among the replies)
        clean = result is not None and not (
            isinstance(result, list) and any(isinstance(r, Exception) for r in result)
        )
        self._reachable(op, probe, elapsed, clean)
        return result

    def execute(self, op: str, pipe: Any) -> list[Any]:
        """Run a pipeline (inside ``run``); an outage error among the replies (a cluster node
        down) fails the whole call, other errors stay in the replies and are counted once."""
        res = pipe.execute(raise_on_error=False)
        errors = [r for r in res if isinstance(r, Exception)]
        for e in errors:
            if isinstance(e, OUTAGE_ERRORS) and not isinstance(e, MaxConnectionsError):
                raise e
        if errors:
            self.note_errors(op, errors)
        return res

    def note_errors(
        self, op: str, errors: Sequence[BaseException], unexpected: bool = False
    ) -> None:
        """Count one error for the round trip (not one per key); log each new kind of error
        once (until a call of the same kind succeeds again)."""
        kinds = {(op, error_kind(e)): e for e in errors}
        with self._lock:
            self._errors += 1
            new = [(k, e) for k, e in kinds.items() if self._problems.met(k)]
        for (_, kind), e in new:
            logger.warning(
                "L3 redis %s: %s failed: %s (%s; logged once, see stats errors)",
                self.address,
                op,
                e,
                kind,
                exc_info=e if unexpected else None,
            )

    def first_corruption(self) -> bool:
        """A corrupt object was read: True for the first one since the server was last
        reachable after an outage (log it loudly; a version skew would flood the log)."""
        return self._problems.met(_CORRUPT)

    def stats(self) -> HealthStats:
        with self._lock:
            wait = self._retry_at - time.monotonic() if not self._up else 0.0
            return HealthStats(
                errors=self._errors,
                connected=self._connected,
                outages=self._outages,
                offline_calls=self._offline_calls,
                retry_in_ms=max(0, math.ceil(wait * 1000)),
                rtt_us=round(self._rtt_us),
                io_s=dict(self._io_s),
            )

    # ---- transitions -------------------------------------------------------------------------
    def _outage(self, error: BaseException, probe: bool) -> None:
        now = time.monotonic()
        with self._lock:
            self._errors += 1
            self._up = self._connected = False
            first = self._down_since is None
            if first:
                self._down_since = now
                self._backoff = BACKOFF_FIRST_S
                self._outages += 1
                self._retry_at = now + self._backoff
            elif probe:
                self._backoff = min(2 * self._backoff, BACKOFF_MAX_S)
                self._retry_at = now + self._backoff
            if probe:
                self._probing = False
        self._on_outage()
        if first:
            logger.warning(
                "L3 redis %s unreachable: %s; serving from L1/L2, retrying in "
                "%.1f s (backing off to %.0f s; logged once per outage)",
                self.address,
                error,
                BACKOFF_FIRST_S,
                BACKOFF_MAX_S,
            )

    def _reachable(self, op: str, probe: bool, elapsed: float, clean: bool) -> None:
        back_after = None
        with self._lock:
            if probe:
                # NOTE: only a probe ends an outage; a call admitted before it began may still
                # succeed afterwards and must not mark the server up
                self._probing = False
                self._up = True
                if self._down_since is not None:
                    back_after = time.monotonic() - self._down_since
                    self._down_since = None
                    self._problems.reset()
                self._backoff = BACKOFF_FIRST_S
            self._connected = self._up
            if op in self._io_s:
                self._io_s[op] += elapsed
            elif op in ("exists", "delete"):
                us = elapsed * 1e6
                self._rtt_us = (
                    us if self._rtt_us == 0 else ((1 - RTT_EWMA) * self._rtt_us + RTT_EWMA * us)
                )
            if clean:
                self._problems.ok(op)
        if back_after is not None:
            logger.info("L3 redis %s reachable again after %.1f s", self.address, back_after)


def error_kind(e: BaseException) -> str:
    """A short kind for an error: the server's error code (OOM, READONLY, NOPERM, ...)."""
    words = str(e).split()
    code = words[0] if words and words[0].isupper() else ""
    return f"{type(e).__name__} {code}".strip()
