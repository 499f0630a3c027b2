"""Serving benchmark of the daemon as a user runs it: `hicache serve` (the embedded SmolLM2-135M
GGUF) started as a subprocess per process mode, loaded by C closed-loop streaming clients over
gRPC and over the OpenAI-compatible HTTP API.

For each mode (single: one process; split: scheduler and detokenizer in their own processes,
the daemon's default; both with --disable-overlap; "+overlap": the same with overlap scheduling
forced on by --no-disable-overlap; the daemon's default is on for an accelerator, off on the
CPU), each concurrency C and each transport: C clients, each sending one request after another
for a warm-up and then --duration-s; every request is a fresh random ~--prompt-tokens text
prompt (seeded; little prefix sharing, so the cache does not make it trivial) and streams
--max-new-tokens tokens, greedy, ignore_eos. Measured (tools/serving_load.py has the exact
windows): output tok/s, requests/s, TTFT and inter-token latency percentiles, errors; the load
average before each run and the run's header (tools/benchlib/header.py) go into the JSON as
well.

Both modes see the same prompts; each mode gets a fresh daemon and a fresh L3 directory. The
clients run on the same machine as the daemon: on a small machine they take CPU from it.

Usage: python -m tools.bench_serving [--modes single,split,split+overlap] [--concurrency 1,16,64]
           [--transports grpc,http] [--duration-s 30] [--out docs/bench_serving.json]
           [--plot docs/bench_serving.png]
       python -m tools.bench_serving --quick --out /tmp/bs.json --plot /tmp/bs.png   # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.client import AsyncHicacheClient
from tools import serving_load as sl
from tools.benchlib import (
    Header,
    cell,
    describe_machine,
    markdown_table,
    save_figure,
    subplots,
    write_json,
)
from tools.benchlib.daemon import Daemon

FULL = {"concurrency": "1,16,64", "duration_s": 30.0, "warmup_s": 5.0, "max_new_tokens": 64}
QUICK = {"concurrency": "1,4", "duration_s": 5.0, "warmup_s": 2.0, "max_new_tokens": 16}
# mode -> (--processes, daemon options)
MODES = {
    "single": ("single", ["--disable-overlap"]),
    "split": ("split", ["--disable-overlap"]),
    "single+overlap": ("single", ["--no-disable-overlap"]),
    "split+overlap": ("split", ["--no-disable-overlap"]),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--modes",
        default="single,split,split+overlap",
        help=f"comma-separated, of {','.join(MODES)}",
    )
    p.add_argument("--concurrency", help=f"client counts ({FULL['concurrency']})")
    p.add_argument("--transports", default="grpc,http")
    p.add_argument("--duration-s", type=float, help=f"measured window ({FULL['duration_s']:g})")
    p.add_argument("--warmup-s", type=float, help=f"load before the window ({FULL['warmup_s']:g})")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, help=f"({FULL['max_new_tokens']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle-s", type=float, default=2.0, help="idle pause between runs")
    p.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        help="extra `hicache serve` argument (repeatable, e.g. --daemon-arg=--x=1)",
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: concurrency 1,4, 5 s, 16 new tokens"
    )
    p.add_argument("--out", default="docs/bench_serving.json")
    p.add_argument("--plot", default="docs/bench_serving.png")
    a = p.parse_args()
    for k, v in (QUICK if a.quick else FULL).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.modes = [m for m in a.modes.split(",") if m]
    a.transports = [t for t in a.transports.split(",") if t]
    a.concurrency = [int(c) for c in str(a.concurrency).split(",") if c]
    if set(a.transports) - {"grpc", "http"} or set(a.modes) - set(MODES):
        p.error(f"--transports takes grpc,http and --modes {','.join(MODES)}")
    return a


async def one_run(
    d: Daemon, transport: str, c: int, a: argparse.Namespace, num_words: int
) -> dict[str, Any]:
    # NOTE: the seed leaves the mode out, so that both modes get the same prompts.
    make_prompt = sl.prompt_maker(f"{a.seed}-{transport}-{c}", num_words)
    if transport == "grpc":
        client = AsyncHicacheClient(d.addr, timeout=60)
        try:
            send = sl.grpc_sender(client, a.max_new_tokens)
            records, w0, w1 = await sl.closed_loop(send, c, a.warmup_s, a.duration_s, make_prompt)
        finally:
            await client.close()
    else:
        limits = sl.httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
        async with sl.httpx.AsyncClient(limits=limits) as http:
            send = sl.http_sender(http, d.url, a.max_new_tokens)
            records, w0, w1 = await sl.closed_loop(send, c, a.warmup_s, a.duration_s, make_prompt)
    return sl.summarize(records, w0, w1, a.max_new_tokens)


def bench_mode(mode: str, a: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    with tempfile.TemporaryDirectory(prefix=f"bench_serving_{mode}_") as tmp:
        processes, opts = MODES[mode]
        d = Daemon(Path(tmp), ["--processes", processes, *opts, *a.daemon_arg])
        info: dict[str, Any] = {"mode": mode, "argv": d.argv[1:]}
        result["daemons"].append(info)
        try:
            info["startup_s"] = d.start().wait_serving()
            info.update(d.facts())
            wpt = sl.words_per_token(d.addr, a.seed)
            num_words = max(1, round(a.prompt_tokens * wpt))
            info["prompt_words"] = num_words
            print(
                f"[{mode}] SERVING after {info['startup_s']:.1f}s; prompts of {num_words} words",
                flush=True,
            )
            for c in a.concurrency:
                for transport in a.transports:
                    load = os.getloadavg()
                    t0 = time.time()
                    run = asyncio.run(one_run(d, transport, c, a, num_words))
                    run = {
                        "mode": mode,
                        "transport": transport,
                        "concurrency": c,
                        "loadavg_before": load,
                        "started_at": t0,
                        **run,
                    }
                    result["runs"].append(run)
                    save()
                    print(f"[{mode}] {row(run)}", flush=True)
                    time.sleep(a.settle_s)
        except Exception as e:  # noqa: BLE001 - recorded; the other mode still runs
            info["error"] = f"{type(e).__name__}: {e}"
            print(f"[{mode}] FAILED: {info['error']}", file=sys.stderr, flush=True)
        finally:
            info["exit_code"] = d.stop()
            info["log_problems"] = d.log_problems()[:20]
            save()


# --- report -----------------------------------------------------------------------------------
HEADER = [
    "mode",
    "transport",
    "conc",
    "out tok/s",
    "req/s",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "ITL p50 ms",
    "ITL p99 ms",
    "errors",
]


def cells(r: dict[str, Any]) -> list[str]:
    return [
        r["mode"],
        r["transport"],
        str(r["concurrency"]),
        cell(r["out_tok_s"]),
        cell(r["req_s"], ".2f"),
        cell(r["ttft_ms"]["p50"]),
        cell(r["ttft_ms"]["p99"]),
        cell(r["itl_ms"]["p50"]),
        cell(r["itl_ms"]["p99"]),
        str(r["errors"]),
    ]


def row(r: dict[str, Any]) -> str:
    return "| " + " | ".join(cells(r)) + " |"


def table(runs: list[dict[str, Any]]) -> str:
    return markdown_table(HEADER, [cells(r) for r in runs])


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mode / single at each (transport, concurrency) that both ran."""
    by = {(r["mode"], r["transport"], r["concurrency"]): r for r in runs}

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    out = []
    for (mode, transport, c), split in by.items():
        single = by.get(("single", transport, c))
        if mode == "single" or single is None:
            continue
        out.append(
            {
                "mode": mode,
                "transport": transport,
                "concurrency": c,
                "out_tok_s": div(split["out_tok_s"], single["out_tok_s"]),
                "ttft_p50": div(split["ttft_ms"]["p50"], single["ttft_ms"]["p50"]),
                "itl_p50": div(split["itl_ms"]["p50"], single["itl_ms"]["p50"]),
            }
        )
    return out


