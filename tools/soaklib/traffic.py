"""The traffic: --clients conversation threads (plain streams, cancels, short deadlines, Abort
by id, duplicate request ids) and one admin thread, all parked between rounds by a Pauser."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.client import HicacheClient
from tools.soaklib.admin import AdminActions
from tools.soaklib.calls import StreamResult, stream_generate, unary
from tools.soaklib.config import RPC_TIMEOUT_S, STREAM_TIMEOUT_S, SoakConfig
from tools.soaklib.recorder import Recorder
from tools.soaklib.workload import Conversation, Workload, choose

GREEDY_64: dict[str, Any] = {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0.0}


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

    CLIENT_ACTIONS = (
        ("plain", 60),
        ("cancel", 10),
        ("deadline", 8),
        ("abort", 6),
        ("dup_running", 3),
        ("dup_simultaneous", 3),
    )

    def __init__(
        self,
        addr: str,
        cfg: SoakConfig,
        wl: Workload,
        rec: Recorder,
        skip_admin: tuple[str, ...] = (),
    ) -> None:
        self.addr, self.cfg, self.wl, self.rec = addr, cfg, wl, rec
        self.admin = AdminActions(cfg, wl, rec, self._rid, skip_admin)
        self.pauser = Pauser(cfg.clients + 1)
        self.threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True, name=f"soak-client-{i}")
            for i in range(cfg.clients)
        ]
        self.threads.append(threading.Thread(target=self._admin, daemon=True, name="soak-admin"))
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
            action = choose(rng, self.CLIENT_ACTIONS)
            res = getattr(self, f"_gen_{action}")(c, rng, cv)
            if res is not None and res.code == "OK" and not cv.advance(res.ids, rng):
                conv[0] = None

        self._loop(self.cfg.seed * 1000 + i, step)

    def _stream(
        self, c: HicacheClient, cv: Conversation, variant: str, allowed: set[str], **kw: Any
    ) -> StreamResult:
        """One recorded Generate of the conversation's prompt in its namespace; RESOURCE_EXHAUSTED
        (the queue is full) is always allowed, ``finishes`` STOP / LENGTH unless given."""
        finishes = kw.pop("finishes", {"STOP", "LENGTH"})
        allowed = {"RESOURCE_EXHAUSTED", *allowed}
        return stream_generate(self.rec, c, cv.ids, variant, allowed, finishes, ns=cv.ns, **kw)

    def _gen_plain(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> StreamResult:
        return self._stream(c, cv, "plain", set(), **self.wl.sampling(rng))

    def _gen_cancel(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        sp = self.wl.sampling(rng) | {"max_new_tokens": self.cfg.max_new_tokens}
        self._stream(c, cv, "cancel", {"CANCELLED"}, cancel_after=rng.randint(1, 4), **sp)

    def _gen_deadline(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        timeout = rng.uniform(0.01, 1.0)
        self._stream(
            c, cv, "deadline", {"DEADLINE_EXCEEDED"}, timeout=timeout, **self.wl.sampling(rng)
        )

    def _gen_abort(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        rid = self._rid("abort")

        def abort() -> bool:
            unary(self.rec, "Abort", lambda: c.abort(rid))
            return False

        finishes = {"STOP", "LENGTH", "ABORT"}
        self._stream(c, cv, "abort", set(), rid=rid, on_first=abort, finishes=finishes, **GREEDY_64)

    def _gen_dup_running(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
        """The same id while the first request runs (64 tokens to go): ALREADY_EXISTS, and the
        first is cancelled then. The first may have finished on the server before the second
        arrived (a slow client: its last chunks wait unread), which lets the second run; the
        first is then read to its end and both must be whole and agree (greedy, same prompt):
        a second run beside the first would share its id, its stream and its abort."""
        rid = self._rid("dup")
        second: list[StreamResult] = []

        def again() -> bool:
            sp = GREEDY_64 | {"max_new_tokens": 2}
            second.append(self._stream(c, cv, "dup_second", {"ALREADY_EXISTS"}, rid=rid, **sp))
            return second[0].code != "OK"

        first = self._stream(
            c, cv, "dup_first", {"CANCELLED"}, rid=rid, on_first=again, **GREEDY_64
        )
        if (
            second
            and second[0].code == "OK"
            and (first.code != "OK" or len(first.ids) != 64 or second[0].ids != first.ids[:2])
        ):
            self.rec.violate(
                "duplicate request_id",
                f"{rid}: a second call ran beside the "
                f"first ({first.code}, {len(first.ids)} of 64 tokens, first two "
                f"{first.ids[:2]} vs the second's {second[0].ids})",
            )

    def _gen_dup_simultaneous(self, c: HicacheClient, rng: random.Random, cv: Conversation) -> None:
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
                sp = GREEDY_64 | {"max_new_tokens": 24}
                out[k] = self._stream(c2, cv, "dup_pair", {"ALREADY_EXISTS"}, rid=rid, **sp)

        t = threading.Thread(target=run, args=(1,), daemon=True)
        t.start()
        run(0)
        t.join(STREAM_TIMEOUT_S + 10)
        a, b = out
        if a is None or b is None:
            return
        if a.code == b.code == "OK" and a.first and b.first and a.first < b.end and b.first < a.end:
            self.rec.violate("duplicate request_id", f"{rid}: both simultaneous calls ran")
        if a.code == b.code == "ALREADY_EXISTS":
            self.rec.violate("duplicate request_id", f"{rid}: both calls refused")

    # -- admin
    def _admin(self) -> None:
        self._loop(self.cfg.seed * 1000 + 999, self.admin.step)
