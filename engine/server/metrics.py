"""Prometheus metrics on --metrics-port: per-tier cache tokens (from engine.cache_stats() at
scrape time), queue depth, and request latency histograms measured at the gRPC edge."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)
TIERS = ("l1", "l2", "l3")
_TIER_GAUGES = ("capacity_tokens", "used_tokens", "evictable_tokens", "protected_tokens")
_TIER_COUNTERS = {
    "hit_tokens": "hit_tokens",
    "evicted_tokens": "evicted_tokens",
    "promoted_tokens": "transfer_promoted_tokens",
    "demoted_tokens": "transfer_demoted_tokens",
    "bytes_in": "transfer_bytes_in",
    "bytes_out": "transfer_bytes_out",
}


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
        for key in _TIER_GAUGES:
            g = GaugeMetricFamily(
                f"hicache_cache_{key}", f"Cache {key.replace('_', ' ')}", labels=["tier"]
            )
            for tier in TIERS:
                if isinstance(stats.get(tier), dict) and key in stats[tier]:
                    g.add_metric([tier], float(stats[tier][key]))
            yield g
        for key, name in _TIER_COUNTERS.items():
            c = CounterMetricFamily(
                f"hicache_cache_{name}", f"Cache {name.replace('_', ' ')}", labels=["tier"]
            )
            for tier in TIERS:
                if isinstance(stats.get(tier), dict) and key in stats[tier]:
                    c.add_metric([tier], float(stats[tier][key]))
            yield c
        yield from _l3_families(stats.get("l3"))
        yield CounterMetricFamily(
            "hicache_cache_miss_tokens",
            "Prompt tokens computed",
            value=float(stats.get("miss_tokens", 0)),
        )
        yield GaugeMetricFamily(
            "hicache_queue_depth",
            "Requests waiting to be scheduled",
            value=float(stats.get("waiting_requests", 0)),
        )
        yield GaugeMetricFamily(
            "hicache_running_requests",
            "Requests in the running batch",
            value=float(stats.get("running_requests", 0)),
        )


# L3 pipeline: stats key -> (metric name, help, counter?)
_L3 = {
    "backup_objects": ("hicache_l3_backup_objects", "L3 objects written by backups", True),
    "prefetch_objects": ("hicache_l3_prefetch_objects", "L3 objects read by prefetches", True),
    "prefetch_tokens": ("hicache_l3_prefetch_tokens", "Tokens prefetches put in L2", True),
    "prefetch_started": ("hicache_l3_prefetches", "Prefetches started", True),
    "prefetch_cancelled": ("hicache_l3_prefetch_cancelled", "Prefetches cancelled", True),
    "backup_deferred": ("hicache_l3_backup_deferred_nodes",
                        "Node backups that waited for room (too many in flight)", True),
    "backup_dropped_nodes": ("hicache_l3_backup_dropped_nodes",
                             "Deferred node backups dropped: the node left L2 first", True),
    "repaired_objects": ("hicache_l3_repaired_objects", "Lost objects written again", True),
    "errors": ("hicache_l3_errors", "L3 errors", True),
    "vanished": ("hicache_l3_vanished_objects", "Objects found gone or damaged", True),
    "objects": ("hicache_l3_objects", "Objects in L3", False),
    "bytes": ("hicache_l3_bytes", "Bytes of the objects in L3", False),
    "hits": ("hicache_l3_object_hits", "Objects read", True),
    "misses": ("hicache_l3_object_misses", "Objects asked for and not there", True),
    "corrupt": ("hicache_l3_corrupt_objects", "Objects found damaged (removed)", True),
    "bytes_read": ("hicache_l3_read_bytes", "Payload bytes read from L3", True),
    "bytes_written": ("hicache_l3_written_bytes", "Payload bytes written to L3", True),
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


def _l3_families(l3: Any) -> Iterator[Any]:
    if not isinstance(l3, dict):
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
            "Time to first token",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tpot = Histogram(
            "hicache_time_per_output_token_seconds",
            "Mean time per output token after the first",
            registry=r,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.requests = Counter(
            "hicache_requests", "Finished generate requests", ["finish_reason"], registry=r
        )
        self.request_hit_tokens = Counter(
            "hicache_request_cached_tokens",
            "Prompt tokens served from the cache",
            ["tier"],
            registry=r,
        )
        self.streams = Gauge("hicache_active_streams", "Open Generate streams", registry=r)
        self.admin_evictions = Counter(
            "hicache_admin_evicted_tokens",
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
        self.requests.labels(chunk.finish_reason or "unknown").inc()
        for tier, n in (chunk.cached_tokens_per_tier or {}).items():
            if tier in TIERS and n:
                self.request_hit_tokens.labels(tier).inc(n)
        if t_first is not None:
            self.ttft.observe(t_first - t0)
            if t_last is not None and chunk.completion_tokens > 1:
                self.tpot.observe((t_last - t_first) / (chunk.completion_tokens - 1))

    def admin_evicted(self, tier: str, tokens: int) -> None:
        self.admin_evictions.labels(tier).inc(tokens)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Starts the /metrics HTTP server; returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
