"""The end-of-round checks: idle, the KV accounting of every tier, greedy outputs equal to the
fresh daemon's, SERVING; and at the end, RSS flat over the last two rounds."""

from __future__ import annotations

import itertools
import time
from typing import Any

from engine.client import HicacheClient
from tools.soaklib.calls import FINISH, usage_tiers
from tools.soaklib.config import STREAM_TIMEOUT_S, SoakConfig
from tools.soaklib.l3 import L3Dir
from tools.soaklib.recorder import Recorder
from tools.soaklib.workload import Workload


def wait_idle(c: HicacheClient, timeout: float = 60.0) -> Any:
    """Polls until nothing runs, waits, is locked, or is in flight between tiers; the last
    stats (raises TimeoutError with what is still busy)."""
    deadline = time.monotonic() + timeout
    while True:
        s = c.cache_stats()
        busy = []
        if c.server_info().active_requests:
            busy.append("active requests")
        l1, l2, l3 = s.tiers
        if l1.extra.get("held_by_requests_tokens", 0) or l1.pinned_tokens:
            busy.append("l1 held / locked")
        if l2.enabled and (
            l2.extra.get("ongoing_writes", 0) or l2.extra.get("pending_free_tokens", 0)
        ):
            busy.append("l2 writes")
        if l3.enabled and any(
            l3.extra.get(k, 0)
            for k in ("pending_backups", "pending_prefetches", "deferred_backups")
        ):
            busy.append("l3 pending")
        if not busy:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(", ".join(busy))
        time.sleep(0.1)


def kv_accounting(
    c: HicacheClient, l3: L3Dir | None, timeout: float = 15.0
) -> tuple[dict[str, int], list[str]]:
    """Leaked slots per tier and the problems found, on an idle daemon with no pins. L3's
    index converges to the disk at its next idle rescan (about a second): polled."""
    deadline = time.monotonic() + timeout
    while True:
        leaks, problems = _accounting_once(c, l3)
        if not problems or time.monotonic() > deadline:
            return leaks, problems
        time.sleep(0.5)


def _accounting_once(c: HicacheClient, l3: L3Dir | None) -> tuple[dict[str, int], list[str]]:
    s = c.cache_stats()
    nodes = list(c.iter_tree(page_size=1000, preview_tokens=1))
    problems: list[str] = []
    leaks = {"l1": 0, "l2": 0, "l3": 0}
    if s.num_pins or s.admin_pinned_tokens:
        problems.append(f"pins left: {s.num_pins} ({s.admin_pinned_tokens} tokens)")
    locked = [n.node_id for n in nodes if n.lock_ref or n.pinned]
    if locked:
        problems.append(f"{len(locked)} tree nodes locked or pinned when idle")
    for tier, t in zip(("l1", "l2"), s.tiers[:2]):
        if not t.enabled:
            continue
        cached = int(t.extra.get("cached_tokens", 0))
        leaks[tier] = t.used_tokens - cached
        enum = 1 if tier == "l1" else 2
        in_tree = sum(n.token_length for n in nodes if enum in n.residency)
        if t.used_tokens != cached:
            problems.append(f"{tier}: used {t.used_tokens} != cached {cached}")
        if in_tree != cached:
            problems.append(f"{tier}: tree nodes hold {in_tree} tokens, stats say {cached}")
    l1 = s.tiers[0]
    if l1.pinned_tokens or l1.extra.get("held_by_requests_tokens", 0):
        problems.append(
            f"l1: {l1.pinned_tokens} protected, "
            f"{int(l1.extra.get('held_by_requests_tokens', 0))} held by requests"
        )
    if l1.evictable_tokens != int(l1.extra.get("cached_tokens", 0)):
        problems.append(
            f"l1: evictable {l1.evictable_tokens} != cached "
            f"{int(l1.extra.get('cached_tokens', 0))} with nothing locked"
        )
    t3 = s.tiers[2]
    if t3.enabled and l3 is not None:
        files, size = l3.usage()
        # NOTE: the index counts objects; stats report them in tokens (whole objects)
        per_object = int(t3.extra.get("object_tokens", 0))
        objects, nbytes = t3.used_tokens // per_object, int(t3.extra.get("bytes", 0))
        leaks["l3"] = objects - files
        if (objects, nbytes) != (files, size):
            problems.append(
                f"l3: index {objects} objects / {nbytes} bytes, disk {files} files / {size} bytes"
            )
    return leaks, problems


