"""In-process Engine runs, as tools/bench_multiturn.py, bench_pressure.py and bench_l3.py make
them: random token-id prompts; one streamed request timed to its first token (it never raises);
requests grouped by step with the tier each prompt should come from (``Steps``); the cache's
per-tier counters before and after a run; the engine's warnings counted (``LogTally``); the
four cache configurations (radix off, L1, L1+L2, L1+L2+L3); clients on threads; the figures of
TTFT by tier and of hits by tier."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import queue
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine import Engine
from hicache.tier import TIERS
from tools.benchlib.options import parse_options

TOK_LO, TOK_HI = 1000, 40000  # ordinary vocabulary ids, no special tokens
NAN = float("nan")


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOK_LO, TOK_HI) for _ in range(n)]


def distinct_prompt(seed: int, n: int, avoid: list[list[int]]) -> list[int]:
    """n random ids whose first token starts none of ``avoid`` (no shared prefix)."""
    rng = random.Random(seed)
    while True:
        p = rand_tokens(rng, n)
        if all(p[0] != q[0] for q in avoid):
            return p


WARMUP = rand_tokens(random.Random(7), 16)


class Outcome(NamedTuple):
    ttft_s: float
    total_s: float
    output_ids: list[int]
    tiers: dict[str, int]  # cached_tokens_per_tier of the last chunk
    cached: int
    error: str | None  # None: finished normally


def timed_request(eng: Engine, ids: list[int], max_new: int, timeout_s: float) -> Outcome:
    """Submit and stream, greedy and ``ignore_eos``; TTFT = the first chunk with a token. Never
    raises: errors, aborts, a dead scheduler thread and timeouts (the request is then aborted)
    come back in .error."""
    t0 = time.perf_counter()
    try:
        h = eng.submit(ids, {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True})
    except Exception as e:  # noqa: BLE001
        return Outcome(NAN, NAN, [], {}, 0, f"submit: {type(e).__name__}: {e}")
    ttft, last = None, None
    out: list[int] = []
    while last is None or not last.finished:
        try:
            c = h.chunks.get(timeout=1.0)
        except queue.Empty:
            if not h.alive():
                return Outcome(NAN, NAN, out, {}, 0, "the scheduler thread stopped")
            if time.perf_counter() - t0 > timeout_s:
                eng.abort(h.rid)
                return Outcome(NAN, NAN, out, {}, 0, f"no result after {timeout_s:.0f} s (aborted)")
            continue
        if ttft is None and c.token_ids:
            ttft = time.perf_counter() - t0
        out += c.token_ids
        last = c
    total = time.perf_counter() - t0
    err = last.error or ("aborted" if last.finish_reason == "abort" else None)
    tiers = dict(last.cached_tokens_per_tier or {})
    return Outcome(ttft if ttft is not None else total, total, out, tiers, last.cached_tokens, err)


def tiers_str(t: dict[str, int]) -> str:
    return ",".join(f"{k}={t.get(k, 0)}" for k in TIERS)


@dataclass
class Steps:
    """Timed requests grouped by step, each printed as it comes: its TTFT, total time, the
    tiers its prefix came from, its error, and whether it came from ``tier_of[step]`` (None: a
    step that must find nothing cached; a step not named there is not checked)."""

    output_len: int
    timeout_s: float
    label: dict[str, str]
    tier_of: dict[str, str | None]
    prefix: str = ""  # of each printed line
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def run(self, eng: Engine, step: str, ids: list[int]) -> Outcome:
        o = timed_request(eng, ids, self.output_len, self.timeout_s)
        tier = self.tier_of.get(step, "")  # "": not checked
        ok = o.error is None and (
            tier == "" or (o.cached == 0 if tier is None else o.tiers.get(tier, 0) > 0)
        )
        sample = {"ttft_s": o.ttft_s, "total_s": o.total_s, "tiers": o.tiers, "cached": o.cached}
        self.samples.setdefault(step, []).append({**sample, "error": o.error, "ok": ok})
        flag = "" if ok else f"  NOT FROM {tier} {o.error or ''}"
        print(
            f"  {self.prefix}{self.label[step]:>19}: TTFT {o.ttft_s * 1e3:8.1f} ms, total "
            f"{o.total_s * 1e3:8.1f} ms, {tiers_str(o.tiers)}{flag}",
            flush=True,
        )
        return o

    def engine(self, opts: dict[str, Any], warmup: list[int] = WARMUP) -> Engine:
        """A new Engine of ``opts`` that served ``warmup`` (one token, not recorded)."""
        eng = Engine(**opts)
        timed_request(eng, warmup, 1, self.timeout_s)
        return eng

    def restarts(
        self,
        opts: dict[str, Any],
        step: str,
        prompts: list[list[int]],
        warmup: list[int] = WARMUP,
        then: Callable[[Engine], None] | None = None,
    ) -> None:
        """Each prompt on a fresh Engine of ``opts`` (only L3 can serve it), ``then(engine)``
        after it."""
        for p in prompts:
            eng = self.engine(opts, warmup)
            try:
                self.run(eng, step, p)
                if then is not None:
                    then(eng)
            finally:
                eng.shutdown()

    def values(self, step: str, key: str = "ttft_s") -> list[float]:
        return [x[key] for x in self.samples.get(step, [])]


def stats_dict(record: Any) -> dict[str, Any] | None:
    """A stats record (hicache.observe.stats) as JSON-ready dicts; None stays None (a tier not
    there)."""
    return dataclasses.asdict(record) if record is not None else None


def stats_snapshot(eng: Engine) -> dict[str, Any]:
    s = eng.cache_stats()
    return {
        **{t: (tier.hit_tokens if (tier := s.tier(t)) is not None else 0) for t in TIERS},
        "miss": s.miss_tokens,
        "prompt": s.prompt_tokens,
        "raw": dataclasses.asdict(s),
    }


def tier_hits(before: dict[str, Any], after: dict[str, Any], prompt_tokens: int = 0) -> dict:
    """Hit and miss tokens per tier between two ``stats_snapshot``s, and the hit rates: hit
    tokens / the prompt tokens the cache counted (``prompt_tokens`` when it counted none)."""
    d = {k: after[k] - before[k] for k in (*TIERS, "miss", "prompt")}
    prompt = d["prompt"] or prompt_tokens or 1
    return {
        "hit_tokens": {t: d[t] for t in TIERS},
        "miss_tokens": d["miss"],
        "hit_rate": {t: d[t] / prompt for t in TIERS},
        "hit_rate_total": sum(d[t] for t in TIERS) / prompt,
    }


HIT_COLUMNS = ["L1 hit", "L2 hit", "L3 hit", "total hit"]


def hit_cells(row: dict[str, Any]) -> list[str]:
    """A run's hit rates (``tier_hits``), per tier and in all, as a table's cells."""
    return [*(f"{row['hit_rate'][t]:.1%}" for t in TIERS), f"{row['hit_rate_total']:.1%}"]


class LogTally(logging.Handler):
    """On the root logger: the records of WARNING and above, counted. The scheduler's "did not
    fit the KV pool; requeued" apart (counted, not shown: it comes by the thousand under
    pressure); the others counted by level, logger and message start and shown on stderr;
    the first five tracebacks kept."""

    REQUEUE = "did not fit the KV pool"

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        self.reset()
        logging.getLogger().addHandler(self)

    def reset(self) -> None:
        self.requeues = 0
        self.counts: dict[str, int] = {}
        self.tracebacks: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.REQUEUE in record.getMessage():
            self.requeues += 1
            return
        key = f"{record.levelname} {record.name}: {str(record.msg)[:90]}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if record.exc_info and len(self.tracebacks) < 5:
            self.tracebacks.append(self.format(record))
        print(self.format(record), file=sys.stderr, flush=True)

    def summary(self) -> dict[str, Any]:
        c = self.counts
        return {
            "kv_requeue_warnings": self.requeues,
            "warnings": dict(c),
            "logged_warnings": sum(v for k, v in c.items() if k.startswith("WARNING")),
            "logged_errors": sum(v for k, v in c.items() if not k.startswith("WARNING")),
            "tracebacks": list(self.tracebacks),
        }


def add_engine_args(ap: argparse.ArgumentParser) -> None:
    """--model, --device and --opt KEY=VALUE (repeatable): the options of every Engine a run
    makes (``engine_options``)."""
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Engine option for every engine (value parsed as JSON if it can be), "
        "e.g. --opt hicache_storage_prefetch_policy=wait_complete",
    )


def engine_options(a: argparse.Namespace) -> dict[str, Any]:
    return {"model": a.model, "device": a.device, **parse_options(a.opt)}


def tier_configs(
    base: dict[str, Any], l2: dict[str, Any], l3: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The cache configurations, by name: radix off; L1 (``base``); L1+L2 (``l2``'s options
    added); L1+L2+L3 (a file L3 too, ``l3``'s options added: its dir at least)."""
    hi = {**base, "enable_hierarchical_cache": True, **l2}
    return [
        ("radix off", {**base, "disable_radix_cache": True}),
        ("L1", dict(base)),
        ("L1+L2", hi),
        ("L1+L2+L3", {**hi, "hicache_storage_backend": "file", **l3}),
    ]


