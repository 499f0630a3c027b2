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
down or draining); the daemon is SERVING; after Unpin-all and idle, the KV accounting of
every tier is exact (L1 / L2: used == cached, nothing locked, pinned or held by requests; the
tree's node residency sums to the same; L3: the index equals the files on disk, nothing
pending); greedy check prompts give the token ids the fresh daemon gave before any traffic;
the daemon's RSS. At the end: RSS of the last two (clean, same process) rounds within
--rss-tolerance-mb / --rss-tolerance-frac, and no traceback in the daemon's log.

    .venv/bin/python tools/soak.py --duration-s 1200 --clients 8 --out soak.json
    .venv/bin/python tools/soak.py --duration-s 60 --faults corrupt+delete,kill9 --model DIR

--out gets requests, the status histogram (overall and per RPC), faults injected / skipped,
TTFT p50 / p99, RSS per round (first / last), leaked slots per tier, every violation. Exit
status 0 when nothing was violated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

from engine.client import HicacheClient

ALL_FAULTS = ("corrupt", "delete", "readonly", "diskfull", "kill9", "sigterm")
# docs/daemon.md "Status codes" and "Security"; OK
DOCUMENTED = frozenset({
    "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "FAILED_PRECONDITION",
    "ALREADY_EXISTS", "NOT_FOUND", "UNIMPLEMENTED", "UNAUTHENTICATED", "PERMISSION_DENIED"})
CLIENT_SIDE = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})  # only when the caller asked
OUTAGE_MARGIN_S = 2.0  # UNAVAILABLE still allowed this long after SERVING again
RPC_TIMEOUT_S = 60.0  # unary calls; a DEADLINE_EXCEEDED at this deadline is a hang
STREAM_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class SoakConfig:
    model: str | None = None  # None: the daemon's embedded default (SmolLM2-135M-Instruct)
    duration_s: float = 180.0
    round_s: float = 30.0
    clients: int = 8
    seed: int = 0
    # fault groups, one per faulty round; "a+b" injects a and b in the same round
    faults: tuple[str, ...] = ALL_FAULTS
    fault_hold_s: float = 6.0  # how long readonly / diskfull last
    # the daemon: small pools for memory pressure
    max_total_tokens: int = 2048
    page_size: int = 16
    hicache_ratio: float = 2.0
    storage_object_tokens: int = 16
    l3_cap_mb: int = 512
    l3_fs_mb: int = 768  # the tmpfs (as root) holding L3: larger than the cap
    max_queued_requests: int = 6
    grace_period_s: float = 30.0
    extra_args: tuple[str, ...] = ()
    # the workload (tokens)
    prefix_tokens: tuple[int, int] = (64, 192)
    question_tokens: tuple[int, int] = (8, 48)
    max_new_tokens: int = 24
    max_prompt_tokens: int = 700
    check_prompts: int = 4
    check_new_tokens: int = 16
    # memory: last two rounds' RSS may differ by at most max(mb, frac x the first)
    rss_tolerance_mb: float = 48.0
    rss_tolerance_frac: float = 0.05
    startup_timeout_s: float = 600.0
    work_dir: str | None = None  # None: a fresh temp dir, removed at the end


# ---- recording ------------------------------------------------------------------------------
@dataclass
class Call:
    rpc: str
    variant: str
    code: str
    t0: float
    t1: float
    ttft: float | None = None
    first: float | None = None  # first response received (monotonic)