def greedy_outputs(
    c: HicacheClient,
    prompts: list[list[int]],
    n: int,
    sources: list[str] | None = None,
    rec: Recorder | None = None,
    variant: str = "check",
) -> list[list[int]]:
    """Each prompt's greedy continuation; ``sources`` (when given) gets, per prompt, where its
    cached prefix came from ("l1=.. l2=.. l3=.. of N"); ``rec`` (when given) keeps the answers
    for the reference check."""
    out = []
    sampling = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    for p in prompts:
        t0 = time.monotonic()
        _, ids, done = c.generate_text(p, timeout=STREAM_TIMEOUT_S, **sampling)
        out.append(ids)
        if rec is not None:
            rec.answer(
                variant,
                p,
                sampling,
                ids,
                code="OK",
                finish=FINISH.get(done.finish_reason, "?"),
                cached=usage_tiers(done.usage),
                t0=t0,
                t1=time.monotonic(),
            )
        if sources is not None:
            t = done.usage.cached_tokens_per_tier
            sources.append(f"l1={t.l1} l2={t.l2} l3={t.l3} of {len(p)}")
    return out


def _forensics(
    c: HicacheClient, prompt: list[int], reference: list[int], n: int, rec: Recorder
) -> str:
    """After a greedy mismatch: the prompt again as the cache now holds it, then from L2 only
    (L1 evicted), then from L3 only (L2 evicted too): which tier holds the wrong KV."""
    out = []
    for step, tiers in (("again", ()), ("without l1", ("l1",)), ("without l1+l2", ("l1", "l2"))):
        for tier in tiers:
            c.evict(tier, all=True)
        sources: list[str] = []
        ids = greedy_outputs(c, [prompt], n, sources, rec, "forensics")[0]
        out.append(f"{step}: {'same as fresh' if ids == reference else ids} (cached {sources[0]})")
    return "; ".join(out)


def check_round(
    c: HicacheClient,
    rec: Recorder,
    wl: Workload,
    reference: list[list[int]],
    l3: L3Dir | None,
    label: str = "",
) -> dict[str, Any]:
    """The end-of-round checks on a paused workload; violations go to ``rec`` (their text
    starts with ``label``: the round and its faults)."""
    out: dict[str, Any] = {}
    health = c.health()
    if health != "SERVING":
        rec.violate("health", f"health {health} after the round")
    c.unpin(None)
    try:
        wait_idle(c)
        sources: list[str] = []
        got = greedy_outputs(c, wl.check_prompts, wl.cfg.check_new_tokens, sources, rec)
        bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
        out["greedy_mismatches"] = len(bad)
        for i in bad:
            rec.violate(
                "greedy output",
                f"{label}check prompt {i} (cached {sources[i]}): "
                f"{got[i]} != fresh {reference[i]}; "
                + _forensics(c, wl.check_prompts[i], reference[i], wl.cfg.check_new_tokens, rec),
            )
        wait_idle(c)
    except TimeoutError as e:
        rec.violate("not idle", f"still busy after 60 s: {e}")
    leaks, problems = kv_accounting(c, l3)
    out["leaks"] = leaks
    for p in problems:
        rec.violate("kv accounting", p)
    return out


def rss_verdict(cfg: SoakConfig, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS of the last two rounds (one process, clean rounds): flat within the tolerance."""
    same = [(a, b) for a, b in itertools.pairwise(rounds) if a["pid"] == b["pid"]]
    out: dict[str, Any] = {
        "first_kb": rounds[0]["rss_kb"] if rounds else 0,
        "last_kb": rounds[-1]["rss_kb"] if rounds else 0,
        "per_round_kb": [r["rss_kb"] for r in rounds],
        "max_round_growth_kb": max((b["rss_kb"] - a["rss_kb"] for a, b in same), default=0),
        "tolerance": f"max({cfg.rss_tolerance_mb:g} MiB, {cfg.rss_tolerance_frac:.0%})",
    }
    if len(rounds) >= 2 and rounds[-1]["pid"] == rounds[-2]["pid"]:
        a, b = rounds[-2]["rss_kb"], rounds[-1]["rss_kb"]
        tol = max(cfg.rss_tolerance_mb * 1024, cfg.rss_tolerance_frac * a)
        out.update(last_two_kb=[a, b], flat=b - a <= tol)
    return out
