"""Fault injection: which round gets which fault group, and the faults themselves (L3 files
corrupted or deleted, L3 read-only or full for a while, kill -9 and SIGTERM with a restart on
the same L3 dir); the SIGTERM drain check."""

from __future__ import annotations

import collections
import random
import signal
import time
from collections.abc import Callable

import grpc

from engine.client import HicacheClient
from tools.soaklib.config import RPC_TIMEOUT_S, SoakConfig
from tools.soaklib.daemon import DaemonProcess
from tools.soaklib.l3 import L3Dir
from tools.soaklib.recorder import Recorder

FILES_WAIT_S = RPC_TIMEOUT_S  # for L3 object files to corrupt / delete: only a hang takes longer


class FaultInjector:
    """Injects faults by name; counts those injected, those skipped (with the reason) and what
    they did."""

    def __init__(
        self,
        cfg: SoakConfig,
        daemon: DaemonProcess | None,
        l3: L3Dir,
        rec: Recorder,
        log: Callable[[str], None],
    ) -> None:
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
        t0 = time.monotonic()
        getattr(self, f"_{fault}")()
        self.rec.fault(fault, t0, time.monotonic())
        self.injected[fault] += 1

    def _on_files(self, fault: str, act: Callable[[], int]) -> int:
        """``act()`` (the number of L3 object files it hit) until it hit one: a flush may just
        have emptied L3, and files listed may be gone (evicted, flushed) before they are
        touched. The traffic stores objects all the time: none for FILES_WAIT_S is a hang."""
        deadline = time.monotonic() + FILES_WAIT_S
        while True:
            n = act()
            if n or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        if not n:
            self.rec.violate(
                "hang", f"{fault}: no L3 object file within {FILES_WAIT_S:.0f}s of traffic"
            )
        return n

    def _corrupt(self) -> None:
        n = self._on_files("corrupt", lambda: self.l3.corrupt(self.rng, self.rng.randint(1, 8)))
        self.details["files_corrupted"] += n
        self.log(f"  corrupted {n} L3 files")

    def _delete(self) -> None:
        n = self._on_files("delete", lambda: self.l3.delete(self.rng, self.rng.randint(1, 8)))
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
            running = [
                x
                for x in self.rec.calls_since(t_sig)
                if x.rpc == "Generate" and x.first is not None and x.first < t_sig
            ]
            self.details["streams_running_at_sigterm"] += len(running)
            for x in running:
                if x.code != "OK" and x.variant not in ("cancel", "deadline", "dup_first"):
                    self.rec.violate(
                        "drain", f"{x.variant} stream running at SIGTERM ended {x.code}"
                    )
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
