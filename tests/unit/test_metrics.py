"""The Prometheus collector turns an engine's cache stats into hicache_* families: per-tier
gauges and counters (tokens), the transfers between tiers, the scheduler queues, and the L3
backend's own figures (Redis: connection, round trip, bandwidth, hits / misses) with its name
and address as labels; request latencies come from the gRPC edge."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import Engine
from engine.server.admin_pb import stats_message
from engine.server.metrics import Metrics
from hicache.observe.stats import CacheStats, L3Stats, Moves, l3_stats
from hicache.tree.ops import flush_tier
from tests import stats_records as rec
from tests.e2e.test_hicache_engine import _prompts, _wait_backups_landed, _wait_in_l3

REDIS = {
    "objects": 12,
    "bytes": 12 << 20,
    "hits": 30,
    "misses": 4,
    "corrupt": 1,
    "vanished": 2,
    "errors": 3,
    "bytes_read": 5 << 20,
    "bytes_written": 7 << 20,
    "evictions": 0,
    "capacity_bytes": 0,
    "read_bytes_per_s": 400_000_000,
    "write_bytes_per_s": 300_000_000,
    "rtt_us": 85,
    "connected": 1,
    "outages": 2,
}  # a RedisStorageBackend's stats()
IO = (
    "backup_objects",
    "backup_skipped_present",
    "backup_failed_objects",
    "backup_errors",
    "prefetch_objects",
    "prefetch_errors",
    "prefetch_misses",
)  # StorageIO.stats
COUNTERS = (
    "prefetch_started",
    "prefetch_tokens",
    "prefetch_skipped",
    "prefetch_cancelled",
    "prefetch_discarded_tokens",
    "prefetch_partial",
    "backup_deferred",
    "backup_dropped_nodes",
    "repaired_objects",
    "backup_gated_nodes",
    "prefetch_yielded",
)  # HiRadixCache.l3_counters


def _l3(backend: dict, object_tokens: int = 64, **counts: int) -> tuple[L3Stats, Moves]:
    """L3's record as the tree builds it, from a backend's stats() and counts of the I/O
    threads and the tree (the others 0)."""
    return l3_stats(
        hit_tokens=0,
        backend=backend,
        describe={"backend": "redis", "address": "redis://u@10.0.0.5:6379/0"},
        object_tokens=object_tokens,
        bytes_per_token=1024,
        prefetch_policy="best_effort",
        io={k: counts.get(k, 0) for k in IO},
        counters={k: counts.get(k, 0) for k in COUNTERS},
        pending_backups=0,
        deferred_backups=0,
        pending_prefetches=0,
    )


def _with_l3(l3: L3Stats, moves: Moves, **l1: int) -> CacheStats:
    return rec.cache_stats(l1=rec.l1(**l1), l2=rec.l2(**moves._asdict()), l3=l3)


def _scrape(stats: CacheStats, tenants: dict | None = None) -> str:
    return generate_latest(Metrics(lambda: stats, lambda: tenants).registry).decode()


def _samples(text: str) -> dict[tuple[str, str], float]:
    """(sample name, its tier or finish_reason label or "") -> value."""
    return {
        (s.name, s.labels.get("tier", s.labels.get("finish_reason", ""))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def test_l3_backend_figures_are_exported():
    text = _scrape(_with_l3(*_l3(REDIS, backup_objects=9, prefetch_tokens=128), used_tokens=5))
    assert (
        'hicache_l3_backend_info{address="redis://u@10.0.0.5:6379/0",backend="redis"} 1.0' in text
    )
    for line in (
        "hicache_l3_bytes 1.2582912e+07",
        "hicache_l3_object_hits_total 30.0",
        "hicache_l3_object_misses_total 4.0",
        "hicache_l3_corrupt_objects_total 1.0",
        "hicache_l3_vanished_objects_total 2.0",
        "hicache_l3_errors_total 3.0",
        "hicache_prefetched_bytes_total 5.24288e+06",
        "hicache_backuped_bytes_total 7.340032e+06",
        "hicache_backuped_tokens_total 576.0",  # 9 objects of 64 tokens
        "hicache_prefetched_tokens_total 128.0",
        "hicache_l3_read_bandwidth_bytes_per_second 4e+08",
        "hicache_l3_write_bandwidth_bytes_per_second 3e+08",
        "hicache_l3_round_trip_microseconds 85.0",
        "hicache_l3_connected 1.0",
        "hicache_l3_outages_total 2.0",
        'hicache_num_used_tokens{tier="l3"} 768.0',
    ):
        assert line in text, line
    # a Redis without maxmemory has no capacity: no capacity sample, no usage ratio
    assert 'hicache_max_total_num_tokens{tier="l3"}' not in text
    assert 'hicache_token_usage{tier="l3"}' not in text


def test_no_l3_no_l3_families():
    text = _scrape(rec.cache_stats(l1=rec.l1(used_tokens=5, capacity_tokens=20)))
    assert "hicache_l3_" not in text and "hicache_backuped" not in text
    assert 'hicache_num_used_tokens{tier="l1"} 5.0' in text
    assert 'hicache_token_usage{tier="l1"} 0.25' in text


def test_l3_evictions_are_exported_in_tokens():
    """The backend counts evicted objects; the family is in tokens like every other tier's."""
    l3, _ = _l3({"evictions": 3}, object_tokens=64)
    stats = rec.cache_stats(l1=rec.l1(evicted_tokens=7), l2=rec.l2(evicted_tokens=9), l3=l3)
    s = _samples(_scrape(stats))
    assert s[("hicache_evicted_tokens_total", "l1")] == 7
    assert s[("hicache_evicted_tokens_total", "l2")] == 9
    assert s[("hicache_evicted_tokens_total", "l3")] == 3 * 64


