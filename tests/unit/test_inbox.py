"""The scheduler's inbox: typed messages in arrival order, coalesced wake-ups, the count of
arrivals (less aborts) not taken yet, and the close at the loop's end (no call waits on a loop
that is gone)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

from engine.errors import EngineShutdownError
from engine.operations import CALL_TIMEOUT_S
from engine.runtime.scheduler.inbox import Abort, Arrival, Call, Inbox, Wake


def test_messages_come_out_in_order_and_are_counted():
    box = Inbox()
    a, b = SimpleNamespace(rid="a"), SimpleNamespace(rid="b")
    box.put_request(a)
    box.wake()
    box.wake()  # coalesced with the one queued
    box.put_request(b)
    box.put_abort("a")
    fut = box.put_call(len)
    assert box.pending_arrivals() == 1  # two arrivals, one abort
    msgs = list(box.take(block=False, timeout=0.0))
    assert msgs == [Arrival(a), Wake(), Arrival(b), Abort("a"), Call(len, fut)]
    assert box.pending_arrivals() == 0
    box.wake()  # taken: a new wake-up queues again
    assert list(box.take(block=True, timeout=0.0)) == [Wake()]


def test_take_on_an_empty_inbox_yields_nothing():
    assert list(Inbox().take(block=False, timeout=0.0)) == []
    assert list(Inbox().take(block=True, timeout=0.0)) == []


def test_close_fails_the_queued_calls_and_every_later_one():
    box = Inbox()
    box.put_request(SimpleNamespace(rid="a"))
    queued = box.put_call(len)
    box.close()  # the scheduler loop has ended
    assert isinstance(queued.exception(timeout=0), EngineShutdownError)
    later = box.put_call(len)
    assert isinstance(later.exception(timeout=0), EngineShutdownError)
    assert list(box.take(block=False, timeout=0.0)) == []  # nothing is left queued


def test_a_call_queued_when_the_scheduler_loop_stops_fails_at_once(tiny_llama_dir):
    """A call still in the inbox when the loop ends, and one made after, get
    EngineShutdownError; without the close they would wait out their timeout."""
    from engine.runtime.engine import Engine

    queued: list[Future] = []
    eng = Engine(tiny_llama_dir, max_total_tokens=256)
    try:

        def stop_with_a_call_queued(s: Any) -> None:
            if not queued:  # the call is put after this pass took the inbox: it stays queued
                queued.append(s.inbox.put_call(len))
                eng._stop.set()  # the loop ends after this step

        eng.call_in_scheduler(lambda s: s.step_hooks.add(stop_with_a_call_queued))
        eng._thread.join(CALL_TIMEOUT_S)
        assert not eng._thread.is_alive()
        assert isinstance(queued[0].exception(timeout=CALL_TIMEOUT_S), EngineShutdownError)
        later = eng.scheduler.inbox.put_call(len)
        assert isinstance(later.exception(timeout=CALL_TIMEOUT_S), EngineShutdownError)
    finally:
        eng.shutdown()
