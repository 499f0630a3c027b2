"""The records of cache admin operations as they cross the engine boundary (engine/front.py):
what the API server passes in (tenant quotas) and gets back (matches, evictions, flushes, pins,
tree pages, a tenant's usage). Plain data and torch-free: in a split daemon they are pickled
between the scheduler process, which fills them (engine/runtime/cache_admin.py,
tenant_cache.py), and the API server process, which reads them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from hicache.tier import TIERS


class MatchInfo(NamedTuple):
    matched_tokens: int
    per_tier: dict[str, int]  # tier -> matched tokens served from it
    page_size: int


class EvictInfo(NamedTuple):
    evicted_tokens: int
    evicted_nodes: int


class FlushInfo(NamedTuple):
    flushed: list[str]
    freed_tokens: int
    unpinned: int


class NodeInfo(NamedTuple):
    """One tree node as InspectTree shows it."""

    node_id: int
    parent_id: int
    depth: int
    token_length: int
    prefix_length: int
    preview_ids: list[int]
    residency: list[str]
    lock_ref: int
    pinned: bool
    hit_count: int
    last_access_time: float
    num_children: int


@dataclass(frozen=True)
class Pin:
    """An admin pin (engine/runtime/pins.py's PinTable keeps the tree lock it stands for)."""

    pin_id: str
    tokens: int  # prompt tokens it keeps on device (a namespace's own key tokens not counted)
    expires_at: float | None  # time.monotonic(); None = until unpinned
    owner: str | None = None  # the tenant that made it; None = the admin / a single user
    node_id: int = 0  # the tree node its lock ends at


class TierUsage(NamedTuple):
    used_tokens: int
    evictable_tokens: int
    pinned_tokens: int  # locked by running requests or pins


class TenantView(NamedTuple):
    """A tenant's share of the cache (GetCacheStats with a tenant's token)."""

    usage: dict[str, TierUsage]  # tier -> what its namespaces hold
    pins: list[Pin]  # its pins
    evicted: dict[str, int]  # tier -> tokens its quotas evicted so far


@dataclass
class TenantQuota:
    """One tenant's quotas (0 = none) and what enforcing them evicted so far."""

    name: str
    namespaces: frozenset[str]
    quota_tokens: dict[str, int]  # tier -> tokens
    evicted_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
