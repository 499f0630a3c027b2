from __future__ import annotations

import threading
import time

import pytest

from hicache.observe.events import CacheEventLog


def test_emit_assigns_increasing_seq_and_since_resumes():
    log = CacheEventLog(capacity=8)
    assert log.last_seq == 0 and log.since(0) == []
    evs = [log.emit("stored", "l1", 16, node_id=i, namespace="a") for i in range(5)]
    assert [e.seq for e in evs] == [1, 2, 3, 4, 5]
    assert [e.seq for e in log.since(0)] == [1, 2, 3, 4, 5]
    assert [e.seq for e in log.since(3)] == [4, 5]
    assert log.since(5) == [] and log.since(99) == []
    assert [e.seq for e in log.since(1, limit=2)] == [2, 3]
    assert evs[0].kind == "stored" and evs[0].tier == "l1" and evs[0].namespace == "a"


def test_ring_drops_oldest_and_reports_missed():
    log = CacheEventLog(capacity=3)
    for _ in range(10):
        log.emit("removed", "l2", 1)
    assert len(log) == 3 and log.first_seq == 8
    assert [e.seq for e in log.since(0)] == [8, 9, 10]
    assert log.missed(0) == 7 and log.missed(7) == 0 and log.missed(9) == 0


def test_rejects_unknown_kind_and_tier():
    log = CacheEventLog()
    with pytest.raises(ValueError, match="kind"):
        log.emit("exploded", "l1", 1)
    with pytest.raises(ValueError, match="tier"):
        log.emit("stored", "l9", 1)
    with pytest.raises(ValueError):
        CacheEventLog(capacity=0)


def test_wait_for_wakes_on_emit_and_times_out():
    log = CacheEventLog()
    t0 = time.monotonic()
    assert log.wait_for(0, timeout=0.05) is False
    assert time.monotonic() - t0 >= 0.04
    threading.Timer(0.05, lambda: log.emit("cleared", "l1", 0)).start()
    assert log.wait_for(0, timeout=5.0) is True
    assert log.wait_for(0, timeout=0) is True  # already there


def test_concurrent_emitters_get_unique_seqs():
    log = CacheEventLog(capacity=10_000)

    def work() -> None:
        for _ in range(500):
            log.emit("stored", "l1", 1)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seqs = [e.seq for e in log.since(0)]
    assert seqs == list(range(1, 4001))


def test_clear_keeps_sequence_numbers_increasing():
    log = CacheEventLog()
    log.emit("stored", "l1", 1)
    log.clear()
    assert log.since(0) == []
    assert log.emit("stored", "l1", 1).seq == 2


def test_close_ends_the_waits_now_and_later():
    log = CacheEventLog()
    waited: list[bool] = []
    t = threading.Thread(target=lambda: waited.append(log.wait_for(0)))  # no timeout
    t.start()
    log.close()
    t.join(30)
    assert waited == [False]
    assert log.wait_for(0) is False  # never blocks once closed
    log.emit("cleared", "l1", 0)
    assert log.wait_for(0) is True and [e.seq for e in log.since(0)] == [1]
