"""What tools/bench_gateway.py reads from its SMG gateway and its daemons before they stop: the
gateway's routing counters, the daemons' prefix-cache hits per tier, capacity, evictions and L3
counters."""

from __future__ import annotations

import re

import httpx2

from engine.client.grpc_client import HicacheClient
from tools.benchlib.daemon import Daemon
from tools.benchlib.peers import Gateway

# the daemons' L3 counters a run records (GetCacheStats, summed over its daemons)
L3_COUNTERS = (
    "prefetch_started",
    "prefetch_tokens",
    "prefetch_skipped",
    "prefetch_partial",
    "prefetch_yielded",
    "prefetch_discarded_tokens",
    "backup_deferred",
    "backup_dropped_nodes",
    "hits",
    "misses",
    "errors",
)


def gateway_counters(gw: Gateway) -> dict[str, float]:
    """The gateway's routing counters, over its workers: cache_aware's branch taken per request
    (``branch_<name>``) and the requests its overload protection sent elsewhere."""
    out: dict[str, float] = {}
    text = httpx2.get(gw.metrics_url, timeout=30).text
    for name, labels, value in re.findall(r"^(smg_\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        if name == "smg_cache_aware_policy_branch_total":
            key = "branch_" + dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("branch", "?")
        elif name == "smg_worker_overload_fallback_total":
            key = "overload_fallback"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


def daemon_metrics(daemons: list[Daemon]) -> dict[str, float]:
    """Summed over the daemons: prefix-cache hit tokens per tier, the L1 + L2 capacity, tokens
    evicted from L1 and L2, and the L3 counters (GetCacheStats)."""
    out: dict[str, float] = {}
    names = {
        "hicache_prefix_cache_hits_total": "hits",
        "hicache_max_total_num_tokens": "capacity",
        "hicache_evicted_tokens_total": "evicted",
    }
    pat = re.compile(rf'^({"|".join(names)})\{{tier="(l[123])"\}} (\S+)$', re.MULTILINE)
    for d in daemons:
        text = httpx2.get(f"{d.url}/metrics").text
        for name, tier, value in pat.findall(text):
            out[f"{names[name]}_{tier}"] = out.get(f"{names[name]}_{tier}", 0.0) + float(value)
        l3 = HicacheClient(d.addr).cache_stats().tiers[2]  # L1, L2, L3
        if l3.enabled:
            for k in L3_COUNTERS:
                out[f"l3_{k}"] = out.get(f"l3_{k}", 0.0) + l3.extra.get(k, 0.0)
            out["object_tokens"] = l3.extra["object_tokens"]
    return out
