"""CacheAdminService's answers as protos: the engine's records (hicache.observe.stats,
engine/admin_records.py, cache events, storage info) turned into hicache.v1 messages, one
function each; GetCacheStats' is shared with the tests that check every figure is carried."""

from __future__ import annotations

import time
from typing import Any

from engine.admin_records import NodeInfo, TenantView
from engine.server.pb import EVENT_TO_ENUM, TIER_TO_ENUM, admin_pb2
from engine.server.tenants import Tenant
from hicache.observe.events import CacheEvent
from hicache.observe.stats import CacheStats, TierStats
from hicache.tier import Tier


def tier_message(tier: Tier, stats: TierStats | None) -> admin_pb2.TierStats:
    """One tier's record as the proto: the fields every tier has one for one, the tier's own
    numbers in ``extra`` and its facts in ``info``; None: the tier is not configured."""
    if stats is None:
        return admin_pb2.TierStats(tier=TIER_TO_ENUM[tier], enabled=False)
    return admin_pb2.TierStats(
        tier=TIER_TO_ENUM[tier],
        enabled=True,
        extra=stats.figures(),
        info=stats.facts(),
        **stats.core(),
    )


def stats_message(
    stats: CacheStats, admin_pinned_tokens: int, num_pins: int
) -> admin_pb2.GetCacheStatsResponse:
    return admin_pb2.GetCacheStatsResponse(
        tiers=[tier_message(t, stats.tier(t)) for t in Tier],
        miss_tokens=stats.miss_tokens,
        admin_pinned_tokens=admin_pinned_tokens,
        num_pins=num_pins,
        timestamp=time.time(),
        prompt_tokens=stats.prompt_tokens,
        requests=stats.requests,
        finished_requests=stats.finished_requests,
        retractions=stats.retractions,
        running_requests=stats.running_requests,
        waiting_requests=stats.waiting_requests,
    )


def storage_info(d: dict[str, Any]) -> admin_pb2.StorageInfo:
    core = ("attached", "backend", "address", "object_tokens", "pending")
    return admin_pb2.StorageInfo(
        attached=bool(d.get("attached")),
        backend=str(d.get("backend", "")),
        address=str(d.get("address", "")),
        object_tokens=int(d.get("object_tokens", 0)),
        pending=int(d.get("pending", 0)),
        details={k: str(v) for k, v in d.items() if k not in core},
    )


def tenant_stats_message(
    stats: CacheStats, tenant: Tenant, view: TenantView
) -> admin_pb2.GetCacheStatsResponse:
    """A tenant's view: its namespaces' tokens per tier, its quota as the capacity (the tier's
    without one), its quota evictions, its pins; nothing of anyone else's."""
    tiers = []
    for t in Tier:
        whole = stats.tier(t)
        msg = admin_pb2.TierStats(tier=TIER_TO_ENUM[t], enabled=whole is not None)
        if whole is not None:
            u = view.usage[t]
            msg.capacity_tokens = tenant.quota(t) or whole.capacity_tokens
            msg.used_tokens = u.used_tokens
            msg.evictable_tokens = u.evictable_tokens
            msg.pinned_tokens = u.pinned_tokens
            msg.evicted_tokens = view.evicted.get(t, 0)
            msg.info["tenant"] = tenant.name
            msg.info["quota_tokens"] = str(tenant.quota(t))
        tiers.append(msg)
    return admin_pb2.GetCacheStatsResponse(
        tiers=tiers,
        admin_pinned_tokens=sum(p.tokens for p in view.pins),
        num_pins=len(view.pins),
        timestamp=time.time(),
    )


def node_message(n: NodeInfo, preview: str) -> admin_pb2.TreeNodeInfo:
    return admin_pb2.TreeNodeInfo(
        node_id=n.node_id,
        parent_id=n.parent_id,
        depth=n.depth,
        token_length=n.token_length,
        prefix_length=n.prefix_length,
        preview=preview,
        residency=[TIER_TO_ENUM[t] for t in n.residency],
        lock_ref=n.lock_ref,
        pinned=n.pinned,
        hit_count=n.hit_count,
        last_access_time=n.last_access_time,
        num_children=n.num_children,
    )


def event_message(ev: CacheEvent) -> admin_pb2.CacheEvent:
    return admin_pb2.CacheEvent(
        seq=ev.seq,
        kind=EVENT_TO_ENUM[ev.kind],
        tier=TIER_TO_ENUM[ev.tier],
        num_tokens=ev.num_tokens,
        node_id=ev.node_id or 0,
        cache_namespace=ev.namespace or "",
        time=ev.time,
    )
