"""Hand-built stats records for tests: every field the test does not name is zero (or empty)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from hicache.observe.stats import CacheStats, L1Stats, L2Stats, L3Stats, TierStats
from hicache.tier import TIERS

T = TypeVar("T")


def record(cls: type[T], **figures: Any) -> T:
    blank: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            blank[f.name] = "" if f.type == "str" else 0
    return cls(**{**blank, **figures})


def l1(**figures: Any) -> L1Stats:
    return record(L1Stats, **figures)


def l2(**figures: Any) -> L2Stats:
    return record(L2Stats, **figures)


def l3(**figures: Any) -> L3Stats:
    return record(L3Stats, **{"backend": "file", "object_tokens": 16, **figures})


def cache_stats(
    l1: L1Stats | None = None, l2: L2Stats | None = None, l3: L3Stats | None = None, **figures: Any
) -> CacheStats:
    return record(CacheStats, l1=l1 if l1 is not None else record(L1Stats), l2=l2, l3=l3, **figures)


# What each figure is called in Prometheus (docs/daemon.md, "Metrics"), written out here rather
# than read from engine/server/metrics.py, so that a test compares two independent statements
TIER_FAMILIES = {  # one family per TierStats field, label tier
    "capacity_tokens": "hicache_max_total_num_tokens",  # no sample when 0 (no cap)
    "used_tokens": "hicache_num_used_tokens",
    "evictable_tokens": "hicache_num_evictable_tokens",
    "pinned_tokens": "hicache_num_protected_tokens",
    "hit_tokens": "hicache_prefix_cache_hits_total",
    "evicted_tokens": "hicache_evicted_tokens_total",
    "errors": "hicache_errors_total",
}
TRAFFIC_FAMILIES = {  # the movement fields, named after the copy (no label)
    "l1": {
        "promoted_tokens": "hicache_load_back_tokens_total",
        "bytes_in": "hicache_load_back_bytes_total",
        "demoted_tokens": "hicache_demoted_tokens_total",
        "bytes_out": "hicache_host_backup_bytes_total",
    },
    "l2": {
        "promoted_tokens": "hicache_prefetched_tokens_total",
        "bytes_in": "hicache_prefetched_bytes_total",
        "demoted_tokens": "hicache_backuped_tokens_total",
        "bytes_out": "hicache_backuped_bytes_total",
    },
}
L3_FAMILIES = {  # L3Stats' own fields that are exported (no label)
    "prefetch_objects": "hicache_l3_prefetch_objects_total",
    "prefetch_started": "hicache_l3_prefetches_total",
    "prefetch_cancelled": "hicache_l3_prefetch_cancelled_total",
    "prefetch_yielded": "hicache_l3_prefetch_yielded_total",
    "backup_deferred": "hicache_l3_backup_deferred_nodes_total",
    "backup_dropped_nodes": "hicache_l3_backup_dropped_nodes_total",
    "repaired_objects": "hicache_l3_repaired_objects_total",
    "errors": "hicache_l3_errors_total",
    "backup_failed_objects": "hicache_l3_backup_failed_objects_total",
    "vanished": "hicache_l3_vanished_objects_total",
    "bytes": "hicache_l3_bytes",
    "hits": "hicache_l3_object_hits_total",
    "misses": "hicache_l3_object_misses_total",
    "corrupt": "hicache_l3_corrupt_objects_total",
    "pending_backups": "hicache_l3_pending_backups",
    "pending_prefetches": "hicache_l3_pending_prefetches",
}


def samples(text: str) -> dict[tuple[str, str], float]:
    """Prometheus text -> {(sample name, its tier label or ""): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, s.labels.get("tier", "")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def assert_metrics_equal(scraped: dict[tuple[str, str], float], stats: CacheStats) -> None:
    """Every figure Prometheus exports from ``stats`` is the record's."""
    for tier in TIERS:
        t = stats.tier(tier)
        if t is None:
            assert not [k for k in scraped if k[1] == tier], tier
            continue
        for fld, name in TIER_FAMILIES.items():
            value = getattr(t, fld)
            if fld == "capacity_tokens" and value == 0:
                assert (name, tier) not in scraped
            else:
                assert scraped[(name, tier)] == value, (name, tier)
        below = TIERS[TIERS.index(tier) + 1] if tier != TIERS[-1] else None
        for fld, name in TRAFFIC_FAMILIES.get(tier, {}).items():
            if below is not None and stats.tier(below) is not None:
                assert scraped[(name, "")] == getattr(t, fld), name
            else:
                assert (name, "") not in scraped, name
    assert scraped[("hicache_prefix_cache_queries_total", "")] == stats.prompt_tokens
    assert scraped[("hicache_num_requests_running", "")] == stats.running_requests
    assert scraped[("hicache_num_requests_waiting", "")] == stats.waiting_requests
    if stats.l3 is not None:
        for fld, name in L3_FAMILIES.items():
            assert scraped[(name, "")] == getattr(stats.l3, fld), name


def assert_message_equals(msg: Any, stats: CacheStats) -> None:
    """A GetCacheStatsResponse carries ``stats`` field by field: each tier's common fields as
    the proto's typed fields, its own numbers in ``extra``, its strings in ``info``."""
    assert [m.tier for m in msg.tiers] == [1, 2, 3]  # TIER_L1, TIER_L2, TIER_L3
    for m, tier in zip(msg.tiers, TIERS):
        t = stats.tier(tier)
        assert m.enabled == (t is not None), tier
        if t is None:
            continue
        for f in dataclasses.fields(TierStats):
            assert getattr(m, f.name) == getattr(t, f.name), (tier, f.name)
        common = {f.name for f in dataclasses.fields(TierStats)}
        own = {f.name: getattr(t, f.name) for f in dataclasses.fields(t) if f.name not in common}
        extra, info = dict(m.extra), dict(m.info)
        for name, value in own.items():
            items = dict(value) if isinstance(value, Mapping) else {name: value}
            for k, v in items.items():
                if isinstance(v, str):
                    assert info.pop(k) == v, (tier, k)
                else:
                    assert extra.pop(k) == v, (tier, k)
        assert extra == {} and info == {}, (tier, extra, info)  # nothing the record lacks
    for f in dataclasses.fields(CacheStats):
        if f.name not in TIERS:
            assert getattr(msg, f.name) == getattr(stats, f.name), f.name