def test_request_histograms_and_counters():
    m = Metrics(lambda: None)
    now = time.monotonic()
    done = SimpleNamespace(finish_reason="length", completion_tokens=5)
    m.request_finished(done, now - 2.0, now - 1.0, now - 0.2)
    aborted = SimpleNamespace(finish_reason="abort", completion_tokens=0)
    m.request_finished(aborted, now - 1.0, None, None)
    s = _samples(generate_latest(m.registry).decode())
    assert s[("hicache_time_to_first_token_seconds_count", "")] == 1
    assert s[("hicache_request_time_per_output_token_seconds_count", "")] == 1
    assert s[("hicache_e2e_request_latency_seconds_count", "")] == 1  # aborts not counted
    assert s[("hicache_generation_tokens_total", "")] == 5
    assert s[("hicache_requests_total", "length")] == s[("hicache_requests_total", "abort")] == 1


# Fields the traffic below leaves at 0, and why; every other field of every record must be
# non-zero after it. Those produced only under faults, contention or policies have tests of
# their own (tests/unit/test_stats.py, test_storage_pipeline.py, test_storage_file.py,
# tests/e2e/test_hicache_pressure.py, test_redis_l3.py).
STRUCTURAL = {  # zero by definition (hicache/observe/stats.py)
    "l1": {"errors"},
    "l3": {
        "evictable_tokens",
        "pinned_tokens",
        "promoted_tokens",
        "demoted_tokens",
        "bytes_in",
        "bytes_out",
    },
}
IDLE = {  # in flight or locked: nothing is once the traffic is over
    "l1": {"pinned_tokens", "held_by_requests_tokens"},
    "l2": {"pinned_tokens", "pending_free_tokens", "ongoing_writes"},
    "l3": {"pending_backups", "deferred_backups", "pending_prefetches"},
    "": {"running_requests", "waiting_requests"},
}
UNEXERCISED = {  # faults, contention, policies this traffic has none of
    "l2": {"errors"},
    "l3": {
        "errors",
        "misses",
        "corrupt",
        "vanished",
        "backup_failed_objects",
        "prefetch_misses",
        "repaired_objects",
        "backup_skipped_present",
        "backup_deferred",
        "backup_dropped_nodes",
        "backup_gated_nodes",
        "prefetch_skipped",
        "prefetch_cancelled",
        "prefetch_yielded",
        "prefetch_partial",
        "prefetch_discarded_tokens",
        "backend_figures",
        "backend_details",
    },
    "": {"retractions"},
}


def _zero(stats: CacheStats) -> dict[str, set[str]]:
    """{tier or "": the fields that are 0 (or empty)}."""
    out: dict[str, set[str]] = {}
    for name, record in (("l1", stats.l1), ("l2", stats.l2), ("l3", stats.l3), ("", stats)):
        assert record is not None, name
        out[name] = {
            f.name
            for f in dataclasses.fields(record)
            if f.name not in ("l1", "l2", "l3") and not getattr(record, f.name)
        }
    return out


