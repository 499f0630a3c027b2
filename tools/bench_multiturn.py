"""Multi-turn chat benchmark over the cache tiers (modelled on SGLang's
benchmark/hicache/bench_multiturn.py), plus a TTFT-by-tier measurement.

Part 1 (multi-turn): N clients x R rounds. Each client keeps its own growing conversation:
round r sends  previous prompt + previous answer + a new question of Q random tokens,  and asks
for O output tokens (greedy, ignore_eos). Every client runs in its own thread; before each
request it waits an exponential think time so that arrivals over all clients are Poisson at
--request-rate req/s. Configs (same page size / layout everywhere):
  radix off   disable_radix_cache=True                       (recompute everything)
  L1          radix cache, small device pool                 (contexts do not all fit)
  L1+L2       + enable_hierarchical_cache, host pool big enough for all contexts
  L1+L2+L3    + file storage in a temp dir, host pool small (= device pool) so L3 matters
Reports throughput (prompt+output tokens / wall s, and output tokens / s), mean/p90 TTFT, and
per-tier hit rates from engine.cache_stats() deltas (hit tokens / prompt tokens).

Part 2 (--ttft, on by default): TTFT of one ~2,000-token prompt served by (a) recompute,
(b) an L1 hit, (c) an L2 hit (device copy evicted -> demoted to host), (d) an L3 hit (new Engine
on the same storage dir). Each hit is checked against cached_tokens_per_tier.

    python -m tools.bench_multiturn [--clients 4 --rounds 4 --question-len 300
        --output-len 16 --device-tokens 1500 --request-rate 2] [--no-ttft] [--only-ttft]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from engine import Engine
from hicache.tier import TIERS
from tools.benchlib import (
    Header,
    markdown_table,
    median,
    percentile,
    save_figure,
    subplots,
    write_json,
)
from tools.benchlib.inproc import (
    HIT_COLUMNS,
    LogTally,
    Steps,
    hit_cells,
    plot_tier_hits,
    plot_ttft,
    rand_tokens,
    run_clients,
    stats_dict,
    stats_snapshot,
    tier_configs,
    tier_hits,
    tiers_str,
    timed_request,
)

LOGS = LogTally()  # counts the scheduler's requeue warnings


def run_request(engine: Engine, ids: list[int], max_new: int) -> tuple[float, list[int], dict]:
    """(TTFT s, output ids, per-tier cached tokens); RuntimeError when it failed."""
    o = timed_request(engine, ids, max_new, 600.0)
    if o.error:
        raise RuntimeError(o.error)
    return o.ttft_s, o.output_ids, o.tiers


def wait_writes(engine: Engine, timeout: float = 20.0) -> None:
    """Wait until the hierarchical cache has no ongoing host writes (best effort)."""
    end = time.time() + timeout
    while time.time() < end:
        l2 = engine.cache_stats().l2
        if l2 is None or l2.ongoing_writes == 0:
            return
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------
# Part 1: multi-turn
# ----------------------------------------------------------------------------------------------
def model_opts(a: argparse.Namespace) -> dict:
    """Engine options that pick the model and where it runs (shared by every config)."""
    opts = {
        "model": a.model,
        "device": a.device,
        "dtype": a.dtype,
        "load_format": a.load_format,
        "hicache_io_backend": a.io_backend,
    }
    if a.attention_backend:
        opts["attention_backend"] = a.attention_backend
    return opts


def multiturn_configs(a: argparse.Namespace, storage_dir: str) -> list[tuple[str, dict]]:
    common = {**model_opts(a), "max_total_tokens": a.device_tokens, "page_size": a.page_size}
    l3 = {"hicache_ratio": a.l3_ratio, "hicache_storage_dir": storage_dir}
    l3["hicache_storage_prefetch_policy"] = a.prefetch_policy
    return tier_configs(common, {"hicache_mem_layout": a.layout, "hicache_ratio": a.l2_ratio}, l3)


def run_multiturn(name: str, opts: dict, a: argparse.Namespace) -> dict:
    engine = Engine(**opts)
    try:
        # warm-up (not counted): one short request, outside every client's token space
        run_request(engine, rand_tokens(random.Random(999), 64), 2)
        before = stats_snapshot(engine)
        records: list[dict] = []
        errors: list[BaseException] = []
        per_client_rate = a.request_rate / a.clients

        def client(cid: int) -> None:
            rng = random.Random(1000 + cid)  # same conversations in every config
            think = random.Random(5000 + cid)
            history: list[int] = []
            try:
                for r in range(a.rounds):
                    time.sleep(think.expovariate(per_client_rate))
                    prompt = history + rand_tokens(rng, a.question_len)
                    ttft, out, tiers = run_request(engine, prompt, a.output_len)
                    records.append(
                        {
                            "client": cid,
                            "round": r,
                            "prompt_tokens": len(prompt),
                            "output_tokens": len(out),
                            "ttft_s": ttft,
                            "cached_per_tier": tiers,
                        }
                    )
                    history = prompt + out
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        LOGS.reset()
        t0 = time.perf_counter()
        timed_out = run_clients(a.clients, client, t0 + a.config_timeout, None) > 0
        wall = time.perf_counter() - t0
        if errors:
            raise errors[0]
        requeues = LOGS.requeues
        try:
            after = stats_snapshot(engine) if not timed_out else dict(before)
        except Exception:  # noqa: BLE001
            after = dict(before)
    finally:
        engine.shutdown()

    ttfts = [r["ttft_s"] for r in records]
    ptoks = sum(r["prompt_tokens"] for r in records)
    otoks = sum(r["output_tokens"] for r in records)
    res = {
        "config": name,
        "timed_out": timed_out,
        "kv_requeue_warnings": requeues,
        "engine_opts": {k: v for k, v in opts.items() if k != "hicache_storage_dir"},
        "requests": len(records),
        "wall_s": wall,
        "prompt_tokens": ptoks,
        "output_tokens": otoks,
        "throughput_tok_s": (ptoks + otoks) / wall,
        "output_tok_s": otoks / wall,
        "ttft_mean_s": statistics.mean(ttfts) if ttfts else float("nan"),
        "ttft_p90_s": percentile(ttfts, 90),
        **tier_hits(before, after, ptoks),
        "per_request_cached_tiers_sum": {
            t: sum(r["cached_per_tier"].get(t, 0) for r in records) for t in TIERS
        },
        "final_stats": {k: v for k, v in after["raw"].items()},
        "records": sorted(records, key=lambda r: (r["round"], r["client"])),
    }
    return res


# ----------------------------------------------------------------------------------------------
# Part 2: TTFT by tier
# ----------------------------------------------------------------------------------------------
TTFT_STEPS = {"recompute": None, "l1": "l1", "l2": "l2", "l3": "l3"}  # step -> its tier


def run_ttft(a: argparse.Namespace, storage_dir: str) -> dict:
    n = a.ttft_prompt_len
    prompt = rand_tokens(random.Random(42), n)
    warm = rand_tokens(random.Random(43), 128)
    reps = a.ttft_reps
    steps = Steps(1, 600.0, {k: k for k in TTFT_STEPS}, TTFT_STEPS)
    out: dict = {"prompt_tokens": n, "reps": reps}

    # (a) recompute + (b) L1 hit: plain radix cache with a huge device pool
    big = {**model_opts(a), "max_total_tokens": max(16384, 2 * n + 256), "page_size": a.page_size}
    eng = steps.engine(big, warm)
    try:
        for i in range(reps):  # fresh prompts each time -> full recompute
            steps.run(eng, "recompute", rand_tokens(random.Random(100 + i), n))
        run_request(eng, prompt, 1)
        for _ in range(reps):
            steps.run(eng, "l1", prompt)
    finally:
        eng.shutdown()

    # (c) L2 hit: hierarchical cache, write-through to host (+ file L3 for part d)
    hi_opts = dict(
        **model_opts(a),
        max_total_tokens=max(4096, n + 1024),
        page_size=a.page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        hicache_mem_layout=a.layout,
        hicache_storage_backend="file",
        hicache_storage_dir=storage_dir,
        hicache_storage_prefetch_policy=a.prefetch_policy,
    )
    eng = steps.engine(hi_opts, warm)
    try:
        out["recompute_hicache_engine_s"] = run_request(eng, prompt, 1)[0]
        for _ in range(reps):
            wait_writes(eng)
            eng.call_in_scheduler(lambda s: s.tree_cache.evict(1 << 30))
            steps.run(eng, "l2", prompt)
        wait_writes(eng)
        time.sleep(1.0)  # let the L3 write-through finish
        out["l3_stats_before_restart"] = stats_dict(eng.cache_stats().l3)
    finally:
        eng.shutdown()

    # (d) L3 hit: a new engine on the same storage dir; only L3 has the prompt
    steps.restarts(hi_opts, "l3", [prompt] * a.ttft_l3_reps, warm)
    failed = [e for x in steps.samples.values() for e in (s["error"] for s in x) if e]
    if failed:
        raise RuntimeError(failed[0])
    out["checks"] = {k: [tiers_str(x["tiers"]) for x in steps.samples[k]] for k in TTFT_STEPS}
    out["ttft_s"] = {k: median(steps.values(k)) for k in TTFT_STEPS}
    out["ttft_all_s"] = {k: steps.values(k) for k in TTFT_STEPS}
    r = out["ttft_s"]
    out["targets"] = {
        "l2_le_1.2x_l1": {"ratio": r["l2"] / r["l1"], "met": r["l2"] <= 1.2 * r["l1"]},
        "l2_le_0.05x_recompute": {
            "ratio": r["l2"] / r["recompute"],
            "met": r["l2"] <= 0.05 * r["recompute"],
        },
        "l3_le_0.2x_recompute": {
            "ratio": r["l3"] / r["recompute"],
            "met": r["l3"] <= 0.2 * r["recompute"],
        },
    }
    return out


# ----------------------------------------------------------------------------------------------
def md_multiturn(rows: list[dict]) -> str:
    header = [
        "config",
        "wall (s)",
        "throughput (tok/s)",
        "output tok/s",
        "mean TTFT (s)",
        "p90 TTFT (s)",
        *HIT_COLUMNS,
        "requests done",
        "KV requeues",
    ]
    return markdown_table(
        header,
        [
            [
                r["config"],
                f"{r['wall_s']:.1f}",
                f"{r['throughput_tok_s']:.0f}",
                f"{r['output_tok_s']:.1f}",
                f"{r['ttft_mean_s']:.2f}",
                f"{r['ttft_p90_s']:.2f}",
                *hit_cells(r),
                f"{r['requests']}{' (TIMED OUT)' if r['timed_out'] else ''}",
                r["kv_requeue_warnings"],
            ]
            for r in rows
        ],
    )


def md_ttft(t: dict) -> str:
    r = t["ttft_s"]
    labels = (
        ("recompute", "recompute (fresh)"),
        ("l1", "L1 hit"),
        ("l2", "L2 hit"),
        ("l3", "L3 hit (after restart)"),
    )
    return markdown_table(
        ["served from", "TTFT median (ms)", "x recompute", "x L1 hit", "cached_tokens_per_tier"],
        [
            [
                label,
                f"{r[k] * 1e3:.1f}",
                f"{r[k] / r['recompute']:.3f}",
                f"{r[k] / r['l1']:.2f}",
                t["checks"][k][0],
            ]
            for k, label in labels
        ],
    )


def plot_multiturn(rows: list[dict], path: str) -> str:
    names = [r["config"] for r in rows]
    x = range(len(rows))
    fig, ax = subplots(1, 4, figsize=(16, 4))
    ax[0].bar(x, [r["throughput_tok_s"] for r in rows], color="tab:blue")
    ax[0].set_title("throughput (prompt+output tok/s)")
    ax[1].bar(x, [r["ttft_mean_s"] for r in rows], color="tab:orange")
    ax[1].set_title("mean TTFT (s)")
    ax[2].bar(x, [r["ttft_p90_s"] for r in rows], color="tab:red")
    ax[2].set_title("p90 TTFT (s)")
    plot_tier_hits(ax[3], x, rows)
    ax[3].legend()
    for a_ in ax:
        a_.set_xticks(list(x))
        a_.set_xticklabels(names, rotation=15)
    return save_figure(fig, path)


def plot_ttft_tiers(t: dict, path: str) -> str:
    fig, ax = subplots(figsize=(6, 4))
    ms = {k: t["ttft_s"][k] * 1e3 for k in TTFT_STEPS}
    colors = ["tab:gray", "tab:green", "tab:purple", "tab:brown"]
    plot_ttft(ax, ms, colors, f"TTFT of a {t['prompt_tokens']}-token prompt by serving tier")
    return save_figure(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--model",
        default=None,
        help="HF dir / .gguf (default: the embedded SmolLM2); with --load-format "
        "dummy a dir with only config.json, e.g. tools/configs/llama3-8b",
    )
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--io-backend", default="kernel", choices=["kernel", "direct"])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--question-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=2.0, help="req/s over all clients")
    ap.add_argument("--device-tokens", type=int, default=1536)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--l2-ratio", type=float, default=6.0)
    ap.add_argument("--l3-ratio", type=float, default=1.0)
    ap.add_argument("--prefetch-policy", default="wait_complete")
    ap.add_argument("--ttft-prompt-len", type=int, default=2000)
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--ttft-l3-reps", type=int, default=2)
    ap.add_argument(
        "--config-timeout",
        type=float,
        default=150.0,
        help="give up on a config (livelock guard) after this many seconds",
    )
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--only-ttft", action="store_true")
    ap.add_argument("--configs", default="", help="comma list of config names to run")
    ap.add_argument("--json", default="docs/bench_multiturn.json")
    ap.add_argument("--png", default="docs/bench_multiturn.png")
    ap.add_argument("--ttft-png", default="docs/bench_ttft_tiers.png")
    a = ap.parse_args()

    header = Header.now()
    result: dict = {"args": vars(a)}
    plots: list[str | None] = []
    tmp = tempfile.mkdtemp(prefix="hicache_bench_")
    try:
        if not a.only_ttft:
            rows = []
            want = {c.strip() for c in a.configs.split(",") if c.strip()}
            for name, opts in multiturn_configs(a, os.path.join(tmp, "mt_l3")):
                if want and name not in want:
                    continue
                t0 = time.perf_counter()
                r = run_multiturn(name, opts, a)
                print(
                    f"[{name}] done in {time.perf_counter() - t0:.1f}s: "
                    f"{r['throughput_tok_s']:.0f} tok/s, TTFT mean {r['ttft_mean_s']:.2f}s, "
                    f"hits {r['hit_tokens']} miss {r['miss_tokens']}",
                    flush=True,
                )
                rows.append(r)
            result["multiturn"] = rows
            print("\n" + md_multiturn(rows) + "\n", flush=True)
            if a.png:
                plots.append(plot_multiturn(rows, a.png))
        if not a.no_ttft:
            t = run_ttft(a, os.path.join(tmp, "ttft_l3"))
            result["ttft_by_tier"] = t
            print("\n" + md_ttft(t) + "\n")
            for k, v in t["targets"].items():
                print(f"target {k}: ratio {v['ratio']:.3f} -> {'met' if v['met'] else 'NOT met'}")
            print("checks:", json.dumps(t["checks"]))
            if a.ttft_png:
                plots.append(plot_ttft_tiers(t, a.ttft_png))
        result.update(header.record(plots))
        write_json(a.json, result)
        print(header.markdown(plots))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
