"""The processes of tools/bench_gateway.py: `hicache serve` daemons and the SMG gateway in front
of them, started until ready, and the counters a run reads from them before they stop."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx2

from engine.client.grpc_client import HicacheClient
from tests.gateway_process import gateway_ready, start_smg
from tools.benchlib import daemon_env, free_port, stop_process, wait_until

ROOT = Path(__file__).resolve().parents[1]
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
RETRY = (httpx2.HTTPError, OSError)


@dataclass(frozen=True)
class Daemon:
    proc: subprocess.Popen
    grpc_port: int
    http_port: int


@dataclass(frozen=True)
class Gateway:
    proc: subprocess.Popen
    url: str
    metrics_url: str


def start_daemons(
    model: str | None, n: int, work: Path, extra: list[str], out: list[Daemon]
) -> None:
    """Starts ``n`` daemons into ``out`` (the caller stops them, ready or not)."""
    for i in range(n):
        port, http = free_port(), free_port()
        (work / f"d{i}").mkdir(parents=True, exist_ok=True)
        log = open(work / f"daemon{i}.log", "w")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.client.cli",
                "serve",
                *(["--model", model] if model else []),
                "--port",
                str(port),
                "--http-port",
                str(http),
                "--served-model-name",
                "bench",
                *extra,
            ],
            cwd=ROOT,
            env=daemon_env(work / f"d{i}"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        out.append(Daemon(proc, port, http))
    for i, d in enumerate(out):
        wait_until(
            lambda d=d: httpx2.get(f"http://127.0.0.1:{d.http_port}/health").is_success,
            f"daemon {work / f'daemon{i}.log'}",
            proc=d.proc,
            retry_on=RETRY,
        )


def start_gateway(smg: str, urls: list[str], policy: str, log: Path) -> Gateway:
    """`smg launch` in front of ``urls`` (tests.gateway_process.start_smg: the e2e tests' argv),
    once its /readiness counts every worker healthy (gateway_ready: a gRPC gateway lists the
    model before it can serve). Its output is appended to ``log`` (a restarted gateway's too)."""
    proc = start_smg(urls, log, "--policy", policy, binary=smg)
    gw = Gateway(proc.popen, proc.url, proc.metrics_url)
    try:
        wait_until(
            lambda: gateway_ready(gw.url, "bench", len(urls)),
            f"gateway {log}",
            proc=gw.proc,
            retry_on=RETRY,
        )
    except BaseException:
        stop_process(gw.proc)
        raise
    return gw


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
        text = httpx2.get(f"http://127.0.0.1:{d.http_port}/metrics").text
        for name, tier, value in pat.findall(text):
            out[f"{names[name]}_{tier}"] = out.get(f"{names[name]}_{tier}", 0.0) + float(value)
        l3 = HicacheClient(f"127.0.0.1:{d.grpc_port}").cache_stats().tiers[2]  # L1, L2, L3
        if l3.enabled:
            for k in L3_COUNTERS:
                out[f"l3_{k}"] = out.get(f"l3_{k}", 0.0) + l3.extra.get(k, 0.0)
            out["object_tokens"] = l3.extra["object_tokens"]
    return out
