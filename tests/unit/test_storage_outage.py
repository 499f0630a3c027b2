"""OutageLog (hicache/storage/outage.py): log once per outage, with a clock the test moves."""

from __future__ import annotations

import threading

from hicache.storage.outage import OutageLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_problem_is_logged_once_until_its_operation_succeeds():
    log = OutageLog(Clock())
    assert log.met(("write", 30)) is True
    assert log.met(("write", 30)) is False and log.met(("write", 30)) is False
    assert ("write", 30) in log
    assert log.ok("write") == [("write", 30)]
    assert ("write", 30) not in log
    assert log.met(("write", 30)) is True  # a new outage


def test_kinds_of_problem_are_separate():
    log = OutageLog(Clock())
    assert log.met(("write", 30)) and log.met(("write", 28)) and log.met(("read", 5))
    assert log.met(("write", 28)) is False
    assert sorted(log.ok("write")) == [("write", 28), ("write", 30)]
    assert ("read", 5) in log  # a successful write ends no read problem
    assert log.ok("scan") == []
    assert log.met(("read", 5)) is False


def test_success_ends_only_problems_quiet_for_long_enough():
    clock = Clock()
    log = OutageLog(clock)
    log.met(("write", 30))
    clock.now += 30.0
    assert log.ok("write", quiet_s=60.0) == []  # failing and succeeding by turns: one outage
    assert log.met(("write", 30)) is False  # met again: the quiet spell starts over
    clock.now += 59.0
    assert log.ok("write", quiet_s=60.0) == []
    clock.now += 1.0
    assert log.ok("write", quiet_s=60.0) == [("write", 30)]
    assert log.met(("write", 30)) is True


def test_reset_ends_every_problem():
    log = OutageLog(Clock())
    log.met(("read", "OOM"))
    log.met(("corrupt object",))
    log.reset()
    assert ("read", "OOM") not in log and ("corrupt object",) not in log
    assert log.met(("read", "OOM")) is True and log.met(("corrupt object",)) is True


def test_ok_with_nothing_logged_returns_nothing():
    assert OutageLog(Clock()).ok("write", quiet_s=0.0) == []


def test_only_one_of_many_threads_meeting_a_problem_logs_it():
    log = OutageLog(Clock())
    firsts: list[bool] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def meet() -> None:
        start.wait()
        for _ in range(200):
            first = log.met(("write", 30))
            with lock:
                firsts.append(first)

    threads = [threading.Thread(target=meet) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert firsts.count(True) == 1 and len(firsts) == 1600
