"""Prometheus metrics on --metrics-port: the cache tiers (from engine.cache_stats() at scrape
time), the scheduler queues, and request latencies measured at the gRPC edge.

Names follow SGLang's and vLLM's where they export the same quantity (`sglang:num_used_tokens`
-> `hicache_num_used_tokens`), with our prefix and an underscore: Prometheus reserves ':' for
recording rules. Every family is listed in docs/daemon.md, "Metrics"."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)
TIERS = ("l1", "l2", "l3")

# per-tier gauges: name -> (stats key in each tier's dict, help)
_TIER_GAUGES = {
    "hicache_max_total_num_tokens": ("capacity_tokens", "Capacity of the tier in tokens"),
    "hicache_num_used_tokens": ("used_tokens", "Tokens of the tier in use"),
    "hicache_num_evictable_tokens": ("evictable_tokens",
                                     "Cached tokens the tier can evict now (unlocked leaves)"),
    "hicache_num_protected_tokens": ("protected_tokens",
                                     "Cached tokens locked by running requests or pins"),
}
# evicted tokens per tier: (stats key, its unit in tokens: 1 or the stats key holding it)
_EVICTED: dict[str, tuple[str, int | str]] = {
    "l1": ("evicted_tokens", 1), "l2": ("evictions", 1),
    "l3": ("evictions", "object_tokens")}  # NOTE: L3 counts objects
# tier -> transfers between tiers: name -> (stats key, its unit in tokens as in _EVICTED, help)
_TRANSFERS: dict[str, dict[str, tuple[str, int | str, str]]] = {
    "l2": {
        "hicache_load_back_tokens_total": ("promotions", 1, "Tokens loaded L2 -> L1"),
        "hicache_load_back_bytes_total": ("bytes_h2d", 1, "Bytes copied L2 -> L1"),
        "hicache_host_backup_bytes_total": ("bytes_d2h", 1, "Bytes copied L1 -> L2"),
        "hicache_demoted_tokens_total": (
            "demotions", 1, "L1 tokens evicted with their KV kept in L2 (part of evicted l1)"),
    },
    "l3": {
        "hicache_backuped_tokens_total": ("backup_objects", "object_tokens",
                                          "Tokens written L2 -> L3"),
        "hicache_backuped_bytes_total": ("bytes_written", 1, "Bytes written to L3"),
        "hicache_prefetched_tokens_total": ("prefetch_tokens", 1,
                                            "Tokens prefetches read L3 -> L2"),
        "hicache_prefetched_bytes_total": ("bytes_read", 1, "Bytes read from L3"),
    },
}


def _tokens(d: dict[str, Any], key: str, unit: int | str) -> float | None:
    """``d[key]`` times its unit (1, or ``d[unit]``: tokens per L3 object); None when the tier
    does not report it."""
    if key not in d or (isinstance(unit, str) and unit not in d):
        return None
    return float(d[key]) * float(d[unit] if isinstance(unit, str) else unit)


class CacheCollector:
    """Reads the engine's cache stats on every scrape (a cheap call on the scheduler thread)."""

    def __init__(self, stats_fn: Callable[[], dict[str, Any] | None]):
        self.stats_fn = stats_fn

    def collect(self) -> Iterator[Any]:
        try:
            stats = self.stats_fn()
        except Exception:
            log.debug("cache stats unavailable for metrics", exc_info=True)
            stats = None
        if not stats:
            return
        tiers = {t: stats[t] for t in TIERS if isinstance(stats.get(t), dict)}
        yield from _tier_families(tiers)
        yield CounterMetricFamily(
            "hicache_prefix_cache_queries_total",
            "Prompt tokens looked up in the cache (each admitted request once)",
            value=float(stats.get("prompt_tokens", 0)),
        )
        for tier, transfers in _TRANSFERS.items():
            d = tiers.get(tier)
            for name, (key, unit, doc) in transfers.items():
                value = _tokens(d, key, unit) if d is not None else None
                if value is not None:
                    yield CounterMetricFamily(name, doc, value=value)
        yield from _l3_families(tiers.get("l3"))
        yield from _tenant_families(stats.get("tenants"))
        yield GaugeMetricFamily(
            "hicache_num_requests_running",
            "Requests in the running batch",
            value=float(stats.get("running_requests", 0)),
        )
        yield GaugeMetricFamily(
            "hicache_num_requests_waiting",
            "Requests waiting to be scheduled",
            value=float(stats.get("waiting_requests", 0)),
        )


