"""Cache statistics as typed records: one per tier (`L1Stats` device, `L2Stats` host, `L3Stats`
storage) and `CacheStats` for the whole cache. ``tier_stats`` builds the tier records from a
cache and its parts (host tier, L3), the engine adds the scheduler's figures; GetCacheStats, the
Prometheus collector and `hicache stats` copy the fields as they are.

`TierStats`' fields are the proto's `TierStats` fields one for one (`tier`, `enabled`, `extra`
and `info` aside; a test keeps them equal). A tier's own figures are its subclass's fields:
numbers go to the proto's `extra`, strings to its `info`. Each quantity is reported once, in
tokens where it has tokens. Traffic between two tiers is counted on the upper one:

    L1 <-> L2   l1.promoted_tokens  L2 -> L1 loads        l1.bytes_in   host -> device bytes
                l1.demoted_tokens   L1 -> L2 demotions    l1.bytes_out  device -> host bytes
    L2 <-> L3   l2.promoted_tokens  L3 -> L2 prefetches   l2.bytes_in   bytes read from L3
                l2.demoted_tokens   L2 -> L3 backups      l2.bytes_out  bytes written to L3

so L3's movement fields are 0 (no tier below it), as are its evictable and pinned tokens (the
backend evicts by its own policy; nothing locks an object) and L1's errors (device memory
does not fail; the copies to and from host count as L2's errors).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, NamedTuple

from hicache.tier import Tier

if TYPE_CHECKING:
    from hicache.tree.base import BasePrefixCache


@dataclass(frozen=True, kw_only=True)
class TierStats:
    """Occupancy (tokens now) and cumulative counters (since start) every tier has."""

    capacity_tokens: int
    used_tokens: int
    evictable_tokens: int  # cached tokens the tier could evict now (unlocked leaves)
    pinned_tokens: int  # cached tokens locked by running requests or pins
    hit_tokens: int  # prompt tokens this tier served (counted when a request is admitted)
    evicted_tokens: int
    promoted_tokens: int  # into this tier from the one below
    demoted_tokens: int  # from this tier to the one below
    bytes_in: int  # bytes of promoted_tokens
    bytes_out: int  # bytes of demoted_tokens
    errors: int  # operations of the tier that failed

    def core(self) -> dict[str, int]:
        """The fields every tier has (the proto's typed TierStats fields)."""
        return {f.name: getattr(self, f.name) for f in fields(TierStats)}

    def figures(self) -> dict[str, float]:
        """The tier's own numeric figures (the proto's ``extra``)."""
        out: dict[str, float] = {}
        for name, value in self._own():
            if isinstance(value, Mapping):
                out.update({k: float(v) for k, v in value.items() if not isinstance(v, str)})
            elif isinstance(value, (int, float)):
                out[name] = float(value)
        return out

    def facts(self) -> dict[str, str]:
        """The tier's own descriptive facts (the proto's ``info``)."""
        out: dict[str, str] = {}
        for name, value in self._own():
            if isinstance(value, Mapping):
                out.update({k: v for k, v in value.items() if isinstance(v, str)})
            elif isinstance(value, str):
                out[name] = value
        return out

    def _own(self) -> list[tuple[str, object]]:
        core = {f.name for f in fields(TierStats)}
        return [(f.name, getattr(self, f.name)) for f in fields(self) if f.name not in core]


@dataclass(frozen=True, kw_only=True)
class L1Stats(TierStats):
    """Device memory. NOTE: used = cached + held by requests (every slot is free, in the tree
    or held by a request, exactly once)."""

    cached_tokens: int  # device tokens the tree holds
    held_by_requests_tokens: int  # device tokens running requests hold outside the tree


@dataclass(frozen=True, kw_only=True)
class L2Stats(TierStats):
    """Host memory (HiRadixCache's host pool)."""

    cached_tokens: int  # host tokens the tree holds (used - cached: slots behind copies)
    host_only_tokens: int  # of cached_tokens, those with no device copy
    pending_free_tokens: int  # host slots freed once the copies reading them land
    ongoing_writes: int  # device -> host copies in flight (nodes)
    write_policy: str


@dataclass(frozen=True, kw_only=True)
class L3Stats(TierStats):
    """Storage: objects of ``object_tokens`` tokens in a file / Redis backend."""

    object_tokens: int
    bytes: int  # of the objects stored (as stored: payload and, for `file`, its header)
    capacity_bytes: int  # the backend's cap (0: none)
    hits: int  # objects read and found
    misses: int  # objects asked for and not there
    corrupt: int  # objects found damaged (removed)
    vanished: int  # objects expected but found gone (or dropped with a lost parent)
    backup_skipped_present: int  # objects a backup found stored already
    backup_failed_objects: int  # objects a backup could not store
    backup_deferred: int  # node backups that waited for room (too many in flight)
    backup_dropped_nodes: int  # deferred node backups dropped: the node left L2 first
    backup_gated_nodes: int  # node backups a policy (a tenant's L3 quota) held back
    repaired_objects: int  # lost objects L2 still held, written again
    prefetch_started: int
    prefetch_skipped: int  # not started: L2 had no room for enough of it
    prefetch_cancelled: int
    prefetch_yielded: int  # gave their L2 room to a request going first
    prefetch_partial: int  # ended before reading every object they asked for
    prefetch_objects: int  # objects read by prefetches
    prefetch_misses: int  # prefetches that found an object gone
    prefetch_discarded_tokens: int  # read, then dropped: their prefix was evicted meanwhile
    pending_backups: int  # in flight
    deferred_backups: int  # waiting for room
    pending_prefetches: int  # in flight
    backend: str  # file, redis, redis-cluster
    address: str  # directory or URL (no password); "" when the backend has none
    prefetch_policy: str
    # what the backend reports beyond StorageStats (Redis: connected, rtt_us, outages, ...;
    # file: refused) and says beyond backend / address (Redis: key_prefix)
    backend_figures: Mapping[str, int] = field(default_factory=dict)
    backend_details: Mapping[str, str] = field(default_factory=dict)


@dataclass
class StorageStats:
    """Counters every L3 backend keeps (hicache/storage); its ``stats()`` returns them as a dict."""

    objects: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    evictions: int = 0
    corrupt: int = 0
    vanished: int = 0  # objects the index listed that were gone (or dropped with their parent)
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Moves(NamedTuple):
    """Traffic between a tier and the one below it (reported on the upper tier)."""

    promoted_tokens: int = 0
    demoted_tokens: int = 0
    bytes_in: int = 0
    bytes_out: int = 0


class TierSet(NamedTuple):
    """What a tree reports: L1, and L2 / L3 where it has them (None: not configured)."""

    l1: L1Stats
    l2: L2Stats | None = None
    l3: L3Stats | None = None


@dataclass(frozen=True, kw_only=True)
class CacheStats:
    """The cache's tiers and the scheduler's cumulative counters (``Engine.cache_stats``)."""

    l1: L1Stats
    l2: L2Stats | None  # None: no host tier
    l3: L3Stats | None  # None: no L3 attached
    prompt_tokens: int  # looked up in the cache (each admitted request once)
    miss_tokens: int  # computed from scratch
    requests: int  # admitted
    finished_requests: int
    retractions: int  # running requests sent back to the queue for want of KV room
    running_requests: int  # in the running batch now
    waiting_requests: int  # waiting to be scheduled now

    def tier(self, tier: str) -> TierStats | None:
        return {Tier.L1: self.l1, Tier.L2: self.l2, Tier.L3: self.l3}[Tier(tier)]

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the cache (any tier)."""
        return 1.0 - self.miss_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def l3_stats(
    *,
    hit_tokens: int,
    backend: Mapping[str, int],
    describe: Mapping[str, str],
    object_tokens: int,
    bytes_per_token: int,
    prefetch_policy: str,
    io: Mapping[str, int],
    counters: Mapping[str, int],
    pending_backups: int,
    deferred_backups: int,
    pending_prefetches: int,
) -> tuple[L3Stats, Moves]:
    """L3's record and the L2 <-> L3 traffic (L2's), from the backend's ``stats()`` and
    ``describe()``, StorageIO's counters (``io``) and the tree's L3 counters. The backend counts
    objects; the tier figures are in tokens (whole objects of ``object_tokens``)."""
    b = StorageStats(**{f.name: int(backend.get(f.name, 0)) for f in fields(StorageStats)})
    common = {f.name for f in fields(StorageStats)}
    object_bytes = object_tokens * bytes_per_token
    l3 = L3Stats(
        capacity_tokens=b.capacity_bytes // object_bytes * object_tokens,
        used_tokens=b.objects * object_tokens,
        evictable_tokens=0,
        pinned_tokens=0,
        hit_tokens=hit_tokens,
        evicted_tokens=b.evictions * object_tokens,
        promoted_tokens=0,
        demoted_tokens=0,
        bytes_in=0,
        bytes_out=0,
        errors=b.errors + io["backup_errors"] + io["prefetch_errors"],
        object_tokens=object_tokens,
        bytes=b.bytes,
        capacity_bytes=b.capacity_bytes,
        hits=b.hits,
        misses=b.misses,
        corrupt=b.corrupt,
        vanished=b.vanished,
        backup_skipped_present=io["backup_skipped_present"],
        backup_failed_objects=io["backup_failed_objects"],
        backup_deferred=counters["backup_deferred"],
        backup_dropped_nodes=counters["backup_dropped_nodes"],
        backup_gated_nodes=counters["backup_gated_nodes"],
        repaired_objects=counters["repaired_objects"],
        prefetch_started=counters["prefetch_started"],
        prefetch_skipped=counters["prefetch_skipped"],
        prefetch_cancelled=counters["prefetch_cancelled"],
        prefetch_yielded=counters["prefetch_yielded"],
        prefetch_partial=counters["prefetch_partial"],
        prefetch_objects=io["prefetch_objects"],
        prefetch_misses=io["prefetch_misses"],
        prefetch_discarded_tokens=counters["prefetch_discarded_tokens"],
        pending_backups=pending_backups,
        deferred_backups=deferred_backups,
        pending_prefetches=pending_prefetches,
        backend=describe["backend"],
        address=describe.get("address", ""),
        prefetch_policy=prefetch_policy,
        backend_figures={k: v for k, v in backend.items() if k not in common},
        backend_details={k: v for k, v in describe.items() if k not in ("backend", "address")},
    )
    moves = Moves(
        promoted_tokens=counters["prefetch_tokens"],
        demoted_tokens=io["backup_objects"] * object_tokens,
        bytes_in=b.bytes_read,
        bytes_out=b.bytes_written,
    )
    return l3, moves


def tier_stats(cache: BasePrefixCache, hit_tokens: Mapping[str, int], held_tokens: int) -> TierSet:
    """Each tier's record of ``cache``: L1 from the core, L2 and L3 from its parts where it has
    them (L3: attached). ``hit_tokens`` (prompt tokens each tier served, by tier name) and
    ``held_tokens`` (device tokens running requests hold outside the tree) are the scheduler's
    figures."""
    host, l3 = cache.host, cache.l3
    l3_record, l3_moves = (
        l3.storage_stats(hit_tokens[Tier.L3])
        if l3 is not None and l3.has_storage()
        else (None, Moves())
    )
    alloc = cache.token_to_kv_pool_allocator
    moves = host.moves() if host is not None else Moves()
    l1 = L1Stats(
        capacity_tokens=alloc.size,
        used_tokens=alloc.size - alloc.available_size(),
        evictable_tokens=cache.evictable_size(),
        pinned_tokens=cache.protected_size(),
        hit_tokens=hit_tokens[Tier.L1],
        evicted_tokens=cache.evicted_tokens,
        promoted_tokens=moves.promoted_tokens,
        demoted_tokens=moves.demoted_tokens,
        bytes_in=moves.bytes_in,
        bytes_out=moves.bytes_out,
        errors=0,
        cached_tokens=cache.total_size(),
        held_by_requests_tokens=held_tokens,
    )
    l2 = host.stats(hit_tokens[Tier.L2], l3_moves) if host is not None else None
    return TierSet(l1, l2, l3_record)