class Recorder:
    """Every call's status; violations; the windows in which the daemon was down or draining."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[Call] = []
        self.violations: dict[str, list[str]] = collections.defaultdict(list)
        self.windows: list[list[float]] = []  # [start, end]; end = inf while open
        self._local = threading.local()

    def open_window(self) -> int:
        with self._lock:
            self.windows.append([time.monotonic(), float("inf")])
            return len(self.windows) - 1

    def close_window(self, idx: int) -> None:
        with self._lock:
            self.windows[idx][1] = time.monotonic() + OUTAGE_MARGIN_S

    def in_outage(self, t: float) -> bool:
        with self._lock:
            return any(a <= t <= b for a, b in self.windows)

    def violate(self, kind: str, detail: str) -> None:
        with self._lock:
            self.violations[kind].append(detail)

    def record(self, call: Call, allowed: Iterable[str], detail: str = "") -> None:
        """``allowed``: the codes this call may end with (OK and what it provoked)."""
        with self._lock:
            self.calls.append(call)
        if call.code == "UNAVAILABLE":
            self._local.unavailable = True
        if call.code in allowed:
            return
        if call.code == "UNAVAILABLE" and self.in_outage(call.t1):
            return
        kind = "undocumented status" if call.code not in DOCUMENTED else "unexpected status"
        self.violate(kind, f"{call.rpc}/{call.variant}: {call.code} {detail}"[:300])

    def take_unavailable(self) -> bool:
        """Whether this thread saw UNAVAILABLE since it last asked."""
        seen = getattr(self._local, "unavailable", False)
        self._local.unavailable = False
        return seen

    def calls_since(self, t: float) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.t1 >= t]

    def count(self, rpc: str, code: str = "OK") -> int:
        with self._lock:
            return sum(1 for c in self.calls if c.rpc == rpc and c.code == code)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return len(self.calls), sum(len(v) for v in self.violations.values())

    def histogram(self, since: int = 0) -> dict[str, int]:
        with self._lock:
            return dict(collections.Counter(c.code for c in self.calls[since:]).most_common())

    def per_rpc(self) -> dict[str, dict[str, int]]:
        out: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        with self._lock:
            for c in self.calls:
                out[c.rpc][c.code] += 1
        return {k: dict(v.most_common()) for k, v in sorted(out.items())}

    def ttfts(self) -> list[float]:
        with self._lock:
            return [c.ttft for c in self.calls if c.ttft is not None and c.code == "OK"]


def _code(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    return code.name if code is not None else "UNKNOWN"


def _details(e: grpc.RpcError) -> str:
    return (e.details() if hasattr(e, "details") else str(e)) or ""


# ---- the workload ---------------------------------------------------------------------------
class Workload:
    """Shared prefixes (system prompts), per-conversation namespaces, the greedy check prompts."""

    NAMESPACES = ("", "", "soak-a", "soak-b")

    def __init__(self, vocab_size: int, cfg: SoakConfig) -> None:
        rng = random.Random(cfg.seed)
        self.cfg = cfg
        self.lo, self.hi = min(32, vocab_size // 8), vocab_size
        self.prefixes = [self.ids(rng, rng.randint(*cfg.prefix_tokens)) for _ in range(3)]
        n = max(1, cfg.check_prompts)
        # sharing the traffic's prefixes: the checks meet whatever the cache holds of them
        self.check_prompts = [self.prefixes[i % 3] + self.ids(rng, 8 + 3 * i) for i in range(n - 1)]
        self.check_prompts.append(self.ids(rng, cfg.prefix_tokens[0]))

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]

    def sampling(self, rng: random.Random) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": rng.randint(1, self.cfg.max_new_tokens),
                              "ignore_eos": rng.random() < 0.7}
        if rng.random() < 0.6:
            sp["temperature"] = 0.0
        else:
            sp.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 31))
        return sp


class Conversation:
    """A multi-turn chat as token ids: a shared prefix, then question / answer turns."""

    def __init__(self, wl: Workload, rng: random.Random) -> None:
        self.wl = wl
        self.ns = rng.choice(Workload.NAMESPACES)
        self.ids = list(rng.choice(wl.prefixes)) + wl.ids(rng, rng.randint(*wl.cfg.question_tokens))
        self.turns = 0

    def advance(self, answer: list[int], rng: random.Random) -> bool:
        """Appends the answer and a new question; False when the conversation is over."""
        self.turns += 1
        self.ids += answer + self.wl.ids(rng, rng.randint(*self.wl.cfg.question_tokens))
        limit = self.wl.cfg.max_prompt_tokens - self.wl.cfg.max_new_tokens - 64
        return self.turns < 6 and len(self.ids) < limit


# ---- calls ----------------------------------------------------------------------------------
@dataclass
class StreamResult:
    code: str
    ids: list[int] = field(default_factory=list)
    finish: str = ""
    abort_message: str = ""
    completes: int = 0
    first: float | None = None
    end: float = 0.0


FINISH = {0: "UNSPECIFIED", 1: "STOP", 2: "LENGTH", 3: "ABORT"}


def stream_generate(rec: Recorder, c: HicacheClient, ids: list[int], variant: str,
                    allowed: set[str], finishes: set[str], *, rid: str = "", ns: str = "",
                    timeout: float = STREAM_TIMEOUT_S, cancel_after: int | None = None,
                    on_first: Callable[[], bool] | None = None,
                    **sampling: Any) -> StreamResult:
    """One Generate stream, recorded; checks it ends with exactly one ``complete`` whose
    finish reason is in ``finishes`` and whose usage agrees with the tokens streamed.
    ``on_first`` runs at the first response; the stream is cancelled when it returns True."""
    t0 = time.monotonic()
    res = StreamResult("OK")
    usage = None
    chunks = 0
    try:
        call = c.generate(ids, request_id=rid, namespace=ns, timeout=timeout, **sampling)
        for r in call:
            if res.first is None:
                res.first = time.monotonic()
                if on_first is not None and on_first():
                    call.cancel()
            if r.HasField("chunk"):
                chunks += 1
                res.ids += r.chunk.token_ids
                if cancel_after is not None and chunks >= cancel_after:
                    call.cancel()
            else:
                res.completes += 1
                res.finish = FINISH.get(r.complete.finish_reason, "?")
                res.abort_message = r.complete.abort_message
                usage = r.complete.usage
    except grpc.RpcError as e:
        res.code = _code(e)
        res.abort_message = _details(e)
    res.end = time.monotonic()
    first_token = res.first if res.ids else None
    rec.record(Call("Generate", variant, res.code, t0, res.end,
                    ttft=(first_token - t0) if first_token and variant == "plain" else None,
                    first=res.first), allowed | {"OK"}, res.abort_message)
    if res.code == "OK":
        if res.completes != 1:
            rec.violate("stream shape", f"{variant}: {res.completes} complete messages")
        elif res.finish not in finishes:
            rec.violate("unexpected finish", f"{variant}: {res.finish} {res.abort_message!r}")
        elif usage is not None and usage.completion_tokens != len(res.ids):
            rec.violate("usage", f"{variant}: completion_tokens {usage.completion_tokens} "
                        f"!= {len(res.ids)} streamed")
        mx = sampling.get("max_new_tokens")
        if mx is not None and (len(res.ids) > mx or (
                res.finish == "LENGTH" and sampling.get("ignore_eos") and len(res.ids) != mx)):
            rec.violate("length", f"{variant}: {len(res.ids)} tokens for max_new_tokens {mx}")
    return res


def unary(rec: Recorder, rpc: str, fn: Callable[[], Any], allowed: Iterable[str] = (),
          variant: str = "") -> Any:
    """One unary admin call, recorded; its response or None."""
    t0 = time.monotonic()
    try:
        out = fn()
        code, detail = "OK", ""
    except grpc.RpcError as e:
        out, code, detail = None, _code(e), _details(e)
    rec.record(Call(rpc, variant or rpc, code, t0, time.monotonic()), {"OK", *allowed}, detail)
    return out


# ---- traffic --------------------------------------------------------------------------------
class Pauser:
    """Workers call checkpoint() between actions; pause() returns once all are parked."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._cond = threading.Condition()
        self._paused = False
        self._parked = 0
        self.stopped = False

    def checkpoint(self) -> None:
        with self._cond:
            if not self._paused or self.stopped:
                return
            self._parked += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._paused or self.stopped)
            self._parked -= 1

    def pause(self, timeout: float) -> bool:
        with self._cond:
            self._paused = True
            return self._cond.wait_for(lambda: self._parked >= self.n, timeout)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def exited(self) -> None:
        """A worker that leaves counts as parked for good."""
        with self._cond:
            self.n -= 1
            self._cond.notify_all()