def _tier_families(tiers: dict[str, dict[str, Any]]) -> Iterator[Any]:
    for name, (key, doc) in _TIER_GAUGES.items():
        g = GaugeMetricFamily(name, doc, labels=["tier"])
        for tier, d in tiers.items():
            # NOTE: an L3 without a cap (a Redis without maxmemory) reports capacity 0
            if key in d and not (key == "capacity_tokens" and not d[key]):
                g.add_metric([tier], float(d[key]))
        yield g
    usage = GaugeMetricFamily("hicache_token_usage", "Used / capacity tokens of the tier (0-1)",
                              labels=["tier"])
    for tier, d in tiers.items():
        if d.get("capacity_tokens") and "used_tokens" in d:
            usage.add_metric([tier], float(d["used_tokens"]) / float(d["capacity_tokens"]))
    yield usage
    hits = CounterMetricFamily("hicache_prefix_cache_hits_total",
                               "Prompt tokens found cached, by the tier that served them",
                               labels=["tier"])
    evicted = CounterMetricFamily("hicache_evicted_tokens_total",
                                  "Tokens evicted from the tier", labels=["tier"])
    for tier, d in tiers.items():
        if "hit_tokens" in d:
            hits.add_metric([tier], float(d["hit_tokens"]))
        value = _tokens(d, *_EVICTED[tier])
        if value is not None:
            evicted.add_metric([tier], value)
    yield hits
    yield evicted


def _tenant_families(tenants: dict[str, dict[str, dict[str, int]]] | None) -> Iterator[Any]:
    """Per tenant and tier: cached tokens, quota (0 = none), tokens evicted for the quota."""
    if not tenants:
        return
    cached = GaugeMetricFamily("hicache_tenant_cached_tokens",
                               "Tokens the tenant's namespaces hold in the tier",
                               labels=["tenant", "tier"])
    quota = GaugeMetricFamily("hicache_tenant_quota_tokens",
                              "The tenant's quota on the tier in tokens (0 = none)",
                              labels=["tenant", "tier"])
    evicted = CounterMetricFamily("hicache_tenant_quota_evicted_tokens",
                                  "Tokens evicted from the tier to keep the tenant in its quota",
                                  labels=["tenant", "tier"])
    for name, d in sorted(tenants.items()):
        for tier in TIERS:
            cached.add_metric([name, tier], float(d["cached"].get(tier, 0)))
            quota.add_metric([name, tier], float(d["quota"].get(tier, 0)))
            evicted.add_metric([name, tier], float(d["evicted"].get(tier, 0)))
    yield cached
    yield quota
    yield evicted


