"""The admin thread's actions: Flush / Evict / Pin / Unpin / Prefetch / MatchPrefix /
InspectTree / GetCacheStats / GetStorage / GetServerInfo / WatchCacheEvents / Abort, chosen by
weight, alongside the clients' traffic."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import grpc

from engine.client import HicacheClient
from tools.soaklib.calls import unary
from tools.soaklib.config import STREAM_TIMEOUT_S, SoakConfig
from tools.soaklib.recorder import Call, Recorder, rpc_code, rpc_details
from tools.soaklib.workload import Workload, choose


class AdminActions:
    """One admin RPC per step; keeps the pins it made for Unpin. ``rid`` names new request ids
    (shared with the clients)."""

    ACTIONS = (
        ("stats", 14),
        ("match", 12),
        ("tree", 8),
        ("evict", 8),
        ("pin", 8),
        ("unpin", 8),
        ("prefetch", 10),
        ("flush", 6),
        ("storage", 4),
        ("server_info", 4),
        ("events", 4),
        ("abort_unknown", 4),
    )

    def __init__(
        self,
        cfg: SoakConfig,
        wl: Workload,
        rec: Recorder,
        rid: Callable[[str], str],
        skip: tuple[str, ...] = (),
    ) -> None:
        self.cfg, self.wl, self.rec, self._rid = cfg, wl, rec, rid
        self.actions = tuple(a for a in self.ACTIONS if a[0] not in skip)
        self.pins: list[str] = []

    def step(self, c: HicacheClient, rng: random.Random) -> None:
        getattr(self, f"_{choose(rng, self.actions)}")(c, rng)
        time.sleep(rng.uniform(0.02, 0.2))

    def _some_prefix(self, rng: random.Random) -> list[int]:
        p = rng.choice(self.wl.prefixes)
        return p[: rng.randint(1, len(p))] if rng.random() < 0.5 else list(p)

    def _stats(self, c: HicacheClient, rng: random.Random) -> None:
        unary(self.rec, "GetCacheStats", c.cache_stats)

    def _match(self, c: HicacheClient, rng: random.Random) -> None:
        p, ns = self._some_prefix(rng), rng.choice(Workload.NAMESPACES)
        unary(self.rec, "MatchPrefix", lambda: c.match_prefix(p, namespace=ns))

    def _tree(self, c: HicacheClient, rng: random.Random) -> None:
        token = ""
        for _ in range(rng.randint(1, 3)):
            page = unary(
                self.rec,
                "InspectTree",
                lambda t=token: c.inspect_tree(rng.randint(1, 50), t, rng.randint(1, 32)),
            )
            if page is None or not page.next_page_token:
                return
            token = page.next_page_token

    def _evict(self, c: HicacheClient, rng: random.Random) -> None:
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

    def _pin(self, c: HicacheClient, rng: random.Random) -> None:
        p, ns = self._some_prefix(rng), rng.choice(Workload.NAMESPACES)
        ttl = rng.choice((0.0, 0.5, 3.0))
        r = unary(
            self.rec, "Pin", lambda: c.pin(p, ttl_s=ttl, namespace=ns), {"FAILED_PRECONDITION"}
        )
        if r is not None and r.pin_id:
            self.pins.append(r.pin_id)

    def _unpin(self, c: HicacheClient, rng: random.Random) -> None:
        if self.pins and rng.random() < 0.8:
            pid = self.pins.pop(rng.randrange(len(self.pins)))
            unary(self.rec, "Unpin", lambda: c.unpin(pid), {"NOT_FOUND"}, "Unpin/id")
        else:
            self.pins.clear()
            unary(self.rec, "Unpin", lambda: c.unpin(None), (), "Unpin/all")

    def _prefetch(self, c: HicacheClient, rng: random.Random) -> None:
        p, ns = self._some_prefix(rng), rng.choice(Workload.NAMESPACES)
        pin = rng.random() < 0.4
        t0 = time.monotonic()
        stages, code, detail, pin_id = [], "OK", "", ""
        try:
            for r in c.prefetch(
                p, namespace=ns, pin=pin, pin_ttl_s=rng.choice((0.0, 2.0)), timeout=STREAM_TIMEOUT_S
            ):
                stages.append(r.stage)
                pin_id = r.pin_id or pin_id
        except grpc.RpcError as e:
            code, detail = rpc_code(e), rpc_details(e)
        self.rec.record(
            Call("Prefetch", "Prefetch", code, t0, time.monotonic()),
            {"OK", "RESOURCE_EXHAUSTED"},
            detail,
        )
        if code == "OK" and (not stages or stages[-1] != 3):  # PREFETCH_STAGE_DONE
            self.rec.violate("stream shape", f"Prefetch stages {stages}")
        if pin_id:
            self.pins.append(pin_id)

    def _flush(self, c: HicacheClient, rng: random.Random) -> None:
        tiers = rng.choice((None, ["l1"], ["l2"], ["l1", "l2"], ["l3"]))
        timeout = rng.uniform(0.05, 1.0)
        unary(self.rec, "Flush", lambda: c.flush(tiers, timeout), {"FAILED_PRECONDITION"})

    def _storage(self, c: HicacheClient, rng: random.Random) -> None:
        unary(self.rec, "GetStorage", c.storage)

    def _server_info(self, c: HicacheClient, rng: random.Random) -> None:
        unary(self.rec, "GetServerInfo", c.server_info)

    def _events(self, c: HicacheClient, rng: random.Random) -> None:
        t0 = time.monotonic()
        code, detail = "OK", ""
        try:
            for i, _ in enumerate(c.watch_events(after_seq=rng.choice((0, None)), timeout=0.3)):
                if i >= 50:
                    break
        except grpc.RpcError as e:
            code, detail = rpc_code(e), rpc_details(e)
        self.rec.record(
            Call("WatchCacheEvents", "WatchCacheEvents", code, t0, time.monotonic()),
            {"OK", "DEADLINE_EXCEEDED", "CANCELLED"},
            detail,
        )

    def _abort_unknown(self, c: HicacheClient, rng: random.Random) -> None:
        r = unary(self.rec, "Abort", lambda: c.abort(self._rid("nobody")), (), "Abort/unknown")
        if r is not None and r.found:
            self.rec.violate("abort", "Abort of an unknown request_id found one")
