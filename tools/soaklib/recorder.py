"""Status bookkeeping: every call's status code and timing, the violations found, and the
windows in which the daemon was down or draining (UNAVAILABLE is allowed only there)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

# docs/daemon.md "Status codes" and "Security"; OK
DOCUMENTED = frozenset({
    "OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "FAILED_PRECONDITION",
    "ALREADY_EXISTS", "NOT_FOUND", "UNIMPLEMENTED", "UNAUTHENTICATED", "PERMISSION_DENIED"})
CLIENT_SIDE = frozenset({"CANCELLED", "DEADLINE_EXCEEDED"})  # only when the caller asked
OUTAGE_MARGIN_S = 2.0  # UNAVAILABLE still allowed this long after SERVING again


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

    def ttfts(self, since: int = 0) -> list[float]:
        """TTFT of the OK calls that measured one, from the ``since``-th call on."""
        with self._lock:
            return [c.ttft for c in self.calls[since:] if c.ttft is not None and c.code == "OK"]


def rpc_code(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    return code.name if code is not None else "UNKNOWN"


def rpc_details(e: grpc.RpcError) -> str:
    return (e.details() if hasattr(e, "details") else str(e)) or ""


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def ttft_summary(ttfts: list[float]) -> dict[str, float | int | None]:
    """p50 / p99 (seconds; None without samples) and the number of samples."""
    return {"p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99), "n": len(ttfts)}
