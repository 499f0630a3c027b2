"""Status bookkeeping: every call's status code and timing, every Generate answer (the tokens
served, for the reference check), the faults injected and when, the violations found, and the
windows in which the daemon was down or draining (UNAVAILABLE is allowed only there)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from tools.benchlib import summary

# docs/daemon.md "Status codes" and "Security"; OK
DOCUMENTED = frozenset(
    {
        "OK",
        "INVALID_ARGUMENT",
        "RESOURCE_EXHAUSTED",
        "UNAVAILABLE",
        "FAILED_PRECONDITION",
        "ALREADY_EXISTS",
        "NOT_FOUND",
        "UNIMPLEMENTED",
        "UNAUTHENTICATED",
        "PERMISSION_DENIED",
    }
)
CLIENT_SIDE = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})  # only when the caller asked
OUTAGE_MARGIN_S = 2.0  # UNAVAILABLE still allowed this long after SERVING again
# grpc core's details when its server stops while a call has reached it that no handler took
# yet: it cancels the call (grpc/grpc#41785), so that call never met the daemon. A client's own
# cancel says "Locally cancelled by application!".
SHUTDOWN_CANCEL = "CANCELLED"


@dataclass
class Call:
    rpc: str
    variant: str
    code: str
    t0: float
    t1: float
    ttft: float | None = None
    first: float | None = None  # first response received (monotonic)


@dataclass(frozen=True)
class Answer:
    """The tokens one Generate call was served, and how (tools/soaklib/reference.py checks
    them against the same prompt computed alone)."""

    seq: int  # its index in Recorder.answers
    variant: str  # the client action: plain, cancel, deadline, abort, dup_*, check, forensics
    rid: str
    namespace: str
    prompt: tuple[int, ...]
    sampling: tuple[tuple[str, Any], ...]  # the sampling params sent, sorted by name
    ids: tuple[int, ...]  # the tokens received (all of them when ``whole``)
    whole: bool  # ended OK with finish STOP / LENGTH; else a prefix (cancelled, aborted, ...)
    code: str
    finish: str
    # prompt tokens served from (l1, l2, l3), and the prompt's length; None without usage
    cached: tuple[int, int, int, int] | None
    t0: float  # monotonic
    t1: float
    phase: str  # the soak's phase it ended in, e.g. "round 3 (kill9)"


@dataclass(frozen=True)
class FaultEvent:
    name: str
    t0: float  # monotonic, the injection's start and end (a restart included)
    t1: float


class Recorder:
    """Every call's status; violations; the windows in which the daemon was down or draining."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: list[Call] = []
        self.violations: dict[str, list[str]] = collections.defaultdict(list)
        self.windows: list[list[float]] = []  # [start, end]; end = inf while open
        self.answers: list[Answer] = []
        self.faults: list[FaultEvent] = []
        self.phase = ""
        # NOTE: conversations grow their prompt list in place, and one prompt is sent many
        # times (cancels, duplicates, retries): answers share one tuple per distinct prompt.
        self._prompts: dict[tuple[int, ...], tuple[int, ...]] = {}
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
        cut_at_stop = call.code == "CANCELLED" and detail == SHUTDOWN_CANCEL and call.first is None
        if call.code == "UNAVAILABLE" or cut_at_stop:
            self._local.unavailable = True
        if call.code in allowed:
            return
        # NOTE: a call sent while the daemon's gRPC server stops (the drain over, its GOAWAY
        # not yet seen by the client) is cancelled by grpc before any handler of the daemon
        # sees it: an outage answer like UNAVAILABLE. A stream that got a response was taken
        # by a handler: its CANCELLED stays a violation.
        if (call.code == "UNAVAILABLE" or cut_at_stop) and self.in_outage(call.t1):
            return
        kind = "undocumented status" if call.code not in DOCUMENTED else "unexpected status"
        self.violate(kind, f"{call.rpc}/{call.variant}: {call.code} {detail}"[:300])

    def answer(
        self,
        variant: str,
        prompt: Iterable[int],
        sampling: dict[str, Any],
        ids: Iterable[int],
        *,
        code: str,
        finish: str,
        rid: str = "",
        namespace: str = "",
        cached: tuple[int, int, int, int] | None = None,
        t0: float,
        t1: float,
    ) -> Answer:
        """Keeps what one Generate call was served (``finish``: STOP / LENGTH / ABORT, or ""
        when no ``complete`` arrived)."""
        key = tuple(prompt)
        whole = code == "OK" and finish in ("STOP", "LENGTH")
        with self._lock:
            a = Answer(
                len(self.answers),
                variant,
                rid,
                namespace,
                self._prompts.setdefault(key, key),
                tuple(sorted(sampling.items())),
                tuple(ids),
                whole,
                code,
                finish,
                cached,
                t0,
                t1,
                self.phase,
            )
            self.answers.append(a)
        return a

    def fault(self, name: str, t0: float, t1: float) -> None:
        with self._lock:
            self.faults.append(FaultEvent(name, t0, t1))

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

    def ttfts(self, since: int = 0) -> list[float]:
        """TTFT of the OK calls that measured one, from the ``since``-th call on."""
        with self._lock:
            return [c.ttft for c in self.calls[since:] if c.ttft is not None and c.code == "OK"]


def rpc_code(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    return code.name if code is not None else "UNKNOWN"


def rpc_details(e: grpc.RpcError) -> str:
    return (e.details() if hasattr(e, "details") else str(e)) or ""


def ttft_summary(ttfts: list[float]) -> dict[str, float | int | None]:
    """p50 / p99 (seconds; None without samples) and the number of samples."""
    s = summary(ttfts, qs=(50, 99))
    return {"p50": s["p50"], "p99": s["p99"], "n": len(ttfts)}
