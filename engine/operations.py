"""The operations an engine answers besides requests: one frozen dataclass each, the whole
description of the call. ``EngineFront.call(op)`` (engine/front.py) runs one and returns its
answer; the engine side answers each type with its one handler (engine/runtime/handlers.py),
in-process (Engine) or in the split daemon's scheduler process, where the operation arrives
pickled in an ipc ``CallReq`` (SplitEngine). So the in-process engine and the split daemon
share one path, and an operation that is not declared here cannot be asked for.

``Operation[R]``: answered with an R (mypy reads it: ``engine.call(MatchPrefix(ids))`` is a
``MatchInfo``). Plain data and torch-free, like the records they carry and return
(engine/admin_records.py, hicache.observe): the API server process builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from engine.admin_records import (
    EvictInfo,
    FlushInfo,
    MatchInfo,
    NodeInfo,
    Pin,
    TenantQuota,
    TenantView,
)
from engine.config import ServerArgs
from hicache.observe.blocks import BlockChanges
from hicache.observe.events import CacheEvent
from hicache.observe.stats import CacheStats

R_co = TypeVar("R_co", covariant=True)

CALL_TIMEOUT_S = 30.0  # how long a cache admin call waits for the scheduler thread
STATS_TIMEOUT_S = 60.0  # figures and storage info: read between two steps, however long
DETACH_MARGIN_S = 30.0  # a detach may take this much longer than its own wait for L3 work


class Operation(Generic[R_co]):
    """One call an engine answers with an R."""

    # The split daemon's API server keeps a copy of the engine's options: an operation that
    # changes them (attaching / detaching L3) makes it fetch them again.
    changes_server_args: ClassVar[bool] = False

    def answer_within(self) -> float | None:
        """Seconds its caller waits for the answer (None: as long as it takes)."""
        return CALL_TIMEOUT_S


class EventRead(Operation[R_co]):
    """A read of the cache's event log. The scheduler process serves these on their own
    threads, so that WatchCacheEvents streams waiting for events never hold up admin calls."""

    def answer_within(self) -> float | None:
        return None


# --- the cache: figures and events -----------------------------------------------------------
@dataclass(frozen=True)
class GetCacheStats(Operation[CacheStats]):
    """Every tier's figures and the scheduler's request counters (hicache/observe/stats.py)."""

    def answer_within(self) -> float | None:
        return STATS_TIMEOUT_S


@dataclass(frozen=True)
class KvBlockChanges(Operation[BlockChanges]):
    """The cache's full blocks stored / removed per tier since the last call (reset: the whole
    state); one caller per engine (the daemon's KvEventPublisher)."""

    block_size: int
    salt_key: bytes
    reset: bool = False


@dataclass(frozen=True)
class EventsLastSeq(EventRead[int]):
    """event_log.last_seq (the log is attached first when the tree brought none)."""


@dataclass(frozen=True)
class EventsFirstSeq(EventRead[int]):
    """event_log.first_seq"""


@dataclass(frozen=True)
class EventsSince(EventRead[list[CacheEvent]]):
    """event_log.since(seq, limit)"""

    seq: int
    limit: int | None = None


@dataclass(frozen=True)
class EventsMissed(EventRead[int]):
    """event_log.missed(seq)"""

    seq: int


@dataclass(frozen=True)
class EventsWaitFor(EventRead[bool]):
    """event_log.wait_for(seq, timeout)"""

    seq: int
    timeout: float | None = None

    def answer_within(self) -> float | None:
        return self.timeout


# --- the cache: admin operations (engine/runtime/cache_admin.py, tenant_cache.py) -------------
@dataclass(frozen=True)
class MatchPrefix(Operation[MatchInfo]):
    """What of `key` is cached, per tier, without changing anything."""

    key: list[int]
    namespace: str | None = None


@dataclass(frozen=True)
class Evict(Operation[EvictInfo]):
    """Evicts >= num_tokens (None: all evictable) of `tier` among the sequences that start with
    `prefix`, or the nodes of `namespaces`, or the whole tree; TierUnavailableError for a tier
    that is not enabled (or l3)."""

    tier: str
    num_tokens: int | None = None
    prefix: list[int] | None = None
    namespace: str | None = None
    dry_run: bool = False
    namespaces: frozenset[str] | None = None


@dataclass(frozen=True)
class PinPrefix(Operation[Pin | None]):
    """Locks the device-cached prefix of `key` (ttl_s 0: until unpinned); None when nothing of
    it is on L1."""

    key: list[int]
    namespace: str | None = None
    ttl_s: float = 0.0
    owner: str | None = None


@dataclass(frozen=True)
class Unpin(Operation[tuple[int, int]]):
    """Releases one pin (None: all; with an owner: only its own); (pins, tokens)."""

    pin_id: str | None = None
    owner: str | None = None


@dataclass(frozen=True)
class PinSummary(Operation[tuple[int, int]]):
    """(number of pins, tokens they pin)."""


@dataclass(frozen=True)
class Flush(Operation[FlushInfo]):
    """Empties the tiers (None: every enabled one); NotIdleError while requests run or wait,
    StorageBusyError while L3 work is in flight; nothing changes then."""

    tiers: list[str] | None = None


@dataclass(frozen=True)
class FlushNamespaces(Operation[FlushInfo]):
    """Empties the tiers of these namespaces only (a tenant's), releasing the owner's pins;
    other namespaces' requests may keep running."""

    namespaces: frozenset[str]
    tiers: list[str] | None = None
    owner: str | None = None


@dataclass(frozen=True)
class InspectTree(Operation[tuple[list[NodeInfo], int]]):
    """One page of the tree, parents first, and the number of nodes in all."""

    offset: int = 0
    limit: int = 100
    preview_tokens: int = 16
    namespaces: frozenset[str] | None = None


# --- tenants ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ApplyQuotas(Operation[None]):
    """Enforce these tenants' quotas from now on (replacing the quotas applied before)."""

    quotas: tuple[TenantQuota, ...]


@dataclass(frozen=True)
class GetTenantView(Operation[TenantView]):
    """What a tenant's namespaces hold per tier, its pins, its quota evictions."""

    tenant: str
    namespaces: frozenset[str]


@dataclass(frozen=True)
class GetTenantFigures(Operation[dict[str, dict[str, dict[str, int]]]]):
    """{tenant: {"cached" | "quota" | "evicted": {tier: tokens}}} (for /metrics)."""

    quotas: tuple[TenantQuota, ...]


# --- L3 at run time --------------------------------------------------------------------------
@dataclass(frozen=True)
class GetStorageInfo(Operation[dict[str, Any]]):
    """The attached L3 backend: {"attached", "backend", "address", ...}."""

    def answer_within(self) -> float | None:
        return STATS_TIMEOUT_S


@dataclass(frozen=True)
class AttachStorage(Operation[dict[str, Any]]):
    """Attaches an L3 backend (none may be attached); answers storage info. Its objects are
    the ones a daemon with the same model and options would use."""

    changes_server_args: ClassVar[bool] = True
    backend: str
    url: str | None = None
    directory: str | None = None

    def answer_within(self) -> float | None:
        return None  # building the backend (a directory scan) takes what it takes


@dataclass(frozen=True)
class DetachStorage(Operation[dict[str, Any]]):
    """Stops using L3 once its pending work lands (at most `timeout` s); answers what was
    attached."""

    changes_server_args: ClassVar[bool] = True
    timeout: float = 30.0

    def answer_within(self) -> float | None:
        return self.timeout + DETACH_MARGIN_S


# --- the engine itself -----------------------------------------------------------------------
@dataclass(frozen=True)
class GetModelInfo(Operation[dict[str, Any]]):
    """model_path, architecture, vocab_size, max_context_len, max_total_tokens, ..."""

    def answer_within(self) -> float | None:
        return None


@dataclass(frozen=True)
class GetServerArgs(Operation[ServerArgs]):
    """The options the engine runs with (attaching or detaching L3 changes them)."""

    def answer_within(self) -> float | None:
        return None


@dataclass(frozen=True)
class InScheduler(Operation[Any]):
    """fn(scheduler) on the scheduler thread, for scripts and tests (call_in_scheduler; the
    daemon never asks it). Across processes fn must pickle: a module-level function, or a
    SchedulerCall of one with plain arguments."""

    fn: Callable[[Any], Any]
    timeout: float | None = 60.0

    def answer_within(self) -> float | None:
        return self.timeout
