"""The scheduler's inbox: typed messages in arrival order, coalesced wake-ups, and the count of
arrivals (less aborts) not taken yet."""

from __future__ import annotations

from types import SimpleNamespace

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
