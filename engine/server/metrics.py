"""Prometheus metrics on --metrics-port: the cache tiers (from engine.cache_stats() at scrape
time), the scheduler queues, and request latencies measured at the API edge (every
EngineRequest: gRPC Generate, a computing Prefetch, the HTTP API, the SMG worker).

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

from hicache.observe.stats import CacheStats, L3Stats, TierStats
from hicache.tier import TIERS, Tier

log = logging.getLogger(__name__)

TenantFigures = dict[str, dict[str, dict[str, int]]]  # tenant_cache.tenant_figures

# one family per TierStats field, label tier: (name, help, counter?, the field)
_TIER_FAMILIES: tuple[tuple[str, str, bool, Callable[[TierStats], int]], ...] = (
    (
        "hicache_max_total_num_tokens",
        "Capacity of the tier in tokens",
        False,
        lambda t: t.capacity_tokens,
    ),
    ("hicache_num_used_tokens", "Tokens of the tier in use", False, lambda t: t.used_tokens),
    (
        "hicache_num_evictable_tokens",
        "Cached tokens the tier can evict now (unlocked leaves)",
        False,
        lambda t: t.evictable_tokens,
    ),
    (
        "hicache_num_protected_tokens",
        "Cached tokens locked by running requests or pins",
        False,
        lambda t: t.pinned_tokens,
    ),
    (
        "hicache_prefix_cache_hits_total",
        "Prompt tokens found cached, by the tier that served them",
        True,
        lambda t: t.hit_tokens,
    ),
    (
        "hicache_evicted_tokens_total",
        "Tokens evicted from the tier",
        True,
        lambda t: t.evicted_tokens,
    ),
    (
        "hicache_errors_total",
        "Failed operations of the tier (l2: device <-> host copies; l3: backend calls and jobs)",
        True,
        lambda t: t.errors,
    ),
)
# the traffic fields, named after the copy: L1 <-> L2 (on l1, while there is an L2) and
# L2 <-> L3 (on l2, while an L3 is attached)
_TRAFFIC: dict[Tier, tuple[tuple[str, str, Callable[[TierStats], int]], ...]] = {
    Tier.L1: (
        ("hicache_load_back_tokens_total", "Tokens loaded L2 -> L1", lambda t: t.promoted_tokens),
        ("hicache_load_back_bytes_total", "Bytes copied L2 -> L1", lambda t: t.bytes_in),
        (
            "hicache_demoted_tokens_total",
            "L1 tokens evicted with their KV kept in L2 (part of evicted l1)",
            lambda t: t.demoted_tokens,
        ),
        ("hicache_host_backup_bytes_total", "Bytes copied L1 -> L2", lambda t: t.bytes_out),
    ),
    Tier.L2: (
        (
            "hicache_prefetched_tokens_total",
            "Tokens prefetches read L3 -> L2",
            lambda t: t.promoted_tokens,
        ),
        ("hicache_prefetched_bytes_total", "Bytes read from L3", lambda t: t.bytes_in),
        ("hicache_backuped_tokens_total", "Tokens written L2 -> L3", lambda t: t.demoted_tokens),
        ("hicache_backuped_bytes_total", "Bytes written to L3", lambda t: t.bytes_out),
    ),
}
# L3's own figures: (name, help, counter?, the field)
_L3: tuple[tuple[str, str, bool, Callable[[L3Stats], int]], ...] = (
    (
        "hicache_l3_prefetch_objects",
        "L3 objects read by prefetches",
        True,
        lambda s: s.prefetch_objects,
    ),
    ("hicache_l3_prefetches", "Prefetches started", True, lambda s: s.prefetch_started),
    ("hicache_l3_prefetch_cancelled", "Prefetches cancelled", True, lambda s: s.prefetch_cancelled),
    (
        "hicache_l3_prefetch_yielded",
        "Prefetches that gave their L2 room to a request going first",
        True,
        lambda s: s.prefetch_yielded,
    ),
    (
        "hicache_l3_backup_deferred_nodes",
        "Node backups that waited for room (too many in flight)",
        True,
        lambda s: s.backup_deferred,
    ),
    (
        "hicache_l3_backup_dropped_nodes",
        "Deferred node backups dropped: the node left L2 first",
        True,
        lambda s: s.backup_dropped_nodes,
    ),
    (
        "hicache_l3_repaired_objects",
        "Lost objects written again",
        True,
        lambda s: s.repaired_objects,
    ),
    ("hicache_l3_errors", "L3 errors", True, lambda s: s.errors),
    (
        "hicache_l3_backup_failed_objects",
        "Objects a backup could not store",
        True,
        lambda s: s.backup_failed_objects,
    ),
    ("hicache_l3_vanished_objects", "Objects found gone or damaged", True, lambda s: s.vanished),
    ("hicache_l3_bytes", "Bytes of the objects in L3", False, lambda s: s.bytes),
    ("hicache_l3_object_hits", "Objects read", True, lambda s: s.hits),
    ("hicache_l3_object_misses", "Objects asked for and not there", True, lambda s: s.misses),
    ("hicache_l3_corrupt_objects", "Objects found damaged (removed)", True, lambda s: s.corrupt),
    ("hicache_l3_pending_backups", "Backups in flight", False, lambda s: s.pending_backups),
    (
        "hicache_l3_pending_prefetches",
        "Prefetches in flight",
        False,
        lambda s: s.pending_prefetches,
    ),
)
# what a backend reports of itself (L3Stats.backend_figures; Redis): key -> (name, help, counter?)
_L3_BACKEND = {
    "read_bytes_per_s": (
        "hicache_l3_read_bandwidth_bytes_per_second",
        "Read bandwidth (payload bytes / time in reads)",
        False,
    ),
    "write_bytes_per_s": (
        "hicache_l3_write_bandwidth_bytes_per_second",
        "Write bandwidth (payload bytes / time in writes)",
        False,
    ),
    "rtt_us": ("hicache_l3_round_trip_microseconds", "Round-trip latency to the L3 server", False),
    "connected": ("hicache_l3_connected", "1 while the L3 server answers", False),
    "outages": ("hicache_l3_outages", "Times the L3 server became unreachable", True),
}


def _family(
    name: str, doc: str, counter: bool, value: float | None = None, labels: list[str] | None = None
) -> Any:
    cls = CounterMetricFamily if counter else GaugeMetricFamily
    return cls(name, doc, value=value, labels=labels)


class CacheCollector:
    """Reads the engine's cache stats on every scrape (a cheap call on the scheduler thread)
    and, with tenants, their figures."""

    def __init__(
        self,
        stats_fn: Callable[[], CacheStats | None],
        tenants_fn: Callable[[], TenantFigures | None] | None = None,
    ):
        self.stats_fn = stats_fn
        self.tenants_fn = tenants_fn

    def collect(self) -> Iterator[Any]:
        try:
            stats = self.stats_fn()
            tenants = self.tenants_fn() if stats is not None and self.tenants_fn else None
        except Exception:
            log.debug("cache stats unavailable for metrics", exc_info=True)
            return
        if stats is None:
            return
        tiers = {t: s for t in Tier if (s := stats.tier(t)) is not None}
        yield from _tier_families(tiers)
        yield CounterMetricFamily(
            "hicache_prefix_cache_queries_total",
            "Prompt tokens looked up in the cache (each admitted request once)",
            value=float(stats.prompt_tokens),
        )
        for upper, families in _TRAFFIC.items():
            lower = Tier(TIERS[TIERS.index(upper) + 1])
            if upper in tiers and lower in tiers:
                for name, doc, read in families:
                    yield CounterMetricFamily(name, doc, value=float(read(tiers[upper])))
        if stats.l3 is not None:
            yield from _l3_families(stats.l3)
        yield from _tenant_families(tenants)
        yield GaugeMetricFamily(
            "hicache_num_requests_running",
            "Requests in the running batch",
            value=float(stats.running_requests),
        )
        yield GaugeMetricFamily(
            "hicache_num_requests_waiting",
            "Requests waiting to be scheduled",
            value=float(stats.waiting_requests),
        )


def _tier_families(tiers: dict[Tier, TierStats]) -> Iterator[Any]:
    for name, doc, counter, read in _TIER_FAMILIES:
        family = _family(name, doc, counter, labels=["tier"])
        for tier, s in tiers.items():
            # NOTE: an L3 without a cap (a Redis without maxmemory) reports capacity 0
            if name != "hicache_max_total_num_tokens" or s.capacity_tokens:
                family.add_metric([tier.value], float(read(s)))
        yield family
    usage = GaugeMetricFamily(
        "hicache_token_usage", "Used / capacity tokens of the tier (0-1)", labels=["tier"]
    )
    for tier, s in tiers.items():
        if s.capacity_tokens:
            usage.add_metric([tier.value], s.used_tokens / s.capacity_tokens)
    yield usage


def _tenant_families(tenants: TenantFigures | None) -> Iterator[Any]:
    """Per tenant and tier: cached tokens, quota (0 = none), tokens evicted for the quota."""
    if not tenants:
        return
    cached = GaugeMetricFamily(
        "hicache_tenant_cached_tokens",
        "Tokens the tenant's namespaces hold in the tier",
        labels=["tenant", "tier"],
    )
    quota = GaugeMetricFamily(
        "hicache_tenant_quota_tokens",
        "The tenant's quota on the tier in tokens (0 = none)",
        labels=["tenant", "tier"],
    )
    evicted = CounterMetricFamily(
        "hicache_tenant_quota_evicted_tokens",
        "Tokens evicted from the tier to keep the tenant in its quota",
        labels=["tenant", "tier"],
    )
    for name, d in sorted(tenants.items()):
        for tier in TIERS:
            cached.add_metric([name, tier], float(d["cached"].get(tier, 0)))
            quota.add_metric([name, tier], float(d["quota"].get(tier, 0)))
            evicted.add_metric([name, tier], float(d["evicted"].get(tier, 0)))
    yield cached
    yield quota
    yield evicted


def _l3_families(l3: L3Stats) -> Iterator[Any]:
    info = GaugeMetricFamily(
        "hicache_l3_backend_info",
        "The attached L3 backend (value 1)",
        labels=["backend", "address"],
    )
    info.add_metric([l3.backend, l3.address], 1.0)
    yield info
    for name, doc, counter, read in _L3:
        yield _family(name, doc, counter, value=float(read(l3)))
    for key, value in l3.backend_figures.items():
        if key in _L3_BACKEND:
            name, doc, counter = _L3_BACKEND[key]
            yield _family(name, doc, counter, value=float(value))


class Metrics:
    def __init__(
        self,
        stats_fn: Callable[[], CacheStats | None],
        tenants_fn: Callable[[], TenantFigures | None] | None = None,
    ):
        """``stats_fn``: the engine's cache stats (None: no engine yet); ``tenants_fn``: the
        tenants' figures (tenant_cache.tenant_figures), None without tenants."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "hicache_time_to_first_token_seconds",
            "Time from the request's call to its first token",
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
            "Time from the request's call to its end (requests not aborted)",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
        )
        self.requests = Counter(
            "hicache_requests_total",
            "Finished requests (Generate, Prefetch, the HTTP API, SMG's)",
            ["finish_reason"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "hicache_generation_tokens_total",
            "Output tokens of finished requests",
            registry=r,
        )
        self.streams = Gauge("hicache_active_streams", "Open request streams", registry=r)
        self.admin_evictions = Counter(
            "hicache_admin_evicted_tokens_total",
            "Tokens evicted through the Evict RPC",
            ["tier"],
            registry=r,
        )
        r.register(CacheCollector(stats_fn, tenants_fn))
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
