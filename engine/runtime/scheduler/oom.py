"""OomRecovery: what the scheduler does when a prefill batch does not fit the KV pool (the
admission budget was too optimistic), so that it never spins on a batch that cannot fit.

    running requests        -> DECODE: they finish and free KV
    nothing runs, 1st miss  -> SETTLE: in-flight tier copies land (their nodes become evictable)
    again, several requests -> ONE_AT_A_TIME: admit one request per prefill until one fits
    again, one request      -> FAIL: it cannot fit even in an empty pool
A batch that fits ends the recovery (``fitted``); ``recover`` carries out the action.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from engine.runtime.request import FinishReason, Req

if TYPE_CHECKING:
    from engine.runtime.scheduler.overlap import Launched
    from engine.runtime.scheduler.scheduler import Scheduler


class OomAction(Enum):
    DECODE = "decode"
    SETTLE = "settle"
    ONE_AT_A_TIME = "one_at_a_time"
    FAIL = "fail"


class OomRecovery:
    def __init__(self) -> None:
        self.streak = 0  # consecutive prefill batches that did not fit
        self.prefill_cap: int | None = None  # max requests per prefill while recovering

    def fitted(self) -> None:
        """A prefill batch fitted: back to normal admission."""
        self.streak, self.prefill_cap = 0, None

    def on_oom(self, num_reqs: int, running: bool) -> OomAction:
        """A prefill batch of ``num_reqs`` did not fit; ``running``: requests are decoding.
        NOTE: every action but DECODE comes after the caller let in-flight copies land."""
        self.streak += 1
        if running:
            return OomAction.DECODE
        if self.streak < 2:
            return OomAction.SETTLE
        if num_reqs > 1:
            self.prefill_cap = 1
            return OomAction.ONE_AT_A_TIME
        self.streak = 0
        return OomAction.FAIL


def recover(s: Scheduler, reqs: list[Req], why: str) -> Launched | None:
    """The prefill batch ``reqs`` did not fit (requeued): never spin on it. Decode if anything
    runs; otherwise let in-flight tier copies land (their nodes become evictable), then admit
    one request at a time, and fail a lone request that still cannot fit."""
    action = s.oom.on_oom(len(reqs), bool(s.running))
    if action is OomAction.DECODE:
        return s.run_decode()
    s.cache_manager.settle()
    if action is OomAction.FAIL:
        req = reqs[0]
        s.waiting.remove(req)
        s.cache_manager.forget(req)
        req.finished_reason = FinishReason(
            "abort", message=f"the KV pool cannot hold this request even when empty ({why})"
        )
        req.emit()
    return None
