"""The operations the API server asks of the scheduler process (engine/ipc.py): each one is
answered by the scheduler-side function it names (engine/runtime/cache_admin.py, tenant_cache.py,
kv_block_view.py, scheduler/stats.py; the event log's reads), survives pickling, and nothing else
can be asked for."""

from __future__ import annotations

import pickle
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
import zmq

from engine import ipc
from engine.admin_records import TenantQuota
from engine.runtime import process
from engine.runtime.process import SchedulerServer
from engine.runtime.scheduler.inbox import Inbox


class FakeEventLog:
    last_seq = 7
    first_seq = 3

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def since(self, seq: int, limit: int | None = None) -> list[str]:
        self.calls.append(("since", seq, limit))
        return ["e4", "e5"]

    def missed(self, seq: int) -> int:
        self.calls.append(("missed", seq))
        return 2

    def wait_for(self, seq: int, timeout: float | None = None) -> bool:
        self.calls.append(("wait_for", seq, timeout))
        return True


class FakeScheduler:
    """The scheduler as the process' loop uses it: its inbox (polled with the socket; calls
    from the call threads run at once here), its options, its model runner and its tree."""

    name = "the scheduler"

    def __init__(self) -> None:
        self.inbox = Inbox()
        self.args = SimpleNamespace(hicache_storage_backend=None)
        self.runner = SimpleNamespace(model_info=lambda: {"model": "tiny"})
        self.tree_cache = SimpleNamespace(name="the tree")
        self.in_loop: list[Any] = []

    def run_call(self, fn: Any) -> Any:
        return fn(self)


class Functions:
    """Stands for the modules the scheduler process calls: each function records its name and
    arguments (the scheduler given as "S") and answers with them."""

    def __init__(self, scheduler: FakeScheduler, events: FakeEventLog) -> None:
        self.scheduler, self.events = scheduler, events
        self.calls: list[tuple[Any, ...]] = []
        self.event_logs_made = 0

    def __getattr__(self, name: str) -> Any:
        def fn(*args: Any, **kw: Any) -> Any:
            args = tuple("S" if a is self.scheduler else a for a in args)
            call = (name, *args, *kw.values())
            self.calls.append(call)
            return call

        return fn

    def event_log(self, scheduler: FakeScheduler) -> FakeEventLog:
        assert scheduler is self.scheduler
        self.event_logs_made += 1
        return self.events


def shout(s: FakeScheduler) -> str:
    return s.name.upper()


@pytest.fixture
def server(tmp_path, monkeypatch):
    ctx = zmq.Context()
    sched = FakeScheduler()

    def in_loop(fn: Any) -> Future:  # the loop takes it at its next pass
        fut: Future = Future()
        sched.in_loop.append(fn)
        fut.set_result(fn(sched))
        return fut

    monkeypatch.setattr(sched.inbox, "put_call", in_loop)
    funcs = Functions(sched, FakeEventLog())
    for module in ("cache_admin", "tenant_cache"):
        monkeypatch.setattr(process, module, funcs)
    for fn in ("kv_block_changes", "cache_stats"):
        monkeypatch.setattr(process, fn, getattr(funcs, fn))
    srv = SchedulerServer(sched, {2}, ipc.Addresses.in_dir(tmp_path), ctx)  # type: ignore[arg-type]
    srv.funcs = funcs  # type: ignore[attr-defined]
    yield srv
    srv.calls.shutdown()
    srv.event_calls.shutdown()
    srv.outbox.close()
    ctx.destroy(linger=0)


def ask(server: SchedulerServer, op: ipc.Operation) -> Any:
    """``op`` as it travels (pickled in a CallReq), answered by the scheduler process."""
    req = pickle.loads(pickle.dumps(ipc.CallReq(1, op)))
    assert req.op == op
    return server._run(req.op)