def test_engine_traffic_fills_every_tier_family(tiny_llama_dir, tmp_path):
    """Regression: the per-tier transfer families were always empty and L2 / L3 evictions
    missing (the collector read stats keys the tree does not have). Traffic that hits L1,
    demotes L1 -> L2, loads L2 -> L1, evicts L2, writes / reads L3 and evicts L3 (a small
    cap) fills every field of the engine's record but those listed above, and Prometheus and
    GetCacheStats carry the record's numbers."""
    gen = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    # NOTE: objects are ~8 KiB (16 tokens of this model); a 0.0004 GB cap (~51 objects) keeps
    # the first turn and 8 fillers, and overflows with 8 more
    opts = {
        "enable_hierarchical_cache": True,
        "max_total_tokens": 256,
        "page_size": 16,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "kv"),
        "hicache_storage_size_gb": 0.0004,
        "hicache_storage_page_size": 16,
        "hicache_prefetch_threshold": 0,
        "hicache_storage_prefetch_policy": "wait_complete",
        "debug_check_invariants": True,
    }
    conv = _prompts(1, seed=11)[0]
    with Engine(tiny_llama_dir, **opts) as eng:
        metrics = Metrics(eng.cache_stats)
        first = eng.generate(conv, gen)
        assert eng.generate(conv, gen).cached_tokens_per_tier.get("l1", 0) > 0
        _wait_in_l3(eng, conv + first.token_ids)
        for p in _prompts(8, seed=98, length=70):  # out of L1 (256) and L2 (512)
            eng.generate(p, gen)
        second = eng.generate(conv + first.token_ids + [5, 6, 7], gen)
        assert second.cached_tokens_per_tier.get("l3", 0) > 0
        fillers = _prompts(8, seed=97, length=70)
        for p in fillers:  # past the L3 cap
            eng.generate(p, gen)
        deadline = time.monotonic() + 60
        while eng.cache_stats().l3.evicted_tokens == 0:  # backups land asynchronously
            assert time.monotonic() < deadline, "no L3 eviction"
            time.sleep(0.02)
        eng.call_in_scheduler(lambda s: flush_tier(s.tree_cache, "l1"))  # demoted to L2
        assert eng.generate(fillers[-1], gen).cached_tokens_per_tier.get("l2", 0) > 0
        _wait_backups_landed(eng)
        stats = eng.cache_stats()
        s = _samples(generate_latest(metrics.registry).decode())
    for tier in ("l1", "l2", "l3"):
        assert s[("hicache_evicted_tokens_total", tier)] > 0, tier
        assert s[("hicache_num_used_tokens", tier)] > 0, tier
        assert s[("hicache_max_total_num_tokens", tier)] > 0, tier
        assert s[("hicache_prefix_cache_hits_total", tier)] > 0, tier
    assert s[("hicache_prefix_cache_queries_total", "")] >= sum(
        s[("hicache_prefix_cache_hits_total", t)] for t in ("l1", "l2", "l3")
    )
    for name in (
        "hicache_demoted_tokens_total",
        "hicache_load_back_tokens_total",
        "hicache_load_back_bytes_total",
        "hicache_host_backup_bytes_total",
        "hicache_backuped_tokens_total",
        "hicache_backuped_bytes_total",
        "hicache_prefetched_tokens_total",
        "hicache_prefetched_bytes_total",
    ):
        assert s[(name, "")] > 0, name
    # L3 counts objects; the record and the families are in tokens
    S = stats.l3.object_tokens
    assert stats.l3.evicted_tokens % S == 0 and stats.l3.used_tokens % S == 0
    assert s[("hicache_backuped_tokens_total", "")] % S == 0
    # every field is produced: non-zero unless listed above
    zero = _zero(stats)
    for tier, fields in zero.items():
        allowed = STRUCTURAL.get(tier, set()) | IDLE.get(tier, set()) | UNEXERCISED.get(tier, set())
        assert fields <= allowed, (tier, fields - allowed)
    for tier, fields in STRUCTURAL.items():
        assert fields <= zero[tier], tier
    # the same record, copied 1:1 into Prometheus and GetCacheStats
    rec.assert_metrics_equal(rec.samples(_scrape(stats)), stats)
    rec.assert_message_equals(stats_message(stats, 0, 0), stats)


def test_tenant_families():
    stats = rec.cache_stats(l1=rec.l1(used_tokens=10, capacity_tokens=100))
    tenants = {
        "acme": {
            "cached": {"l1": 40, "l2": 8, "l3": 0},
            "quota": {"l1": 64, "l2": 0, "l3": 0},
            "evicted": {"l1": 205, "l2": 0, "l3": 0},
        }
    }
    s = {
        (x.name, x.labels.get("tenant"), x.labels.get("tier")): x.value
        for f in text_string_to_metric_families(_scrape(stats, tenants))
        for x in f.samples
    }
    assert s[("hicache_tenant_cached_tokens", "acme", "l1")] == 40
    assert s[("hicache_tenant_quota_tokens", "acme", "l1")] == 64
    assert s[("hicache_tenant_quota_evicted_tokens_total", "acme", "l1")] == 205
    assert not any(
        name.startswith("hicache_tenant")
        for name, _ in _samples(_scrape(rec.cache_stats(l1=rec.l1(used_tokens=1))))
    )