class Traffic:
    """--clients conversation threads and one admin thread against ``addr``."""

    CLIENT_ACTIONS = (("plain", 60), ("cancel", 10), ("deadline", 8), ("abort", 6),
                      ("dup_running", 3), ("dup_simultaneous", 3))
    ADMIN_ACTIONS = (("stats", 14), ("match", 12), ("tree", 8), ("evict", 8), ("pin", 8),
                     ("unpin", 8), ("prefetch", 10), ("flush", 6), ("storage", 4),
                     ("server_info", 4), ("events", 4), ("abort_unknown", 4))

    def __init__(self, addr: str, cfg: SoakConfig, wl: Workload, rec: Recorder,
                 skip_admin: tuple[str, ...] = ()) -> None:
        self.addr, self.cfg, self.wl, self.rec = addr, cfg, wl, rec
        self.admin_actions = tuple(a for a in self.ADMIN_ACTIONS if a[0] not in skip_admin)
        self.pauser = Pauser(cfg.clients + 1)
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True,
                                         name=f"soak-client-{i}") for i in range(cfg.clients)]
        self.threads.append(threading.Thread(target=self._admin, daemon=True, name="soak-admin"))
        self.pins: list[str] = []
        self._seq = 0
        self._lock = threading.Lock()

    def start(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def pause(self, timeout: float = STREAM_TIMEOUT_S + 30) -> None:
        if not self.pauser.pause(timeout):
            self.rec.violate("hang", f"traffic did not pause within {timeout:.0f}s")

    def resume(self) -> None:
        self.pauser.resume()

    def stop(self) -> None:
        self.pauser.stop()
        for t in self.threads:
            t.join(STREAM_TIMEOUT_S + 30)

    def _rid(self, kind: str) -> str:
        with self._lock:
            self._seq += 1
            return f"soak-{kind}-{self._seq}"

    def _loop(self, seed: int, step: Callable[[HicacheClient, random.Random], None]) -> None:
        rng = random.Random(seed)
        c = HicacheClient(self.addr, timeout=RPC_TIMEOUT_S)
        try:
            while not self.pauser.stopped:
                self.pauser.checkpoint()
                if self.pauser.stopped:
                    break
                try:
                    step(c, rng)
                except Exception as e:  # noqa: BLE001 - a bug in this tool or the client
                    self.rec.violate("client exception", f"{type(e).__name__}: {e}")
                if self.rec.take_unavailable():
                    # down or draining: a fresh channel reconnects at once (no backoff)
                    c.close()
                    time.sleep(0.5)
                    c = HicacheClient(self.addr, timeout=RPC_TIMEOUT_S)
                time.sleep(rng.random() * 0.03)
        finally:
            c.close()
            self.pauser.exited()

    # -- clients
    def _client(self, i: int) -> None:
        conv: list[Conversation | None] = [None]

        def step(c: HicacheClient, rng: random.Random) -> None:
            if conv[0] is None:
                conv[0] = Conversation(self.wl, rng)
            cv = conv[0]
            action = _choose(rng, self.CLIENT_ACTIONS)
            res = getattr(self, f"_gen_{action}")(c, rng, cv)
            if res is not None and res.code == "OK" and not cv.advance(res.ids, rng):
                conv[0] = None

        self._loop(self.cfg.seed * 1000 + i, step)

    def _gen_plain(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> StreamResult:
        return stream_generate(self.rec, c, cv.ids, "plain", {"RESOURCE_EXHAUSTED"},
                               {"STOP", "LENGTH"}, ns=cv.ns, **self.wl.sampling(rng))

    def _gen_cancel(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        sp = self.wl.sampling(rng) | {"max_new_tokens": self.cfg.max_new_tokens}
        stream_generate(self.rec, c, cv.ids, "cancel", {"CANCELLED", "RESOURCE_EXHAUSTED"},
                        {"STOP", "LENGTH"}, ns=cv.ns, cancel_after=rng.randint(1, 4), **sp)

    def _gen_deadline(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        stream_generate(self.rec, c, cv.ids, "deadline", {"DEADLINE_EXCEEDED",
                        "RESOURCE_EXHAUSTED"}, {"STOP", "LENGTH"}, ns=cv.ns,
                        timeout=rng.uniform(0.01, 1.0), **self.wl.sampling(rng))

    def _gen_abort(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        rid = self._rid("abort")
        found: list[Any] = []

        def abort() -> bool:
            found.append(unary(self.rec, "Abort", lambda: c.abort(rid)))
            return False

        stream_generate(self.rec, c, cv.ids, "abort", {"RESOURCE_EXHAUSTED"},
                        {"STOP", "LENGTH", "ABORT"}, rid=rid, ns=cv.ns, on_first=abort,
                        max_new_tokens=64, ignore_eos=True, temperature=0.0)

    def _gen_dup_running(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        """The same id while the first request runs (64 tokens to go; cancelled once the
        second call returned): ALREADY_EXISTS."""
        rid = self._rid("dup")
        second: list[StreamResult] = []

        def again() -> bool:
            second.append(stream_generate(
                self.rec, c, cv.ids, "dup_second", {"ALREADY_EXISTS", "RESOURCE_EXHAUSTED"},
                {"STOP", "LENGTH"}, rid=rid, ns=cv.ns, max_new_tokens=2, temperature=0.0))
            return True

        first = stream_generate(self.rec, c, cv.ids, "dup_first",
                                {"CANCELLED", "RESOURCE_EXHAUSTED"}, {"STOP", "LENGTH"},
                                rid=rid, ns=cv.ns, on_first=again, max_new_tokens=64,
                                ignore_eos=True, temperature=0.0)
        if second and second[0].code == "OK" and first.completes == 0:
            self.rec.violate("duplicate request_id", f"{rid}: a second call ran while the "
                             "first was running")

    def _gen_dup_simultaneous(self, c: HicacheClient, rng: random.Random,
                              cv: Conversation) -> None:
        """Two calls with one new id at once: one runs, the other gets ALREADY_EXISTS."""
        rid = self._rid("dup2")
        barrier = threading.Barrier(2)
        out: list[StreamResult | None] = [None, None]

        def run(k: int) -> None:
            with HicacheClient(self.addr, timeout=RPC_TIMEOUT_S) as c2:
                try:
                    barrier.wait(5)
                except threading.BrokenBarrierError:
                    pass
                out[k] = stream_generate(
                    self.rec, c2, cv.ids, "dup_pair", {"ALREADY_EXISTS", "RESOURCE_EXHAUSTED"},
                    {"STOP", "LENGTH"}, rid=rid, ns=cv.ns, max_new_tokens=24, ignore_eos=True,
                    temperature=0.0)

        t = threading.Thread(target=run, args=(1,), daemon=True)
        t.start()
        run(0)
        t.join(STREAM_TIMEOUT_S + 10)
        a, b = out
        if a is None or b is None:
            return
        if a.code == b.code == "OK" and a.first and b.first and a.first < b.end \
                and b.first < a.end:
            self.rec.violate("duplicate request_id", f"{rid}: both simultaneous calls ran")
        if a.code == b.code == "ALREADY_EXISTS":
            self.rec.violate("duplicate request_id", f"{rid}: both calls refused")

    # -- admin
    def _admin(self) -> None:
        def step(c: HicacheClient, rng: random.Random) -> None:
            getattr(self, f"_admin_{_choose(rng, self.admin_actions)}")(c, rng)
            time.sleep(rng.uniform(0.02, 0.2))

        self._loop(self.cfg.seed * 1000 + 999, step)

    def _some_prefix(self, rng: random.Random) -> list[int]:
        p = rng.choice(self.wl.prefixes)
        return p[: rng.randint(1, len(p))] if rng.random() < 0.5 else list(p)

    def _admin_stats(self, c: HicacheClient, rng: random.Random) -> None:
        unary(self.rec, "GetCacheStats", c.cache_stats)

    def _admin_match(self, c: HicacheClient, rng: random.Random) -> None:
        p, ns = self._some_prefix(rng), rng.choice(Workload.NAMESPACES)
        unary(self.rec, "MatchPrefix", lambda: c.match_prefix(p, namespace=ns))

    def _admin_tree(self, c: HicacheClient, rng: random.Random) -> None:
        token = ""
        for _ in range(rng.randint(1, 3)):
            page = unary(self.rec, "InspectTree", lambda t=token: c.inspect_tree(
                rng.randint(1, 50), t, rng.randint(1, 32)))
            if page is None or not page.next_page_token:
                return
            token = page.next_page_token

    def _admin_evict(self, c: HicacheClient, rng: random.Random) -> None:
        tier = rng.choice(("l1", "l1", "l2", "l3"))
        kw: dict[str, Any] = {"dry_run": rng.random() < 0.3}
        target = rng.choice(("num_tokens", "prefix", "all"))
        if target == "num_tokens":
            kw["num_tokens"] = rng.randint(1, self.cfg.max_total_tokens // 2)
        elif target == "prefix":
            kw.update(prefix=self._some_prefix(rng), namespace=rng.choice(Workload.NAMESPACES))
        else:
            kw["all"] = True
        allowed = {"FAILED_PRECONDITION"} if tier == "l3" else set()  # L3: use Flush
        unary(self.rec, "Evict", lambda: c.evict(tier, **kw), allowed)

    def _admin_pin(self, c: HicacheClient, rng: random.Random) -> None:
        p, ns = self._some_prefix(rng), rng.choice(Workload.NAMESPACES)
        ttl = rng.choice((0.0, 0.5, 3.0))
        r = unary(self.rec, "Pin", lambda: c.pin(p, ttl_s=ttl, namespace=ns),
                  {"FAILED_PRECONDITION"})
        if r is not None and r.pin_id:
            self.pins.append(r.pin_id)

    def _admin_unpin(self, c: HicacheClient, rng: random.Random) -> None:
        if self.pins and rng.random() < 0.8:
            pid = self.pins.pop(rng.randrange(len(self.pins)))
            unary(self.rec, "Unpin", lambda: c.unpin(pid), {"NOT_FOUND"}, "Unpin/id")
        else:
            self.pins.clear()
            unary(self.rec, "Unpin", lambda: c.unpin(None), (), "Unpin/all")

    def _admin_prefetch(self, c: HicacheClient, rng: random.Random) -> None:
        p, ns = self._some_prefix(rng), rng.choice(Workload.NAMESPACES)
        pin = rng.random() < 0.4
        t0 = time.monotonic()
        stages, code, detail, pin_id = [], "OK", "", ""
        try:
            for r in c.prefetch(p, namespace=ns, pin=pin, pin_ttl_s=rng.choice((0.0, 2.0)),
                                timeout=STREAM_TIMEOUT_S):
                stages.append(r.stage)
                pin_id = r.pin_id or pin_id
        except grpc.RpcError as e:
            code, detail = _code(e), _details(e)
        self.rec.record(Call("Prefetch", "Prefetch", code, t0, time.monotonic()),
                        {"OK", "RESOURCE_EXHAUSTED"}, detail)
        if code == "OK" and (not stages or stages[-1] != 3):  # PREFETCH_STAGE_DONE
            self.rec.violate("stream shape", f"Prefetch stages {stages}")
        if pin_id:
            self.pins.append(pin_id)

    def _admin_flush(self, c: HicacheClient, rng: random.Random) -> None:
        tiers = rng.choice((None, ["l1"], ["l2"], ["l1", "l2"], ["l3"]))
        timeout = rng.uniform(0.05, 1.0)
        unary(self.rec, "Flush", lambda: c.flush(tiers, timeout), {"FAILED_PRECONDITION"})

    def _admin_storage(self, c: HicacheClient, rng: random.Random) -> None:
        unary(self.rec, "GetStorage", c.storage)

    def _admin_server_info(self, c: HicacheClient, rng: random.Random) -> None:
        unary(self.rec, "GetServerInfo", c.server_info)

    def _admin_events(self, c: HicacheClient, rng: random.Random) -> None:
        t0 = time.monotonic()
        code, detail = "OK", ""
        try:
            for i, _ in enumerate(c.watch_events(after_seq=rng.choice((0, None)), timeout=0.3)):
                if i >= 50:
                    break
        except grpc.RpcError as e:
            code, detail = _code(e), _details(e)
        self.rec.record(Call("WatchCacheEvents", "WatchCacheEvents", code, t0, time.monotonic()),
                        {"OK", "DEADLINE_EXCEEDED", "CANCELLED"}, detail)

    def _admin_abort_unknown(self, c: HicacheClient, rng: random.Random) -> None:
        r = unary(self.rec, "Abort", lambda: c.abort(self._rid("nobody")), (), "Abort/unknown")
        if r is not None and r.found:
            self.rec.violate("abort", "Abort of an unknown request_id found one")


def _choose(rng: random.Random, table: tuple[tuple[str, int], ...]) -> str:
    return rng.choices([a for a, _ in table], weights=[w for _, w in table])[0]


# ---- the daemon and its L3 directory --------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    """`hicache serve` as a subprocess on a fixed port and L3 dir; restartable."""

    def __init__(self, cfg: SoakConfig, work_dir: Path, l3_dir: Path) -> None:
        self.cfg, self.work_dir, self.l3_dir = cfg, work_dir, l3_dir
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.logs: list[Path] = []

    def argv(self) -> list[str]:
        c = self.cfg
        args = [sys.executable, "-m", "engine.cli", "serve", "--host", "127.0.0.1",
                "--port", str(self.port), "--metrics-port", "0",
                "--hicache-storage-dir", str(self.l3_dir),
                "--hicache-storage-size-gb", f"{c.l3_cap_mb / 1024:.6f}",
                "--hicache-storage-page-size", str(c.storage_object_tokens),
                "--hicache-prefetch-threshold", "0", "--hicache-ratio", str(c.hicache_ratio),
                "--max-total-tokens", str(c.max_total_tokens), "--page-size", str(c.page_size),
                "--max-queued-requests", str(c.max_queued_requests),
                "--grace-period-s", str(c.grace_period_s), "--debug-check-invariants"]
        if c.model:
            args += ["--model", c.model]
        return args + list(c.extra_args)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("HICACHE_") or k == "HICACHE_MODEL_CACHE"}
        env.update(XDG_CACHE_HOME=str(self.work_dir / "xdg"), HICACHE_LOG_LEVEL="info",
                   PYTHONUNBUFFERED="1")
        log = self.work_dir / f"daemon-{len(self.logs)}.log"
        self.logs.append(log)
        with open(log, "w") as out:
            self.proc = subprocess.Popen(self.argv(), cwd=self.work_dir, env=env, stdout=out,
                                         stderr=subprocess.STDOUT)

    def wait_serving(self) -> float:
        """Seconds until health is SERVING; RuntimeError (with the log's tail) if it exits."""
        t0 = time.monotonic()
        with HicacheClient(self.addr, timeout=5) as c:
            while True:
                if self.proc is None or self.proc.poll() is not None:
                    raise RuntimeError(f"the daemon exited: {self.log_tail()}")
                try:
                    if c.health() == "SERVING":
                        return time.monotonic() - t0
                except grpc.RpcError:
                    pass
                if time.monotonic() - t0 > self.cfg.startup_timeout_s:
                    raise RuntimeError(f"not SERVING after {self.cfg.startup_timeout_s:.0f}s")
                time.sleep(0.1)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_kb(self) -> int:
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.signal(signal.SIGTERM)
        rc = self.wait(self.cfg.grace_period_s + 60)
        if rc is None:
            self.proc.kill()
            self.proc.wait()
        return rc

    def log_tail(self, n: int = 3000) -> str:
        return self.logs[-1].read_text(errors="replace")[-n:] if self.logs else ""

    def log_problems(self) -> list[str]:
        """Tracebacks and ERROR lines in every log of this daemon."""
        out = []
        for log in self.logs:
            lines = log.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                if " ERROR " in line or line.startswith("Traceback"):
                    out.append(f"{log.name}:{i + 1}: {line[:200]}")
        return out


class L3Dir:
    """The daemon's L3 directory and the faults done to it. As root (CAP_SYS_ADMIN) it is a
    tmpfs of its own, so read-only is a remount and disk-full a filler file."""

    def __init__(self, root: Path, fs_mb: int = 0, mount: bool = True) -> None:
        self.path = root / "kv"
        self.path.mkdir(parents=True, exist_ok=True)
        self.mounted = False
        if mount and fs_mb and os.geteuid() == 0 and shutil.which("mount"):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={fs_mb}m,mode=0700",
                                "tmpfs", str(self.path)], capture_output=True, text=True,
                               check=False)
            self.mounted = r.returncode == 0
            if self.mounted:
                atexit.register(self.cleanup)
        self._filler = self.path / ".filler"  # not under a fan-out dir: not an object

    def unsupported(self, fault: str) -> str | None:
        """Why ``fault`` cannot be done honestly here (None: it can)."""
        if fault == "readonly" and not self.mounted and os.geteuid() == 0:
            return "root without mount rights: chmod does not stop root's writes"
        if fault == "diskfull" and not self.mounted:
            return "needs a size-limited filesystem (a tmpfs mount needs root / CAP_SYS_ADMIN)"
        return None

    def files(self) -> list[Path]:
        out = []
        try:
            for sub in os.scandir(self.path):
                if sub.is_dir():
                    out += [Path(e.path) for e in os.scandir(sub.path) if e.name.endswith(".kv")]
        except FileNotFoundError:
            pass
        return sorted(out)

    def usage(self) -> tuple[int, int]:
        """(object files, their bytes) on disk."""
        n = size = 0
        for p in self.files():
            try:
                size += p.stat().st_size
                n += 1
            except FileNotFoundError:
                pass
        return n, size

    def corrupt(self, rng: random.Random, n: int) -> int:
        """Flip 1-4 bytes in each of up to ``n`` random object files (header or payload)."""
        done = 0
        files = self.files()
        for p in rng.sample(files, min(n, len(files))):
            try:
                with open(p, "r+b") as f:
                    size = os.fstat(f.fileno()).st_size
                    for _ in range(rng.randint(1, 4)):
                        off = rng.randrange(size)
                        f.seek(off)
                        b = f.read(1)
                        f.seek(off)
                        f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                done += 1
            except (FileNotFoundError, IndexError):
                pass
        return done

    def delete(self, rng: random.Random, n: int) -> int:
        """Remove up to ``n`` random object files; one time in three a whole fan-out dir."""
        files = self.files()
        if files and rng.random() < 1 / 3:
            victim = rng.choice(files).parent
            count = len(list(victim.glob("*.kv")))
            shutil.rmtree(victim, ignore_errors=True)
            return count
        done = 0
        for p in rng.sample(files, min(n, len(files))):
            try:
                p.unlink()
                done += 1
            except FileNotFoundError:
                pass
        return done

    def set_readonly(self, on: bool) -> None:
        if self.mounted:
            opt = "remount,ro" if on else "remount,rw"
            for _ in range(100):  # EBUSY while a file is open for writing
                r = subprocess.run(["mount", "-o", opt, str(self.path)], capture_output=True,
                                   text=True, check=False)
                if r.returncode == 0:
                    return
                time.sleep(0.05)
            raise RuntimeError(f"mount -o {opt} failed: {r.stderr.strip()}")
        mode = 0o500 if on else 0o700
        for d in [self.path, *(p for p in self.path.iterdir() if p.is_dir())]:
            os.chmod(d, mode)

    def fill(self, on: bool) -> None:
        """Fill the filesystem to the last byte (a filler file), or free it again."""
        if not on:
            self._filler.unlink(missing_ok=True)
            return
        chunk = b"\0" * (1 << 20)
        with open(self._filler, "wb", buffering=0) as f:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        f.write(chunk[:size])
                except OSError:
                    continue

    def cleanup(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
            self.mounted = False


# ---- checks ---------------------------------------------------------------------------------
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
        if l2.enabled and (l2.extra.get("ongoing_writes", 0) or
                           l2.extra.get("pending_free_tokens", 0)):
            busy.append("l2 writes")
        if l3.enabled and any(l3.extra.get(k, 0) for k in
                              ("pending_backups", "pending_prefetches", "deferred_backups")):
            busy.append("l3 pending")
        if not busy:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(", ".join(busy))
        time.sleep(0.1)


def kv_accounting(c: HicacheClient, l3: L3Dir | None, timeout: float = 15.0
                  ) -> tuple[dict[str, int], list[str]]:
    """Leaked slots per tier and the problems found, on an idle daemon with no pins. L3's
    index converges to the disk at its next idle rescan (about a second): polled."""
    deadline = time.monotonic() + timeout
    while True:
        leaks, problems = _accounting_once(c, l3)
        if not problems or time.monotonic() > deadline:
            return leaks, problems
        time.sleep(0.5)


def _accounting_once(c: HicacheClient, l3: L3Dir | None
                     ) -> tuple[dict[str, int], list[str]]:
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
        free = int(t.extra.get("free_tokens", 0))
        leaks[tier] = t.used_tokens - cached
        enum = 1 if tier == "l1" else 2
        in_tree = sum(n.token_length for n in nodes if enum in n.residency)
        if t.used_tokens != cached:
            problems.append(f"{tier}: used {t.used_tokens} != cached {cached}")
        if t.used_tokens + free != t.capacity_tokens:
            problems.append(f"{tier}: used {t.used_tokens} + free {free} != capacity "
                            f"{t.capacity_tokens}")
        if in_tree != cached:
            problems.append(f"{tier}: tree nodes hold {in_tree} tokens, stats say {cached}")
    l1 = s.tiers[0]
    if l1.pinned_tokens or l1.extra.get("held_by_requests_tokens", 0):
        problems.append(f"l1: {l1.pinned_tokens} protected, "
                        f"{int(l1.extra.get('held_by_requests_tokens', 0))} held by requests")
    if l1.evictable_tokens != int(l1.extra.get("cached_tokens", 0)):
        problems.append(f"l1: evictable {l1.evictable_tokens} != cached "
                        f"{int(l1.extra.get('cached_tokens', 0))} with nothing locked")
    t3 = s.tiers[2]
    if t3.enabled and l3 is not None:
        files, size = l3.usage()
        objects, nbytes = int(t3.extra.get("objects", 0)), int(t3.extra.get("bytes", 0))
        leaks["l3"] = objects - files
        if (objects, nbytes) != (files, size):
            problems.append(f"l3: index {objects} objects / {nbytes} bytes, disk {files} files "
                            f"/ {size} bytes")
        if t3.used_tokens != objects * int(t3.extra.get("object_tokens", 0)):
            problems.append(f"l3: used_tokens {t3.used_tokens} != objects x object_tokens")
    return leaks, problems


def greedy_outputs(c: HicacheClient, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    for p in prompts:
        _, ids, _ = c.generate_text(p, max_new_tokens=n, temperature=0.0, ignore_eos=True,
                                    timeout=STREAM_TIMEOUT_S)
        out.append(ids)
    return out


def check_round(c: HicacheClient, rec: Recorder, wl: Workload, reference: list[list[int]],
                l3: L3Dir | None) -> dict[str, Any]:
    """The end-of-round checks on a paused workload; violations go to ``rec``."""
    out: dict[str, Any] = {}
    health = c.health()
    if health != "SERVING":
        rec.violate("health", f"health {health} after the round")
    c.unpin(None)
    try:
        wait_idle(c)
        got = greedy_outputs(c, wl.check_prompts, wl.cfg.check_new_tokens)
        bad = [i for i, (a, b) in enumerate(zip(got, reference)) if a != b]
        out["greedy_mismatches"] = len(bad)
        for i in bad:
            rec.violate("greedy output", f"check prompt {i}: {got[i]} != fresh {reference[i]}")
        wait_idle(c)
    except TimeoutError as e:
        rec.violate("not idle", f"still busy after 60 s: {e}")
    leaks, problems = kv_accounting(c, l3)
    out["leaks"] = leaks
    for p in problems:
        rec.violate("kv accounting", p)
    return out


# ---- faults ---------------------------------------------------------------------------------
class FaultInjector:
    def __init__(self, cfg: SoakConfig, daemon: DaemonProcess | None, l3: L3Dir,
                 rec: Recorder, log: Callable[[str], None]) -> None:
        self.cfg, self.daemon, self.l3, self.rec, self.log = cfg, daemon, l3, rec, log
        self.rng = random.Random(cfg.seed + 7)
        self.injected: collections.Counter = collections.Counter()
        self.skipped: dict[str, str] = {}
        self.details: collections.Counter = collections.Counter()
        self.sigterms: list[float] = []  # monotonic times, checked at the round's end

    def supported(self, fault: str) -> bool:
        why = self.l3.unsupported(fault)
        if why is None and fault in ("kill9", "sigterm") and self.daemon is None:
            why = "an in-process daemon cannot be killed"
        if why is not None:
            self.skipped[fault] = why
        return why is None

    def inject(self, fault: str) -> None:
        if not self.supported(fault):
            return
        getattr(self, f"_{fault}")()
        self.injected[fault] += 1

    def _wait_for_files(self, timeout: float = 10.0) -> None:
        """A flush may just have emptied L3: give the traffic time to store objects again."""
        deadline = time.monotonic() + timeout
        while not self.l3.files() and time.monotonic() < deadline:
            time.sleep(0.2)

    def _corrupt(self) -> None:
        self._wait_for_files()
        n = self.l3.corrupt(self.rng, self.rng.randint(1, 8))
        self.details["files_corrupted"] += n
        self.log(f"  corrupted {n} L3 files")

    def _delete(self) -> None:
        self._wait_for_files()
        n = self.l3.delete(self.rng, self.rng.randint(1, 8))
        self.details["files_deleted"] += n
        self.log(f"  deleted {n} L3 files")

    def _readonly(self) -> None:
        self.l3.set_readonly(True)
        self.log(f"  L3 read-only for {self.cfg.fault_hold_s:g}s")
        time.sleep(self.cfg.fault_hold_s)
        self.l3.set_readonly(False)

    def _diskfull(self) -> None:
        self.l3.fill(True)
        self.log(f"  L3 filesystem full for {self.cfg.fault_hold_s:g}s")
        time.sleep(self.cfg.fault_hold_s)
        self.l3.fill(False)

    def _kill9(self) -> None:
        d = self.daemon
        assert d is not None
        w = self.rec.open_window()
        d.signal(signal.SIGKILL)
        d.wait(60)
        self._restart(w)

    def _sigterm(self) -> None:
        """New work gets UNAVAILABLE, health NOT_SERVING, the daemon exits 0; the streams
        running at the signal must finish (checked by drain_check once the round paused)."""
        d = self.daemon
        assert d is not None
        w = self.rec.open_window()
        self.sigterms.append(time.monotonic())
        d.signal(signal.SIGTERM)
        time.sleep(0.2)
        with HicacheClient(d.addr, timeout=5) as c:
            try:
                h = c.health()
                if h != "NOT_SERVING":
                    self.rec.violate("drain", f"health {h} while draining")
            except grpc.RpcError:
                pass  # already gone
        rc = d.wait(self.cfg.grace_period_s + 60)
        if rc != 0:
            self.rec.violate("drain", f"exit status {rc} after SIGTERM")
        self._restart(w)

    def drain_check(self) -> None:
        """Every Generate stream that had its first response before a SIGTERM ended OK (the
        ones this tool cancels or gives a short deadline aside)."""
        for t_sig in self.sigterms:
            running = [x for x in self.rec.calls_since(t_sig) if x.rpc == "Generate"
                       and x.first is not None and x.first < t_sig]
            self.details["streams_running_at_sigterm"] += len(running)
            for x in running:
                if x.code != "OK" and x.variant not in ("cancel", "deadline", "dup_first"):
                    self.rec.violate("drain", f"{x.variant} stream running at SIGTERM ended "
                                     f"{x.code}")
        self.sigterms.clear()

    def _restart(self, window: int) -> None:
        d = self.daemon
        assert d is not None
        d.start()
        took = d.wait_serving()
        self.rec.close_window(window)
        self.log(f"  restarted on the same L3 dir: SERVING after {took:.1f}s")


def fault_schedule(cfg: SoakConfig, rounds: int) -> list[list[str]]:
    """Round 0 and the last two clean; the groups of cfg.faults cycle over the rounds between
    (several groups per round when there are fewer rounds than groups)."""
    groups = [g.split("+") for g in cfg.faults if g and g != "none"]
    middle = max(0, rounds - 3)
    sched: list[list[str]] = [[] for _ in range(rounds)]
    if not groups or middle == 0:
        return sched
    n = max(middle, len(groups))
    for i in range(n):
        sched[1 + i % middle] += groups[i % len(groups)]
    return sched


# ---- the run --------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


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
    result: dict[str, Any] = {"config": asdict(cfg), "work_dir": str(work),
                              "l3_tmpfs": l3.mounted}
    t_start = time.monotonic()
    try:
        daemon.start()
        took = daemon.wait_serving()
        log(f"daemon SERVING on {daemon.addr} after {took:.1f}s (L3 {l3.path}"
            f"{', tmpfs' if l3.mounted else ''})")
        with HicacheClient(daemon.addr, timeout=RPC_TIMEOUT_S) as c:
            wl = Workload(c.model_info().vocab_size, cfg)
            reference = greedy_outputs(c, wl.check_prompts, cfg.check_new_tokens)
        n_rounds = max(3, round(cfg.duration_s / cfg.round_s))
        schedule = fault_schedule(cfg, n_rounds)
        traffic = Traffic(daemon.addr, cfg, wl, rec).start()
        rng = random.Random(cfg.seed + 3)
        for r, group in enumerate(schedule):
            t_round = time.monotonic()
            n_calls, _ = rec.snapshot()
            if group:
                time.sleep(cfg.round_s * rng.uniform(0.2, 0.4))
                for fault in group:
                    log(f"round {r}: {fault}")
                    faults.inject(fault)
            time.sleep(max(0.0, t_round + cfg.round_s - time.monotonic()))
            traffic.pause()
            faults.drain_check()
            with HicacheClient(daemon.addr, timeout=RPC_TIMEOUT_S) as c:
                info = check_round(c, rec, wl, reference, l3)
            info.update(round=r, faults=group, pid=daemon.pid, rss_kb=daemon.rss_kb(),
                        requests=rec.snapshot()[0] - n_calls, codes=rec.histogram(n_calls),
                        violations=rec.snapshot()[1], seconds=round(time.monotonic() - t_round,
                                                                    1))
            rounds_out.append(info)
            log(f"round {r} done: {info['requests']} calls {info['codes']}, rss "
                f"{info['rss_kb'] / 1024:.0f} MiB, leaks {info['leaks']}, "
                f"violations so far {info['violations']}")
            traffic.resume()
        traffic.stop()
        rc = daemon.stop()
        if rc != 0:
            rec.violate("shutdown", f"exit status {rc} after the final SIGTERM")
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


def rss_verdict(cfg: SoakConfig, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """RSS of the last two rounds (one process, clean rounds): flat within the tolerance."""
    same = [(a, b) for a, b in itertools.pairwise(rounds) if a["pid"] == b["pid"]]
    out: dict[str, Any] = {
        "first_kb": rounds[0]["rss_kb"] if rounds else 0,
        "last_kb": rounds[-1]["rss_kb"] if rounds else 0,
        "per_round_kb": [r["rss_kb"] for r in rounds],
        "max_round_growth_kb": max((b["rss_kb"] - a["rss_kb"] for a, b in same), default=0),
        "tolerance": f"max({cfg.rss_tolerance_mb:g} MiB, {cfg.rss_tolerance_frac:.0%})"}
    if len(rounds) >= 2 and rounds[-1]["pid"] == rounds[-2]["pid"]:
        a, b = rounds[-2]["rss_kb"], rounds[-1]["rss_kb"]
        tol = max(cfg.rss_tolerance_mb * 1024, cfg.rss_tolerance_frac * a)
        out.update(last_two_kb=[a, b], flat=b - a <= tol)
    return out


def _summary(cfg: SoakConfig, rec: Recorder, faults: FaultInjector,
             rounds: list[dict[str, Any]], log_problems: list[str], seconds: float
             ) -> dict[str, Any]:
    rss = rss_verdict(cfg, rounds)
    if rss.get("flat") is False:
        rec.violate("memory", f"RSS grew {rss['last_two_kb'][0]} -> {rss['last_two_kb'][1]} kB "
                    f"between the last two rounds ({rss['tolerance']})")
    ttft = rec.ttfts()
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
        "ttft_s": {"p50": _pct(ttft, 0.5), "p99": _pct(ttft, 0.99), "n": len(ttft)},
        "rss": rss,
        "leaked_slots": {"last_round": leaks_last,
                         "max": {t: max((abs(r["leaks"].get(t, 0)) for r in rounds), default=0)
                                 for t in ("l1", "l2", "l3")}},
        "greedy_mismatches": sum(r.get("greedy_mismatches", 0) for r in rounds),
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
        (f"  RSS first {rss['first_kb'] / 1024:.0f} MiB, last {rss['last_kb'] / 1024:.0f} MiB,"
         f" last two rounds {[round(x / 1024) for x in rss.get('last_two_kb', [])]} MiB "
         f"(flat: {rss.get('flat')}, {rss['tolerance']})"),
        (f"  leaked slots (last round): {res['leaked_slots']['last_round']}; greedy "
         f"mismatches: {res['greedy_mismatches']}"),
    ]
    for kind, v in res["violations"].items():
        lines.append(f"  VIOLATION {kind} x{v['count']}: {v['examples'][0]}")
    lines.append("PASSED" if res["passed"] else "FAILED")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    ap.add_argument("--duration-s", type=float, default=d.duration_s)
    ap.add_argument("--round-s", type=float, default=d.round_s)
    ap.add_argument("--clients", type=int, default=d.clients)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the embedded "
                    "SmolLM2-135M-Instruct, as `hicache serve`)")
    ap.add_argument("--faults", default=",".join(ALL_FAULTS),
                    help=f"comma-separated groups of {', '.join(ALL_FAULTS)} ('a+b': one "
                    "round), or none")
    ap.add_argument("--fault-hold-s", type=float, default=d.fault_hold_s)
    ap.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens)
    ap.add_argument("--page-size", type=int, default=d.page_size)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--rss-tolerance-mb", type=float, default=d.rss_tolerance_mb)
    ap.add_argument("--rss-tolerance-frac", type=float, default=d.rss_tolerance_frac)
    ap.add_argument("--work-dir", default=None, help="kept (default: a temp dir, removed "
                    "when the soak passed)")
    ap.add_argument("--out", default=None, help="JSON results")
    a = ap.parse_args(argv)
    faults = tuple(f.strip() for f in a.faults.split(",") if f.strip())
    unknown = {x for g in faults for x in g.split("+")} - set(ALL_FAULTS) - {"none"}
    if unknown:
        ap.error(f"unknown faults: {', '.join(sorted(unknown))}")
    cfg = replace(d, model=a.model, duration_s=a.duration_s, round_s=a.round_s,
                  clients=a.clients, seed=a.seed, faults=faults, fault_hold_s=a.fault_hold_s,
                  max_total_tokens=a.max_total_tokens, page_size=a.page_size,
                  max_new_tokens=a.max_new_tokens, rss_tolerance_mb=a.rss_tolerance_mb,
                  rss_tolerance_frac=a.rss_tolerance_frac, work_dir=a.work_dir)
    res = run_soak(cfg)
    res["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(format_summary(res))
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