def ratio_table(rs: list[dict[str, Any]]) -> str:
    """Each mode over single (the ratios)."""
    return markdown_table(
        [
            "mode",
            "transport",
            "conc",
            "out tok/s / single",
            "TTFT p50 / single",
            "ITL p50 / single",
        ],
        [
            [
                r["mode"],
                r["transport"],
                r["concurrency"],
                cell(r["out_tok_s"], ".2f"),
                cell(r["ttft_p50"], ".2f"),
                cell(r["itl_p50"], ".2f"),
            ]
            for r in rs
        ],
    )


# a color per mode, a line style per transport
COLORS = {
    "single": "tab:blue",
    "split": "tab:orange",
    "split+overlap": "tab:green",
    "single+overlap": "tab:purple",
}
STYLES = {"grpc": "-", "http": "--"}


def plot(result: dict[str, Any], path: str) -> None:
    panels = [
        ("out_tok_s", None, "output tok/s"),
        ("ttft_ms", "p50", "TTFT p50 (ms)"),
        ("itl_ms", "p50", "ITL p50 (ms)"),
    ]
    fig, axes = subplots(1, 3, figsize=(15, 4.5))
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    series = sorted({(r["mode"], r["transport"]) for r in result["runs"]})
    for ax, (key, sub, title) in zip(axes, panels, strict=True):
        for mode, transport in series:
            rs = sorted(
                (r for r in result["runs"] if (r["mode"], r["transport"]) == (mode, transport)),
                key=lambda r: r["concurrency"],
            )
            ys = [r[key] if sub is None else r[key][sub] for r in rs]
            ys = [float("nan") if y is None else y for y in ys]
            ax.plot(
                [r["concurrency"] for r in rs],
                ys,
                marker="o",
                color=COLORS[mode],
                linestyle=STYLES[transport],
                label=f"{mode} / {transport}",
            )
        ax.set_xscale("log", base=2)
        cs = sorted({r["concurrency"] for r in result["runs"]})
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent streams")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key == "ttft_ms":  # queueing at high concurrency spans decades
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
    axes[0].legend()
    cfg = result["config"]
    fig.suptitle(
        f"hicache serve, SmolLM2-135M: {cfg['prompt_tokens']}-token prompts, "
        f"{cfg['max_new_tokens']} new tokens, {cfg['duration_s']:g} s per point; "
        f"{describe_machine(result['machine'])}",
        fontsize=10,
    )
    save_figure(fig, path)


def main() -> int:
    a = parse_args()
    header = Header.now()
    result: dict[str, Any] = {
        **header.record(),
        "config": {
            k: getattr(a, k)
            for k in (
                "modes",
                "transports",
                "concurrency",
                "duration_s",
                "warmup_s",
                "prompt_tokens",
                "max_new_tokens",
                "seed",
                "quick",
            )
        },
        "daemons": [],
        "runs": [],
    }

    def save() -> None:
        result.update(header.record([a.plot] if result["runs"] else []))
        result["ratios_over_single"] = ratios(result["runs"])
        write_json(a.out, result)

    for mode in a.modes:
        bench_mode(mode, a, result, save)
    if result["runs"] and a.plot:
        plot(result, a.plot)
    save()
    print("\n" + header.markdown(result["plots"]) + "\n\n" + table(result["runs"]))
    if result["ratios_over_single"]:
        print("\n" + ratio_table(result["ratios_over_single"]))
    print(f"\nwrote {a.out}" + (f" and {a.plot}" if result["plots"] else ""))
    failed = [d["mode"] for d in result["daemons"] if "error" in d]
    return 1 if failed or any(r["errors"] for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
