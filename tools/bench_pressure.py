"""The hierarchy under pressure: what a user gets from L1 / L2 / L3 when device memory is short.

Mode `sequence` (default), per page size (--page-sizes 1,16,64), options as a new user sets them:
    Engine(enable_hierarchical_cache=True, max_total_tokens=2600, hicache_ratio=3.0,
           hicache_storage_backend="file", hicache_storage_dir=<fresh temp dir>, page_size=P)
Prompts A and B: --prompt-len (2,000) random ids in [1000, 40000), B shares no prefix with A.
  1 A cold (recompute)   2 A again (L1 hit)   3 B cold: pushes A out of L1 (B under pressure)
  4 A again (L2 hit)     5 shutdown (it flushes the L3 backups), new Engine on the same dir,
                           A again (L3 hit)
  + "B no pressure": a cold prompt of B's size on a fresh Engine with a big device pool.
Hit steps run --reps (5) times (median): L1 hits back to back; each further L2 rep first runs a fresh
cold prompt of B's size (pushes A out again; it counts as one more "B under pressure" sample);
each L3 rep restarts the engine. Every step is checked against cached_tokens_per_tier: a step
that did not hit the tier it is meant to gets a flag in the table. Each new engine serves a
16-token warm-up prompt first (not timed). Targets (TTFT): B <= 1.3x B no pressure; L2 <= 1.2x
L1 and <= 0.05x A cold; L3 <= 0.2x A cold.

Mode `load`: --clients closed-loop chat clients for --duration s, device pool --device-tokens,
L2 (--l2-ratio) + file L3 in a temp dir, page size --page-size. A client's conversation: turn 1 =
shared prefix (--shared-prefix, same for all clients) + the client's own system prefix (fixed per
client, reused by its next conversations) + a --question-len question, --first-len tokens in all;
turn r+1 = turn r + its answer (--output-len) + a new question. After --rounds turns a new
conversation starts. The next request is sent when the previous one finished (+ --think-s).
Requests still running at the deadline finish (up to --drain-s) and count. Runs --policies
(fcfs, lpm = the default) one Engine at a time on the same workload: TTFT p50/p90/p99/max,
throughput, failed requests, "did not fit the KV pool; requeued" warnings. Targets: default p50
TTFT <= 0.5x fcfs's, default max TTFT <= 1.5x fcfs's, no failed request.
Then (unless --no-tiers) radix off / L1 / L1+L2 / L1+L2+L3 for --tier-duration s each with L2 =
--tier-l2-ratio x L1 (the working set should exceed L1+L2; the tool prints both): throughput and
per-tier hit rates (cache_stats deltas: hit tokens / prompt tokens).

Both modes write <out-dir>/bench_pressure_<mode>.json and .png and print a markdown table with a
header (command, machine, load average before / after). Exit status 1 when a step or a config
failed (it is reported with its error; the tool goes on with the next one).

    python -m tools.bench_pressure [--mode sequence] [--page-sizes 16,64 --reps 3]
    python -m tools.bench_pressure --mode load [--clients 16 --duration 180]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

from engine import Engine
from tools.benchlib import (
    Header,
    cell,
    markdown_table,
    median,
    percentile,
    save_figure,
    subplots,
    write_json,
)
from tools.benchlib.inproc import (
    HIT_COLUMNS,
    NAN,
    WARMUP,
    LogTally,
    Steps,
    add_engine_args,
    distinct_prompt,
    engine_options,
    hit_cells,
    plot_tier_hits,
    rand_tokens,
    run_clients,
    stats_dict,
    stats_snapshot,
    tier_configs,
    tier_hits,
    tiers_str,
    timed_request,
)

LOGS = LogTally()


# ----------------------------------------------------------------------------------------------
# mode sequence
# ----------------------------------------------------------------------------------------------
STEPS = ("a_cold", "l1_hit", "b_pressure", "b_no_pressure", "l2_hit", "l3_hit")
STEP_LABEL = {
    "a_cold": "A cold",
    "l1_hit": "L1 hit",
    "b_pressure": "B",
    "b_no_pressure": "B no pressure",
    "l2_hit": "L2 hit",
    "l3_hit": "L3 hit",
}
# step -> the tier its prompt must come from (None: nothing cached)
STEP_TIER = {
    "a_cold": None,
    "l1_hit": "l1",
    "b_pressure": None,
    "b_no_pressure": None,
    "l2_hit": "l2",
    "l3_hit": "l3",
}


def run_sequence_page(P: int, a: argparse.Namespace, tmp: str) -> dict:
    n = a.prompt_len
    A = distinct_prompt(1, n, [WARMUP])
    B = distinct_prompt(2, n, [WARMUP, A])
    fresh = [distinct_prompt(10 + i, n, [WARMUP, A, B]) for i in range(a.reps)]
    opts = {
        **engine_options(a),
        "enable_hierarchical_cache": True,
        "max_total_tokens": a.device_tokens,
        "hicache_ratio": a.l2_ratio,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": os.path.join(tmp, f"l3_page{P}"),
        "page_size": P,
    }
    steps = Steps(a.output_len, a.request_timeout, STEP_LABEL, STEP_TIER, f"page {P} ")
    steps.samples = {s: [] for s in STEPS}
    res: dict[str, Any] = {
        "page_size": P,
        "prompt_tokens": n,
        "engine_opts": {k: v for k, v in opts.items() if k != "hicache_storage_dir"},
        "samples": steps.samples,
        "errors": [],
    }

    def step(eng: Engine, name: str, ids: list[int]) -> None:
        if (error := steps.run(eng, name, ids).error) is not None:
            res["errors"].append(f"{STEP_LABEL[name]}: {error}")

    def guarded(what: str, fn) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            tb = traceback.format_exc()
            print(f"  page {P} {what} FAILED: {type(e).__name__}: {e}\n{tb}", flush=True)
            res["errors"].append(f"{what}: {type(e).__name__}: {e}")
            res.setdefault("tracebacks", []).append(tb)
            return None

    def pressure_engine() -> None:
        eng = steps.engine(opts)
        try:
            step(eng, "a_cold", A)
            for _ in range(a.reps):
                step(eng, "l1_hit", A)
            for i in range(a.reps):
                step(eng, "b_pressure", B if i == 0 else fresh[i])  # pushes A out of L1
                step(eng, "l2_hit", A)
            res["l3_before_shutdown"] = stats_dict(eng.cache_stats().l3)
        finally:
            t0 = time.perf_counter()
            eng.shutdown()  # flushes the pending L3 backups
            res["shutdown_s"] = time.perf_counter() - t0
        res["l3_files_after_shutdown"] = sum(
            f.endswith(".kv") for _, _, fs in os.walk(opts["hicache_storage_dir"]) for f in fs
        )

    def l3_engine() -> None:
        eng = steps.engine(opts)
        try:
            step(eng, "l3_hit", A)
            res.setdefault("l3_after_hit", []).append(stats_dict(eng.cache_stats().l3))
        finally:
            eng.shutdown()

    def no_pressure_engine() -> None:
        big = {
            **opts,
            "max_total_tokens": (a.reps + 2) * (n + a.output_len + 2 * P),
            "hicache_storage_dir": os.path.join(tmp, f"l3_page{P}_nopressure"),
        }
        eng = steps.engine(big)
        try:
            for i in range(a.reps):
                step(eng, "b_no_pressure", B if i == 0 else fresh[i])
        finally:
            eng.shutdown()

    t0 = time.perf_counter()
    guarded("pressure engine (steps 1-4)", pressure_engine)
    for _ in range(a.reps):
        guarded("restart + L3 hit (step 5)", l3_engine)
    guarded("no-pressure engine", no_pressure_engine)
    res["wall_s"] = time.perf_counter() - t0
    check_sequence(res, opts)
    return res


def check_sequence(res: dict, opts: dict) -> None:
    """Medians, tier checks (flags) and target ratios."""
    n, P = res["prompt_tokens"], res["page_size"]
    S = opts.get("hicache_storage_page_size") or -(-64 // P) * P
    unit = {"l1": P, "l2": P, "l3": S}
    ttft = {s: median(x["ttft_s"] for x in res["samples"][s] if not x["error"]) for s in STEPS}
    total = {s: median(x["total_s"] for x in res["samples"][s] if not x["error"]) for s in STEPS}
    flags = []
    for s in STEPS:
        xs = res["samples"][s]
        if not xs:
            flags.append(f"{STEP_LABEL[s]}: not run")
            continue
        if any(x["error"] for x in xs):
            flags.append(f"{STEP_LABEL[s]}: error")
        tier = STEP_TIER[s]
        for x in xs:
            if x["error"]:
                continue
            if tier is None and x["cached"] > 0:
                flags.append(f"{STEP_LABEL[s]}: {x['cached']} tokens cached (should be cold)")
                break
            if tier is not None:
                want = (n - 1) // unit[tier] * unit[tier]
                if x["tiers"].get(tier, 0) < want:
                    flags.append(f"{STEP_LABEL[s]}: {tiers_str(x['tiers'])}, want {tier}>={want}")
                    break
    r = ttft

    def ratio(num: str, den: str, limit: float) -> dict:
        v = r[num] / r[den] if r[den] and not math.isnan(r[den]) else NAN
        return {"ratio": v, "limit": limit, "met": bool(v <= limit)}

    res.update(
        ttft_s=ttft,
        total_s=total,
        flags=flags,
        targets={
            "b_le_1.3x_no_pressure": ratio("b_pressure", "b_no_pressure", 1.3),
            "l2_le_1.2x_l1": ratio("l2_hit", "l1_hit", 1.2),
            "l2_le_0.05x_recompute": ratio("l2_hit", "a_cold", 0.05),
            "l3_le_0.2x_recompute": ratio("l3_hit", "a_cold", 0.2),
        },
    )


def fmt_target(t: dict) -> str:
    if math.isnan(t["ratio"]):
        return "— (n/a)"
    return f"{t['ratio']:.3f} {'pass' if t['met'] else '**FAIL**'}"


def md_sequence(rows: list[dict]) -> str:
    header = [
        "page",
        "A cold",
        "L1 hit",
        "B",
        "B no pressure",
        "L2 hit",
        "L3 hit",
        "B / B no press. (<=1.3)",
        "L2 / L1 (<=1.2)",
        "L2 / cold (<=0.05)",
        "L3 / cold (<=0.2)",
        "flags",
    ]
    ttft = markdown_table(
        header,
        [
            [
                r["page_size"],
                *(cell(r["ttft_s"][s], ".0f", 1e3) for s in STEPS),
                *(fmt_target(v) for v in r["targets"].values()),
                "; ".join(r["flags"]) or "ok",
            ]
            for r in rows
        ],
    )
    total = markdown_table(
        ["page", *(STEP_LABEL[s] for s in STEPS)],
        [[r["page_size"], *(cell(r["total_s"][s], ".0f", 1e3) for s in STEPS)] for r in rows],
    )
    return f"{ttft}\n\nTotal time per request (TTFT + decode), ms:\n\n{total}"


def plot_sequence(rows: list[dict], path: str, n: int) -> str:
    fig, ax = subplots(figsize=(10, 4.5))
    w = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        v = [r["ttft_s"][s] * 1e3 for s in STEPS]
        xs = [j + (i - (len(rows) - 1) / 2) * w for j in range(len(STEPS))]
        bars = ax.bar(xs, [0 if math.isnan(y) else y for y in v], w, label=f"page {r['page_size']}")
        for b, y in zip(bars, v):
            ax.text(
                b.get_x() + b.get_width() / 2,
                max(y, 1) if not math.isnan(y) else 1,
                "fail" if math.isnan(y) else f"{y:.0f}",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(range(len(STEPS)))
    ax.set_xticklabels([STEP_LABEL[s] for s in STEPS])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(f"A / A / B / A / restart+A under pressure ({n}-token prompts)")
    ax.legend()
    return save_figure(fig, path)


def run_sequence_mode(a: argparse.Namespace, result: dict, tmp: str) -> bool:
    rows = []
    for P in [int(x) for x in a.page_sizes.split(",") if x.strip()]:
        print(f"[sequence] page size {P}", flush=True)
        LOGS.reset()
        r = run_sequence_page(P, a, tmp)
        r["logs"] = LOGS.summary()
        if r["logs"]["logged_errors"]:
            r["flags"].append(f"engine logged {r['logs']['logged_errors']} errors (JSON: logs)")
            r["errors"].append("engine logged errors")
        rows.append(r)
        shutil.rmtree(os.path.join(tmp, f"l3_page{P}"), ignore_errors=True)
        shutil.rmtree(os.path.join(tmp, f"l3_page{P}_nopressure"), ignore_errors=True)
    result["sequence"] = rows
    result["markdown"] = md_sequence(rows)
    result["plots"] = [
        plot_sequence(rows, os.path.join(a.out_dir, "bench_pressure_sequence.png"), a.prompt_len)
    ]
    return any(r["errors"] for r in rows)


# ----------------------------------------------------------------------------------------------
# mode load
# ----------------------------------------------------------------------------------------------
def run_load(name: str, opts: dict, a: argparse.Namespace, duration: float) -> dict:
    """Closed-loop clients on one Engine for `duration` s; every request is recorded."""
    LOGS.reset()
    shared = rand_tokens(random.Random(a.seed), a.shared_prefix)
    sys_len = max(0, a.first_len - a.shared_prefix - a.question_len)
    records: list[dict] = []
    lock = threading.Lock()
    eng = Engine(**opts)
    try:
        timed_request(eng, WARMUP, 1, a.request_timeout)  # not recorded
        before = stats_snapshot(eng)
        t0 = time.perf_counter()
        deadline = t0 + duration

        def client(cid: int) -> None:
            rng = random.Random(a.seed * 1000 + cid + 1)  # the same workload in every config
            system = shared + rand_tokens(rng, sys_len)
            conv = 0
            while time.perf_counter() < deadline:
                prompt = system + rand_tokens(rng, a.question_len)
                for rnd in range(a.rounds):
                    if rnd:
                        prompt = prompt + rand_tokens(rng, a.question_len)
                    if time.perf_counter() >= deadline:
                        break
                    start = time.perf_counter() - t0
                    o = timed_request(
                        eng, prompt, a.output_len, deadline + a.drain_s - time.perf_counter()
                    )
                    with lock:
                        records.append(
                            {
                                "client": cid,
                                "conversation": conv,
                                "round": rnd,
                                "start_s": start,
                                "end_s": time.perf_counter() - t0,
                                "prompt_tokens": len(prompt),
                                "output_tokens": len(o.output_ids),
                                "ttft_s": o.ttft_s,
                                "e2e_s": o.total_s,
                                "cached_per_tier": o.tiers,
                                "error": o.error,
                            }
                        )
                    if o.error:
                        break  # the conversation is lost; start a new one
                    prompt = prompt + o.output_ids
                    if a.think_s:
                        time.sleep(a.think_s)
                conv += 1

        def progress() -> str:
            with lock:
                done, bad = len(records), sum(1 for r in records if r["error"])
            return (
                f"  [{name}] {time.perf_counter() - t0:.0f} s: {done} requests done, {bad} failed"
            )

        # NOTE: every request has its own timeout; the last guard is 30 s past the drain
        stuck = run_clients(a.clients, client, deadline + a.drain_s + 30, progress)
        after = stats_snapshot(eng)
    finally:
        eng.shutdown()
    with lock:
        recs = sorted(records, key=lambda r: r["start_s"])
    ok = [r for r in recs if not r["error"]]
    wall = max([r["end_s"] for r in recs] + [duration])
    ttfts = [r["ttft_s"] for r in ok]
    e2e = [r["e2e_s"] for r in ok]
    ptoks = sum(r["prompt_tokens"] for r in ok)
    otoks = sum(r["output_tokens"] for r in ok)
    errors: dict[str, int] = {}
    for r in recs:
        if r["error"]:
            errors[r["error"]] = errors.get(r["error"], 0) + 1
    return {
        "config": name,
        "engine_opts": {k: v for k, v in opts.items() if k != "hicache_storage_dir"},
        "duration_s": duration,
        "wall_s": wall,
        "requests": len(recs),
        "ok": len(ok),
        "failed": len(recs) - len(ok) + stuck,
        "stuck_clients": stuck,
        "errors": errors,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_max_s": max(ttfts, default=NAN),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "prompt_tokens": ptoks,
        "output_tokens": otoks,
        "throughput_tok_s": (ptoks + otoks) / wall,
        "requests_s": len(ok) / wall,
        **tier_hits(before, after),
        "stats_prompt_tokens": after["prompt"] - before["prompt"],
        **LOGS.summary(),
        "final_stats": after["raw"],
        "records": recs,
    }


def failed_run(name: str, opts: dict, e: BaseException) -> dict:
    tb = traceback.format_exc()
    print(f"  [{name}] FAILED: {type(e).__name__}: {e}\n{tb}", flush=True)
    return {
        "config": name,
        "engine_opts": {k: v for k, v in opts.items() if k != "hicache_storage_dir"},
        "error": f"{type(e).__name__}: {e}",
        "traceback": tb,
        **LOGS.summary(),
    }


def load_configs(a: argparse.Namespace, tmp: str) -> list[tuple[str, dict]]:
    """One L1+L2+L3 engine per scheduling policy (--policies), "lpm" marked as the default."""
    base = {**engine_options(a), "max_total_tokens": a.device_tokens, "page_size": a.page_size}
    out = []
    for pol in [p.strip() for p in a.policies.split(",") if p.strip()]:
        l3 = {"hicache_storage_dir": os.path.join(tmp, f"load_{pol}")}
        opts = tier_configs({**base, "schedule_policy": pol}, {"hicache_ratio": a.l2_ratio}, l3)
        out.append((f"{pol} (default)" if pol == "lpm" else pol, opts[-1][1]))
    return out


def tier_configs_of(a: argparse.Namespace, tmp: str) -> list[tuple[str, dict]]:
    base = {**engine_options(a), "max_total_tokens": a.device_tokens, "page_size": a.page_size}
    l3 = {"hicache_storage_dir": os.path.join(tmp, "tiers_l3")}
    return tier_configs(base, {"hicache_ratio": a.tier_l2_ratio}, l3)


def md_rows(header: list[str], rows: list[dict], cells: Any) -> str:
    """A markdown table: ``[row["config"], *cells(row)]`` per row; a failed config gets one
    FAILED cell."""
    return markdown_table(
        header,
        [
            [r["config"], f"FAILED: {r['error']}"] if "error" in r else [r["config"], *cells(r)]
            for r in rows
        ],
    )


def md_load(rows: list[dict]) -> str:
    header = [
        "policy",
        "requests ok",
        "failed",
        "TTFT p50 (s)",
        "p90",
        "p99",
        "max",
        "e2e p50 (s)",
        "tok/s",
        "req/s",
        "L1 / L2 / L3 hit",
        "KV requeues",
        "warnings / errors logged",
    ]

    def cells(r: dict) -> list[object]:
        h = r["hit_rate"]
        return [
            r["ok"],
            r["failed"],
            *(
                cell(r[k], ".2f")
                for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_max_s", "e2e_p50_s")
            ),
            f"{r['throughput_tok_s']:.0f}",
            f"{r['requests_s']:.2f}",
            f"{h['l1']:.0%} / {h['l2']:.0%} / {h['l3']:.0%}",
            r["kv_requeue_warnings"],
            f"{r['logged_warnings']} / {r['logged_errors']}",
        ]

    return md_rows(header, rows, cells)


def load_targets(rows: list[dict]) -> dict:
    by = {r["config"].split()[0]: r for r in rows if "error" not in r}
    out: dict[str, Any] = {
        "zero_failed": {
            "met": bool(by) and len(by) == len(rows) and all(r["failed"] == 0 for r in by.values())
        }
    }
    if "fcfs" in by and "lpm" in by:
        f, d = by["fcfs"], by["lpm"]
        for key, col, lim in (
            ("p50_le_0.5x_fcfs", "ttft_p50_s", 0.5),
            ("max_le_1.5x_fcfs", "ttft_max_s", 1.5),
        ):
            v = d[col] / f[col] if f[col] else NAN
            out[key] = {"ratio": v, "limit": lim, "met": bool(v <= lim)}
    return out


def md_tiers(rows: list[dict]) -> str:
    header = [
        "config",
        "requests ok",
        "failed",
        "tok/s",
        "req/s",
        "TTFT p50 (s)",
        "p99",
        *HIT_COLUMNS,
        "KV requeues",
        "warnings / errors logged",
    ]

    def cells(r: dict) -> list[object]:
        return [
            r["ok"],
            r["failed"],
            f"{r['throughput_tok_s']:.0f}",
            f"{r['requests_s']:.2f}",
            cell(r["ttft_p50_s"], ".2f"),
            cell(r["ttft_p99_s"], ".2f"),
            *hit_cells(r),
            r["kv_requeue_warnings"],
            f"{r['logged_warnings']} / {r['logged_errors']}",
        ]

    return md_rows(header, rows, cells)


def plot_load(rows: list[dict], tiers: list[dict], path: str) -> str:
    ok = [r for r in rows if "error" not in r]
    tok = [r for r in tiers if "error" not in r]
    fig, ax = subplots(1, 4 if tiers else 2, figsize=(18 if tiers else 10, 4))
    import matplotlib.ticker

    for r in ok:
        xs = sorted(x["ttft_s"] for x in r["records"] if not x["error"])
        ax[0].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["config"])
    ax[0].set_xscale("log")
    ax[0].xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax[0].xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax[0].set_xlabel("TTFT (s, log)")
    ax[0].set_title("TTFT CDF")
    ax[0].legend()
    w = 0.8 / max(1, len(ok))
    for i, r in enumerate(ok):
        v = [r[k] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_max_s")]
        ax[1].bar([j + (i - (len(ok) - 1) / 2) * w for j in range(4)], v, w, label=r["config"])
    ax[1].set_xticks(range(4))
    ax[1].set_xticklabels(["p50", "p90", "p99", "max"])
    ax[1].set_ylabel("TTFT (s)")
    ax[1].set_title("TTFT by policy")
    ax[1].legend()
    if tiers:
        names = [r["config"] for r in tok]
        ax[2].bar(names, [r["throughput_tok_s"] for r in tok], color="tab:blue")
        ax[2].set_title("throughput (prompt+output tok/s)")
        plot_tier_hits(ax[3], names, tok)
        ax[3].legend()
        for x in ax[2:]:
            x.tick_params(axis="x", labelrotation=15)
    return save_figure(fig, path)


def run_load_mode(a: argparse.Namespace, result: dict, tmp: str) -> bool:
    per_conv = a.first_len + (a.rounds - 1) * (a.output_len + a.question_len) + a.output_len
    result["workload"] = {
        "max_context_tokens": per_conv,
        "working_set_tokens": a.clients * per_conv,
        "device_tokens": a.device_tokens,
    }

    def run_or_fail(name: str, opts: dict, duration: float) -> dict:
        try:
            return run_load(name, opts, a, duration)
        except Exception as e:  # noqa: BLE001 - recorded; the next config still runs
            return failed_run(name, opts, e)

    rows = []
    for name, opts in load_configs(a, tmp):
        print(f"[load] {name}: {a.clients} clients, {a.duration:.0f} s", flush=True)
        rows.append(r := run_or_fail(name, opts, a.duration))
        if "error" not in r:
            print(
                f"  [{name}] {r['ok']} ok, {r['failed']} failed, TTFT p50 "
                f"{r['ttft_p50_s']:.2f} s max {r['ttft_max_s']:.2f} s, "
                f"{r['throughput_tok_s']:.0f} tok/s",
                flush=True,
            )
    result["load"], result["load_targets"] = rows, load_targets(rows)
    md = [md_load(rows), ""]
    for k, v in result["load_targets"].items():
        ratio = f"ratio {v['ratio']:.2f} (limit {v['limit']}) " if "ratio" in v else ""
        md.append(f"- target {k}: {ratio}-> {'met' if v['met'] else '**NOT met**'}")
    tiers: list[dict] = []
    if a.tiers:
        l1l2 = int(a.device_tokens * (1 + a.tier_l2_ratio))
        ws = a.clients * per_conv
        note = (
            f"working set ~{ws} tokens ({a.clients} clients x {per_conv}) vs L1+L2 = {l1l2} tokens"
        )
        if ws <= l1l2:
            note += " -- NOT larger: raise --clients or lower --tier-l2-ratio"
        print(f"[tiers] {note}", flush=True)
        result["workload"]["tiers_l1_plus_l2_tokens"] = l1l2
        for name, opts in tier_configs_of(a, tmp):
            print(f"[tiers] {name}: {a.tier_duration:.0f} s", flush=True)
            tiers.append(run_or_fail(name, opts, a.tier_duration))
        result["tiers"] = tiers
        md += ["", f"Tier configs ({note}; L2 = {a.tier_l2_ratio} x L1):", "", md_tiers(tiers)]
    result["markdown"] = "\n".join(md)
    result["plots"] = [plot_load(rows, tiers, os.path.join(a.out_dir, "bench_pressure_load.png"))]
    return any("error" in r or r["failed"] or r["logged_errors"] for r in rows + tiers)


# ----------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mode", choices=["sequence", "load"], default="sequence")
    ap.add_argument("--out-dir", default="docs", help="for bench_pressure_<mode>.json / .png")
    add_engine_args(ap)
    ap.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="new tokens per request (default: 8 sequence, 16 load)",
    )
    ap.add_argument(
        "--device-tokens",
        type=int,
        default=None,
        help="L1 size, max_total_tokens (default: 2600 sequence, 3000 load)",
    )
    ap.add_argument(
        "--request-timeout",
        type=float,
        default=1800.0,
        help="sequence: give up on (and abort) one request after this many s",
    )
    g = ap.add_argument_group("sequence")
    g.add_argument("--page-sizes", default="1,16,64")
    g.add_argument("--prompt-len", type=int, default=2000)
    g.add_argument(
        "--l2-ratio",
        type=float,
        default=None,
        help="hicache_ratio (default: 3.0 sequence, 2.0 = engine default for load)",
    )
    g.add_argument(
        "--reps",
        type=int,
        default=5,
        help="samples per hit step (median reported; one slow sample in 3 flips it)",
    )
    g = ap.add_argument_group("load")
    g.add_argument("--clients", type=int, default=16)
    g.add_argument("--duration", type=float, default=180.0)
    g.add_argument("--first-len", type=int, default=1000)
    g.add_argument("--shared-prefix", type=int, default=0)
    g.add_argument("--question-len", type=int, default=100)
    g.add_argument("--rounds", type=int, default=4)
    g.add_argument("--think-s", type=float, default=0.0)
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--policies", default="fcfs,lpm")
    g.add_argument(
        "--drain-s",
        type=float,
        default=300.0,
        help="after the deadline, requests still running get this long (then they "
        "are aborted and count as failed)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tiers", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--tier-duration", type=float, default=90.0)
    g.add_argument("--tier-l2-ratio", type=float, default=1.5)
    a = ap.parse_args()
    seq = a.mode == "sequence"
    a.output_len = a.output_len or (8 if seq else 16)
    a.device_tokens = a.device_tokens or (2600 if seq else 3000)
    a.l2_ratio = a.l2_ratio or (3.0 if seq else 2.0)
    os.makedirs(a.out_dir, exist_ok=True)

    header = Header.now()
    print(header.markdown(end=False), flush=True)
    result: dict[str, Any] = {"args": vars(a)}
    tmp = tempfile.mkdtemp(prefix="hicache_pressure_")
    try:
        failed = (run_sequence_mode if seq else run_load_mode)(a, result, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result.update(header.record(result["plots"]))
    path = write_json(os.path.join(a.out_dir, f"bench_pressure_{a.mode}.json"), result)
    print(f"\n{header.markdown(result['plots'])}  \nResults: `{path}`\n")
    print(result["markdown"] + "\n", flush=True)
    if failed:
        print("SOME STEPS / CONFIGS FAILED (see the table and the JSON)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
