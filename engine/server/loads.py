"""What a gateway reads for load: SGLang's `/v1/loads` report, built from engine.cache_stats().

The same report answers HTTP `GET /v1/loads` (and `/loads`) and the SglangScheduler GetLoads
RPC, so a gateway sees one set of figures whichever way it polls. Field names are SGLang's
(`SchedulerLoad` / `AggregateMetrics` in smg-grpc-proto's sglang_scheduler.proto): routers
(SMG's power_of_two / least_load, SGLang's own router) read `loads[].num_used_tokens`,
`loads[].num_total_tokens` or `aggregate.total_tokens` depending on their version; all are here.

hicache runs one scheduler (one data-parallel rank), so `loads` has one entry. Figures the
daemon does not measure (generation throughput, utilisation) are left out rather than reported
as zero.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterable
from typing import Any

from hicache.observe.stats import CacheStats
from hicache.tier import Tier

# `include` sections a caller may ask for (SGLang's, and hicache's `tiers`); "core" is always
# there. NOTE: "spec" and "lora" are accepted and answered by their absence: the daemon has no
# speculative decoding and no LoRA.
SECTIONS = frozenset({"core", "queues", "memory", "disagg", "spec", "lora", "tiers", "all"})


def daemon_version() -> str:
    """The installed hicache distribution's version (a source tree run without installing it
    has none)."""
    try:
        return importlib.metadata.version("hicache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class UnknownSectionError(ValueError):
    """An `include` value that is not one of SECTIONS."""


def parse_include(values: Iterable[str]) -> frozenset[str]:
    """`include=core,queues` (repeated or comma-separated) -> the sections; unknown -> error."""
    parts = {p.strip() for v in values for p in v.split(",") if p.strip()}
    unknown = sorted(parts - SECTIONS)
    if unknown:
        raise UnknownSectionError(
            f"unknown load section(s) {', '.join(unknown)}; known: {', '.join(sorted(SECTIONS))}"
        )
    return frozenset(parts) | {"core"}


def loads_report(
    stats: CacheStats,
    max_running_requests: int,
    version: str,
    include: frozenset[str] = frozenset({"core"}),
) -> dict[str, Any]:
    """SGLang's GetLoadsResponse as a dict (proto field names), from cache_stats()."""
    every = "all" in include
    # NOTE: as SGLang counts it: the L1 tokens that cannot be freed now (running requests' KV,
    # pinned prefixes), not the cached prefixes an allocation would evict. A gateway reads
    # token_usage as pressure: SMG leaves a worker at >= 0.8 out of routing (its default
    # overload protection), which a cache kept full of evictable prefixes must not trigger.
    capacity = stats.l1.capacity_tokens
    used = stats.l1.used_tokens - stats.l1.evictable_tokens
    running, waiting = stats.running_requests, stats.waiting_requests
    usage = used / capacity if capacity else 0.0
    load: dict[str, Any] = {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "max_total_num_tokens": capacity,
        "token_usage": usage,
        "cache_hit_rate": stats.hit_rate,
        "max_running_requests": int(max_running_requests),
    }
    if every or "queues" in include:
        load["queues"] = {"waiting": waiting}
    if every or "memory" in include:
        load["memory"] = {"token_capacity": capacity}
    if every or "disagg" in include:
        load["disaggregation"] = {"mode": "null"}  # SGLang's word for "not disaggregated"
    report: dict[str, Any] = {
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "version": version,
        "dp_rank_count": 1,
        "loads": [load],
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "total_tokens": used,
            "avg_token_usage": usage,
        },
    }
    if every or "tiers" in include:
        # hicache's own section: every tier's occupancy, for a router that knows the hierarchy
        report["tiers"] = {
            tier.value: {"capacity_tokens": s.capacity_tokens, "used_tokens": s.used_tokens}
            for tier in Tier
            if (s := stats.tier(tier)) is not None
        }
    return report