# the L3 backend's own figures: stats key -> (metric name, help, counter?)
_L3 = {
    "prefetch_objects": ("hicache_l3_prefetch_objects", "L3 objects read by prefetches", True),
    "prefetch_started": ("hicache_l3_prefetches", "Prefetches started", True),
    "prefetch_cancelled": ("hicache_l3_prefetch_cancelled", "Prefetches cancelled", True),
    "prefetch_yielded": ("hicache_l3_prefetch_yielded",
                         "Prefetches that gave their L2 room to a request going first", True),
    "backup_deferred": ("hicache_l3_backup_deferred_nodes",
                        "Node backups that waited for room (too many in flight)", True),
    "backup_dropped_nodes": ("hicache_l3_backup_dropped_nodes",
                             "Deferred node backups dropped: the node left L2 first", True),
    "repaired_objects": ("hicache_l3_repaired_objects", "Lost objects written again", True),
    "errors": ("hicache_l3_errors", "L3 errors", True),
    "backup_failed_objects": ("hicache_l3_backup_failed_objects",
                              "Objects a backup could not store", True),
    "vanished": ("hicache_l3_vanished_objects", "Objects found gone or damaged", True),
    "bytes": ("hicache_l3_bytes", "Bytes of the objects in L3", False),
    "hits": ("hicache_l3_object_hits", "Objects read", True),
    "misses": ("hicache_l3_object_misses", "Objects asked for and not there", True),
    "corrupt": ("hicache_l3_corrupt_objects", "Objects found damaged (removed)", True),
    "read_bytes_per_s": ("hicache_l3_read_bandwidth_bytes_per_second",
                         "Read bandwidth (payload bytes / time in reads)", False),
    "write_bytes_per_s": ("hicache_l3_write_bandwidth_bytes_per_second",
                          "Write bandwidth (payload bytes / time in writes)", False),
    "rtt_us": ("hicache_l3_round_trip_microseconds", "Round-trip latency to the L3 server",
               False),
    "connected": ("hicache_l3_connected", "1 while the L3 server answers", False),
    "outages": ("hicache_l3_outages", "Times the L3 server became unreachable", True),
    "pending_backups": ("hicache_l3_pending_backups", "Backups in flight", False),
    "pending_prefetches": ("hicache_l3_pending_prefetches", "Prefetches in flight", False),
}


def _l3_families(l3: dict[str, Any] | None) -> Iterator[Any]:
    if l3 is None:
        return
    info = GaugeMetricFamily("hicache_l3_backend_info", "The attached L3 backend (value 1)",
                             labels=["backend", "address"])
    info.add_metric([str(l3.get("backend", "")), str(l3.get("address", ""))], 1.0)
    yield info
    for key, (name, doc, counter) in _L3.items():
        if key in l3:
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            yield cls(name, doc, value=float(l3[key]))


class Metrics:
    def __init__(self, stats_fn: Callable[[], dict[str, Any] | None]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "hicache_time_to_first_token_seconds",
            "Time from the Generate call to its first token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tpot = Histogram(
            "hicache_request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1)",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.e2e = Histogram(
            "hicache_e2e_request_latency_seconds",
            "Time from the Generate call to its end (requests not aborted)",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.requests = Counter(
            "hicache_requests_total", "Finished Generate requests", ["finish_reason"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "hicache_generation_tokens_total", "Output tokens of finished Generate requests",
            registry=r,
        )
        self.streams = Gauge("hicache_active_streams", "Open Generate streams", registry=r)
        self.admin_evictions = Counter(
            "hicache_admin_evicted_tokens_total",
            "Tokens evicted through the Evict RPC",
            ["tier"],
            registry=r,
        )
        r.register(CacheCollector(stats_fn))
        self._server: Any = None

    def stream_started(self) -> None:
        self.streams.inc()

    def stream_ended(self) -> None:
        self.streams.dec()

    def request_finished(
        self, chunk: Any, t0: float, t_first: float | None, t_last: float | None
    ) -> None:
        """``chunk``: the final StreamChunk; times are time.monotonic() of the call, its first
        and its last token (None: no token)."""
        reason = chunk.finish_reason or "unknown"
        self.requests.labels(reason).inc()
        self.generation_tokens.inc(chunk.completion_tokens)
        if reason != "abort":
            self.e2e.observe(time.monotonic() - t0)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if t_last is not None and chunk.completion_tokens > 1:
                self.tpot.observe((t_last - t_first) / (chunk.completion_tokens - 1))

    def admin_evicted(self, tier: str, tokens: int) -> None:
        self.admin_evictions.labels(tier).inc(tokens)

    def exposition(self) -> bytes:
        """The Prometheus text format of every family (what /metrics answers)."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP server; returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