def run_clients(
    n: int, client: Callable[[int], None], give_up_at: float, progress: Callable[[], str] | None
) -> int:
    """``client(i)`` for i < n, each on a thread of its own, until all return or
    time.perf_counter() passes ``give_up_at``; ``progress()`` printed every 30 s. The number
    of clients still running."""
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    next_beat = time.perf_counter() + 30
    while any(t.is_alive() for t in threads) and time.perf_counter() < give_up_at:
        for t in threads:
            t.join(min(0.5, max(0.0, give_up_at - time.perf_counter())))
        if progress is not None and time.perf_counter() > next_beat:
            next_beat += 30
            print(progress(), flush=True)
    return sum(t.is_alive() for t in threads)


def plot_tier_hits(ax: Any, names: Sequence[Any], rows: list[dict[str, Any]]) -> None:
    """Stacked bars: per-tier hit rate (% of prompt tokens) of each config."""
    bottom = [0.0] * len(rows)
    for t, c in zip(TIERS, ("tab:green", "tab:purple", "tab:brown"), strict=True):
        v = [r["hit_rate"][t] * 100 for r in rows]
        ax.bar(names, v, bottom=bottom, color=c, label=t.upper())
        bottom = [b + y for b, y in zip(bottom, v, strict=True)]
    ax.set_title("prompt tokens hit, by tier (%)")
    ax.set_ylim(0, 100)


def plot_ttft(ax: Any, ttft_ms: dict[str, float], colors: list[str], title: str) -> None:
    """TTFT (ms) by where the prompt was served from: bars on a log scale, each labelled."""
    bars = ax.bar(list(ttft_ms), list(ttft_ms.values()), color=colors)
    for b, y in zip(bars, ttft_ms.values(), strict=True):
        ax.text(b.get_x() + b.get_width() / 2, y, f"{y:.0f}", ha="center", va="bottom")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT (ms, log)")
    ax.set_title(title)