def test_engine_operations_call_the_function_they_name(server):
    funcs = server.funcs
    assert ask(server, ipc.InScheduler(shout, 5.0)) == "THE SCHEDULER"
    assert ask(server, ipc.CacheStats()) == ("cache_stats", "S")
    assert ask(server, ipc.ModelInfo()) == {"model": "tiny"}
    assert ask(server, ipc.StorageInfo()) == ("storage_info", "S")
    attach = ask(server, ipc.AttachStorage("redis", "redis://h:1", None))
    assert attach[:2] == ("build_and_attach_storage", server.scheduler.args)
    assert attach[2] is server.scheduler.tree_cache and attach[4:] == ("redis", "redis://h:1", None)
    in_loop = attach[3]  # the attach itself runs on the loop, through the scheduler's inbox
    assert in_loop(lambda s: s.name) == "the scheduler" and server.scheduler.in_loop
    assert ask(server, ipc.DetachStorage(12.5)) == ("detach_storage", "S", 12.5)
    assert ask(server, ipc.GetServerArgs()) is server.scheduler.args
    assert [c[0] for c in funcs.calls] == [
        "cache_stats",
        "storage_info",
        "build_and_attach_storage",
        "detach_storage",
    ]
    assert funcs.event_logs_made == 0


def test_cache_admin_operations_call_the_function_they_name(server):
    ns = frozenset({"a", "b"})
    quotas = (TenantQuota("t", ns, {"l1": 8, "l2": 0, "l3": 0}),)
    cases = [
        (ipc.KvBlockChanges(4, b"k", True), ("kv_block_changes", "S", 4, b"k", True)),
        (ipc.MatchPrefix([1, 2], "a"), ("match_prefix", "S", [1, 2], "a")),
        (ipc.Evict("l2", 5, [1], "a", True, ns), ("evict", "S", "l2", 5, [1], "a", True, ns)),
        (ipc.PinPrefix([3], None, 2.5, "t"), ("pin", "S", [3], None, 2.5, "t")),
        (ipc.Unpin("pin-1", "t"), ("unpin", "S", "pin-1", "t")),
        (ipc.PinSummary(), ("pin_summary", "S")),
        (ipc.Flush(["l1"]), ("flush", "S", ["l1"])),
        (ipc.FlushNamespaces(ns, None, "t"), ("flush", "S", ns, None, "t")),  # tenant_cache's
        (ipc.InspectTree(10, 20, 4, ns), ("inspect_tree", "S", 10, 20, 4, ns)),
        (ipc.ApplyQuotas(quotas), ("apply_quotas", "S", quotas)),
        (ipc.TenantView("t", ns), ("tenant_view", "S", "t", ns)),
        (ipc.TenantFigures(quotas), ("tenant_figures", "S", quotas)),
    ]
    for op, call in cases:
        assert ask(server, op) == call
    assert server.funcs.calls == [call for _, call in cases]
    assert not any(isinstance(op, ipc.EventCall) for op, _ in cases)


def test_event_operations_read_one_event_log(server):
    funcs = server.funcs
    assert ask(server, ipc.EventsLastSeq()) == 7
    assert ask(server, ipc.EventsFirstSeq()) == 3
    assert ask(server, ipc.EventsSince(4, 10)) == ["e4", "e5"]
    assert ask(server, ipc.EventsMissed(1)) == 2
    assert ask(server, ipc.EventsWaitFor(9, 0.5)) is True
    assert funcs.events.calls == [("since", 4, 10), ("missed", 1), ("wait_for", 9, 0.5)]
    # made once, on the loop (through the scheduler's inbox)
    assert funcs.event_logs_made == 1 and len(server.scheduler.in_loop) == 1
    assert funcs.calls == []


def test_only_event_operations_are_event_calls():
    events = [
        ipc.EventsLastSeq(),
        ipc.EventsFirstSeq(),
        ipc.EventsSince(0, None),
        ipc.EventsMissed(0),
        ipc.EventsWaitFor(0, None),
    ]
    others = [
        ipc.InScheduler(shout, None),
        ipc.CacheStats(),
        ipc.ModelInfo(),
        ipc.StorageInfo(),
        ipc.GetServerArgs(),
        ipc.AttachStorage("file", None, "/d"),
        ipc.DetachStorage(1.0),
    ]
    assert all(isinstance(op, ipc.EventCall) for op in events)
    assert not any(isinstance(op, ipc.EventCall) for op in others)


def test_an_operation_that_is_not_declared_cannot_be_asked(server):
    with pytest.raises(AssertionError):
        server._run("cache_stats")  # type: ignore[arg-type]
    assert server.funcs.calls == []
