"""Reliability soak: a real `hicache serve` under randomized concurrent load and injected faults.

The daemon runs as a subprocess with the whole hierarchy (L1 + L2 + file L3 in a temp dir) and
small pools, so eviction, demotion, load-back and L3 reads happen all the time. For
--duration-s, --clients threads hold multi-turn conversations over shared prefixes (greedy and
sampled, some with a namespace) and randomly cancel mid-stream, set short deadlines, abort by
request id, or reuse a request id (once while the first request runs, once as two simultaneous
calls); an admin thread runs Flush / Evict / Pin / Unpin / Prefetch / MatchPrefix /
InspectTree / GetCacheStats / GetStorage / WatchCacheEvents / Abort alongside.

The run is cut in rounds (--round-s). Round 0 is clean, the last two are clean too (the "equal
rounds" memory is compared on); each round between injects the next fault group of --faults,
in the middle of the round's traffic:

    corrupt   flip bytes in random L3 files      delete    remove L3 files (or a fan-out dir)
    readonly  the L3 dir read-only for a while   diskfull  the L3 filesystem full for a while
    kill9     SIGKILL, restart on the same dir   sigterm   SIGTERM during traffic: the drain

readonly and diskfull need a filesystem of their own: as root the L3 dir is a small tmpfs
(remounted ro; filled by a filler file); without mount rights readonly falls back to chmod
(which does not stop root) and diskfull is skipped. A skipped fault is named in the output with
the reason. A storage backend that stalls cannot be selected in a daemon subprocess (the backend
is chosen by name: file / redis); tests/e2e/test_reliability.py stalls one in an in-process
daemon instead.

After each round the traffic pauses and the tool checks: every call ended with OK or a
documented status (docs/daemon.md "Status codes", plus CANCELLED / DEADLINE_EXCEEDED for the
calls this tool cancelled or gave a short deadline; UNAVAILABLE only while the daemon was
down or draining, and so grpc's CANCELLED of a call that reached the daemon as its gRPC server
stopped, before any handler took it); the daemon is SERVING; after Unpin-all and idle, the KV accounting of
every tier is exact (L1 / L2: used == cached, nothing locked, pinned or held by requests; the
tree's node residency sums to the same; L3: the index equals the files on disk, nothing
pending); greedy check prompts give the token ids the fresh daemon gave before any traffic;
the daemon's RSS. At the end: RSS of the last two (clean, same process) rounds within
--rss-tolerance-mb / --rss-tolerance-frac, and no traceback in the daemon's log. Then the
reference check (tools/soaklib/reference.py): a fresh daemon with the same command line and an
empty cache computes, one request at a time, each distinct (prompt, sampling params) the soak
sent greedy or with a seed, and every answer served for it (whole, or the prefix a cancelled,
aborted or killed stream got) must be those tokens; each mismatch is a violation, named with
the prompt, the answer, the first differing token, the tiers its prefix came from and the
faults around it.

    .venv/bin/python -m tools.soak --duration-s 1200 --clients 8 --out soak.json --plot soak.png
    .venv/bin/python -m tools.soak --duration-s 60 --faults corrupt+delete,kill9 --model DIR

--out gets requests, the status histogram (overall and per RPC), faults injected / skipped,
TTFT p50 / p99, RSS per round (first / last), leaked slots per tier, every violation, the
reference check (answers checked, references computed, mismatches with their prompt, served and
expected tokens), and per round its faults, calls by status, TTFT p50 / p99 and RSS; --plot
draws those per-round figures (tools/soaklib/plot.py). Exit status 0 when nothing was
violated, 1 otherwise.

This file runs the rounds and prints the summary; the parts live in tools/soaklib/.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import grpc

from engine.client import HicacheClient
from tools.benchlib import Header, write_json
from tools.soaklib.checks import (
    check_round,
    greedy_outputs,
    kv_accounting,
    rss_verdict,
    wait_idle,
)
from tools.soaklib.config import ALL_FAULTS, RPC_TIMEOUT_S, SoakConfig
from tools.soaklib.daemon import DaemonProcess
from tools.soaklib.faults import FaultInjector, fault_schedule
from tools.soaklib.l3 import L3Dir
from tools.soaklib.plot import plot_rounds
from tools.soaklib.recorder import CLIENT_SIDE, DOCUMENTED, Recorder, ttft_summary
from tools.soaklib.reference import (
    ReferenceDaemon,
    check_answers,
    engine_config,
    flag_mismatches,
)
from tools.soaklib.traffic import Traffic
from tools.soaklib.workload import Workload

# what tests and other tools import from here
__all__ = [
    "CLIENT_SIDE",
    "DOCUMENTED",
    "DaemonProcess",
    "L3Dir",
    "Recorder",
    "SoakConfig",
    "Traffic",
    "Workload",
    "check_round",
    "format_summary",
    "greedy_outputs",
    "kv_accounting",
    "main",
    "run_soak",
    "wait_idle",
]


def run_soak(cfg: SoakConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole soak; the result dict (also what --out gets). result["passed"]."""
    own_dir = cfg.work_dir is None
    work = Path(cfg.work_dir or tempfile.mkdtemp(prefix="hicache-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    l3 = L3Dir(work, cfg.l3_fs_mb)
    daemon = DaemonProcess(cfg, work, l3.path)
    rec = Recorder()
    faults = FaultInjector(cfg, daemon, l3, rec, log)
    rounds_out: list[dict[str, Any]] = []
    traffic: Traffic | None = None
    result: dict[str, Any] = {"config": asdict(cfg), "work_dir": str(work), "l3_tmpfs": l3.mounted}
    t_start = time.monotonic()
    try:
        daemon.start()
        took = daemon.wait_serving()
        log(
            f"daemon SERVING on {daemon.addr} after {took:.1f}s (L3 {l3.path}"
            f"{', tmpfs' if l3.mounted else ''})"
        )
        with HicacheClient(daemon.addr, timeout=RPC_TIMEOUT_S) as c:
            wl = Workload(c.model_info().vocab_size, cfg)
            soaked_config = engine_config(c.server_info())
            rec.phase = "fresh daemon's check prompts"
            reference = greedy_outputs(c, wl.check_prompts, cfg.check_new_tokens, rec=rec)
        n_rounds = max(3, round(cfg.duration_s / cfg.round_s))
        schedule = fault_schedule(cfg, n_rounds)
        traffic = Traffic(daemon.addr, cfg, wl, rec).start()
        rng = random.Random(cfg.seed + 3)
        for r, group in enumerate(schedule):
            t_round = time.monotonic()
            n_calls, _ = rec.snapshot()
            rec.phase = f"round {r} ({'+'.join(group) or 'clean'})"
            if group:
                time.sleep(cfg.round_s * rng.uniform(0.2, 0.4))
                for fault in group:
                    log(f"round {r}: {fault}")
                    faults.inject(fault)
            time.sleep(max(0.0, t_round + cfg.round_s - time.monotonic()))
            traffic.pause()
            faults.drain_check()
            rec.phase += " end-of-round check"
            with HicacheClient(daemon.addr, timeout=RPC_TIMEOUT_S) as c:
                info = check_round(
                    c, rec, wl, reference, l3, label=f"round {r} {'+'.join(group) or 'clean'}: "
                )
            info.update(
                round=r,
                faults=group,
                pid=daemon.pid,
                rss_kb=daemon.rss_kb(),
                requests=rec.snapshot()[0] - n_calls,
                codes=rec.histogram(n_calls),
                ttft_s=ttft_summary(rec.ttfts(n_calls)),
                violations=rec.snapshot()[1],
                seconds=round(time.monotonic() - t_round, 1),
            )
            rounds_out.append(info)
            log(
                f"round {r} done: {info['requests']} calls {info['codes']}, rss "
                f"{info['rss_kb'] / 1024:.0f} MiB, leaks {info['leaks']}, "
                f"violations so far {info['violations']}"
            )
            traffic.resume()
        traffic.stop()
        rc = daemon.stop()
        if rc != 0:
            rec.violate("shutdown", f"exit status {rc} after the final SIGTERM")
        result["reference_check"] = _reference_check(cfg, work, rec, soaked_config, log)
    finally:
        if traffic is not None:
            traffic.pauser.stop()
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.proc.kill()
            daemon.proc.wait()
        l3.cleanup()
    problems = daemon.log_problems()
    for p in problems:
        if "Traceback" in p:
            rec.violate("daemon log", p)
    result.update(_summary(cfg, rec, faults, rounds_out, problems, time.monotonic() - t_start))
    if own_dir and result["passed"]:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _reference_check(
    cfg: SoakConfig, work: Path, rec: Recorder, soaked: dict[str, str], log: Callable[[str], None]
) -> dict[str, Any]:
    """Every answer against its prompt computed alone on a fresh daemon (after the soaked one
    stopped: the cores are the reference's); mismatches are violations."""
    ref = ReferenceDaemon(cfg, work)
    try:
        took = ref.start()
        theirs = ref.engine_config()
        differ = sorted(k for k in soaked.keys() | theirs.keys() if soaked.get(k) != theirs.get(k))
        if differ:
            rec.violate(
                "reference check",
                "the reference daemon's ServerArgs differ: "
                + ", ".join(f"{k} {soaked.get(k)} vs {theirs.get(k)}" for k in differ),
            )
            return {"error": f"ServerArgs differ: {differ}"}
        log(f"reference daemon SERVING after {took:.1f}s: {len(rec.answers)} answers to check")

        def progress(done: int, total: int) -> None:
            if done % max(1, total // 10) == 0:
                log(f"  references {done}/{total}")

        report = check_answers(rec.answers, ref.compute, rec.faults, progress)
        rc = ref.stop()
        if rc != 0:
            rec.violate("shutdown", f"the reference daemon's exit status {rc}")
    except (grpc.RpcError, RuntimeError) as e:
        rec.violate("reference check", f"{type(e).__name__}: {e}"[:500])
        return {"error": str(e)[:500]}
    finally:
        proc = ref.daemon.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        for p in ref.log_problems():
            if "Traceback" in p:
                rec.violate("daemon log", f"reference {p}")
    flag_mismatches(rec, report)
    log(
        f"reference check: {report.checked} answers against {report.references} references "
        f"in {report.seconds:.0f}s, {len(report.mismatches)} mismatches"
    )
    return report.to_dict()


def _summary(
    cfg: SoakConfig,
    rec: Recorder,
    faults: FaultInjector,
    rounds: list[dict[str, Any]],
    log_problems: list[str],
    seconds: float,
) -> dict[str, Any]:
    rss = rss_verdict(cfg, rounds)
    if rss.get("flat") is False:
        rec.violate(
            "memory",
            f"RSS grew {rss['last_two_kb'][0]} -> {rss['last_two_kb'][1]} kB "
            f"between the last two rounds ({rss['tolerance']})",
        )
    leaks_last = rounds[-1]["leaks"] if rounds else {}
    violations = {k: {"count": len(v), "examples": v[:5]} for k, v in rec.violations.items()}
    return {
        "seconds": round(seconds, 1),
        "requests": len(rec.calls),
        "codes": rec.histogram(),
        "codes_per_rpc": rec.per_rpc(),
        "faults_injected": dict(faults.injected),
        "faults_skipped": faults.skipped,
        "fault_details": dict(faults.details),
        "ttft_s": ttft_summary(rec.ttfts()),
        "rss": rss,
        "leaked_slots": {
            "last_round": leaks_last,
            "max": {
                t: max((abs(r["leaks"].get(t, 0)) for r in rounds), default=0)
                for t in ("l1", "l2", "l3")
            },
        },
        "greedy_mismatches": sum(r.get("greedy_mismatches", 0) for r in rounds),
        "reference_mismatches": len(rec.violations.get("reference mismatch", [])),
        "rounds": rounds,
        "daemon_log_problems": log_problems[:50],
        "violations": violations,
        "passed": not rec.violations,
    }


def format_summary(res: dict[str, Any]) -> str:
    rss, ttft = res["rss"], res["ttft_s"]
    lines = [
        f"soak: {res['requests']} calls in {res['seconds']:.0f}s, {len(res['rounds'])} rounds",
        f"  codes: {res['codes']}",
        f"  faults injected: {res['faults_injected']}"
        + (f"; skipped: {res['faults_skipped']}" if res["faults_skipped"] else ""),
        f"  TTFT p50 {_ms(ttft['p50'])} p99 {_ms(ttft['p99'])} ({ttft['n']} requests)",
        (
            f"  RSS first {rss['first_kb'] / 1024:.0f} MiB, last {rss['last_kb'] / 1024:.0f} MiB,"
            f" last two rounds {[round(x / 1024) for x in rss.get('last_two_kb', [])]} MiB "
            f"(flat: {rss.get('flat')}, {rss['tolerance']})"
        ),
        (
            f"  leaked slots (last round): {res['leaked_slots']['last_round']}; greedy "
            f"mismatches: {res['greedy_mismatches']}"
        ),
    ]
    ref = res.get("reference_check", {})
    if "checked" in ref:
        lines.append(
            f"  against the prompt alone on a fresh daemon: {ref['checked']} answers checked "
            f"({ref['greedy']} greedy, {ref['seeded']} seeded; {ref['whole']} whole, "
            f"{ref['partial']} partial; prefix from {ref['served_from']}) against "
            f"{ref['references']} references in {ref['seconds']:.0f}s, "
            f"{ref['mismatch_count']} mismatches ({ref['unseeded']} unseeded not checked)"
        )
    elif ref:
        lines.append(f"  reference check not done: {ref.get('error')}")
    for kind, v in res["violations"].items():
        lines.append(f"  VIOLATION {kind} x{v['count']}: {v['examples'][0]}")
    lines.append("PASSED" if res["passed"] else "FAILED")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = SoakConfig()
    ap.add_argument("--duration-s", type=float, default=d.duration_s)
    ap.add_argument("--round-s", type=float, default=d.round_s)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--model",
        default=None,
        help="HF dir or .gguf (default: the embedded SmolLM2-135M-Instruct, as `hicache serve`)",
    )
    ap.add_argument(
        "--faults",
        default=",".join(ALL_FAULTS),
        help=f"comma-separated groups of {', '.join(ALL_FAULTS)} ('a+b': one round), or none",
    )
    ap.add_argument("--fault-hold-s", type=float, default=d.fault_hold_s)
    ap.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument(
        "--daemon-arg",
        action="append",
        default=[],
        help="an extra `hicache "
        "serve` argument, for the soaked and the reference daemon alike "
        "(repeatable; e.g. --daemon-arg=--quantization=none)",
    )
    ap.add_argument("--rss-tolerance-mb", type=float, default=d.rss_tolerance_mb)
    ap.add_argument("--rss-tolerance-frac", type=float, default=d.rss_tolerance_frac)
    ap.add_argument(
        "--work-dir", default=None, help="kept (default: a temp dir, removed when the soak passed)"
    )
    ap.add_argument("--out", default=None, help="JSON results")
    ap.add_argument(
        "--plot",
        default=None,
        help="PNG: TTFT, calls by status code and daemon RSS per round, with each round's faults",
    )
    a = ap.parse_args(argv)
    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip())
    unknown = {x for g in faults for x in g.split("+")} - set(ALL_FAULTS) - {"none"}
    if unknown:
        ap.error(f"unknown faults: {', '.join(sorted(unknown))}")
    # the flags named as SoakConfig's fields; --faults parsed above
    same = {k: v for k, v in vars(a).items() if k in SoakConfig.__dataclass_fields__}
    cfg = replace(d, **{**same, "faults": faults, "extra_args": tuple(a.daemon_arg)})
    header = Header.now()
    res = run_soak(cfg)
    res.update(header.record([a.plot]))
    if a.plot:
        plot_rounds(res, a.plot)
    if a.out:
        write_json(a.out, res)
    print(format_summary(res))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
