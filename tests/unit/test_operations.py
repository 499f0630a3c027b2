"""The operations an engine answers besides requests (engine/operations.py): every one has
exactly one handler (engine/runtime/handlers.py), answers what the cache_admin function it
stands for answers, survives the trip to the scheduler process, and nothing else can be asked;
the scheduler process replies to a CallReq with its handler's answer or error."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from engine import operations as ops
from engine.admin_records import Pin, TenantQuota
from engine.ipc import messages, transport
from engine.runtime import cache_admin, handlers
from engine.runtime.process import SchedulerServer
from engine.runtime.scheduler.inbox import Inbox
from hicache.observe.events import CacheEventLog
from tests.unit.test_cache_admin import FakeScheduler


class InlineInbox(Inbox):
    """The scheduler's inbox whose calls run at once (the loop's part), counted."""

    def __init__(self, scheduler: FakeScheduler) -> None:
        super().__init__()
        self.scheduler = scheduler
        self.calls = 0

    def put_call(self, fn: Any) -> Future:
        self.calls += 1
        fut: Future = Future()
        try:
            fut.set_result(fn(self.scheduler))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            fut.set_exception(e)
        return fut


class InlineScheduler(FakeScheduler):
    """FakeScheduler with an inbox whose calls run at once, and the loop's ``run_call``."""

    def __init__(self) -> None:
        super().__init__(page_size=1)
        self.insert(list(range(1, 17)))
        self.insert(list(range(1, 9)) + [50 + i for i in range(8)])
        self.insert([90 + i for i in range(8)])
        self.inbox = InlineInbox(self)

    @property
    def calls(self) -> int:
        """Calls handed to the loop through the inbox."""
        return self.inbox.calls

    def run_call(self, fn: Any) -> Any:
        return fn(self)


def _declared() -> set[type]:
    """Every operation engine/operations.py declares (the dataclasses)."""
    return {
        cls
        for _, cls in inspect.getmembers(ops, inspect.isclass)
        if issubclass(cls, ops.Operation) and dataclasses.is_dataclass(cls)
    }


def _path(s: InlineScheduler, node_id: int) -> tuple[int, ...]:
    """A node by the tokens from the root to it: node ids count up across trees."""
    nodes = {n.id: n for n in [s.tree_cache.root_node, *s.tree_cache.all_nodes()]}
    node, path = nodes[node_id], ()
    while node is not None:
        path, node = tuple(node.key) + path, node.parent
    return path


def _tree(s: InlineScheduler) -> list[tuple]:
    return sorted((_path(s, n.id), n.lock_ref) for n in s.tree_cache.all_nodes())


def _by_path(s: InlineScheduler, answer: Any) -> Any:
    """``answer`` with the node ids it names as paths (see _path), and no access times (one
    clock for every tree; the trees after each operation are compared by their keys)."""
    if isinstance(answer, Pin):
        return dataclasses.replace(answer, node_id=_path(s, answer.node_id))
    if type(answer) is tuple and isinstance(answer[0], list):  # a tree page: (nodes, total)
        nodes, total = answer
        paths = [(_path(s, n.node_id), _path(s, n.parent_id)) for n in nodes]
        same = [
            n._replace(node_id=a, parent_id=b, last_access_time=0.0)
            for n, (a, b) in zip(nodes, paths)
        ]
        return same, total
    return answer


SAMPLES: list[ops.Operation[Any]] = [
    ops.GetCacheStats(),
    ops.KvBlockChanges(4, b"k", True),
    ops.EventsLastSeq(),
    ops.EventsFirstSeq(),
    ops.EventsSince(4, 10),
    ops.EventsMissed(1),
    ops.EventsWaitFor(9, 0.5),
    ops.MatchPrefix([1, 2], "a"),
    ops.Evict("l2", 5, [1], "a", True, frozenset({"a"})),
    ops.PinPrefix([3], None, 2.5, "t"),
    ops.Unpin("pin-1", "t"),
    ops.PinSummary(),
    ops.Flush(["l1"]),
    ops.FlushNamespaces(frozenset({"a", "b"}), None, "t"),
    ops.InspectTree(10, 20, 4, frozenset({"a"})),
    ops.ApplyQuotas((TenantQuota("t", frozenset({"a"}), {"l1": 8, "l2": 0, "l3": 0}),)),
    ops.GetTenantView("t", frozenset({"a"})),
    ops.GetTenantFigures(()),
    ops.GetStorageInfo(),
    ops.AttachStorage("redis", "redis://h:1", None),
    ops.DetachStorage(12.5),
    ops.GetModelInfo(),
    ops.GetServerArgs(),
    ops.InScheduler(cache_admin.pin_summary, 5.0),
]


def test_every_operation_has_exactly_one_handler():
    assert set(handlers.HANDLERS) == _declared()
    assert {type(op) for op in SAMPLES} == _declared()  # the samples below cover them all


def test_every_operation_survives_the_trip_to_the_scheduler_process():
    for op in SAMPLES:
        req = pickle.loads(pickle.dumps(messages.CallReq(1, op)))
        assert req.op == op and type(req.op) is type(op)


def test_admin_operations_answer_what_cache_admin_answers():
    """Each operation, through its handler, against the cache_admin call it stands for on an
    identical cache: the same answer and the same tree after it."""
    cases: list[tuple[ops.Operation[Any], Any]] = [
        (
            ops.MatchPrefix(list(range(1, 13))),
            lambda s: cache_admin.match_prefix(s, list(range(1, 13))),
        ),
        (ops.Evict("l1", 1, dry_run=True), lambda s: cache_admin.evict(s, "l1", 1, dry_run=True)),
        (ops.PinPrefix(list(range(1, 5))), lambda s: cache_admin.pin(s, list(range(1, 5)))),
        (ops.PinSummary(), cache_admin.pin_summary),
        (ops.InspectTree(1, 2, 3), lambda s: cache_admin.inspect_tree(s, 1, 2, 3)),
        (
            ops.Evict("l1", None, list(range(1, 9))),
            lambda s: cache_admin.evict(s, "l1", prefix=list(range(1, 9))),
        ),
        (ops.Unpin(), cache_admin.unpin),
        (ops.Evict("l1", 8), lambda s: cache_admin.evict(s, "l1", 8)),
        (ops.Flush(), cache_admin.flush),
    ]
    mine, ref = InlineScheduler(), InlineScheduler()
    for op, reference in cases:
        assert _by_path(mine, handlers.answer(mine, op)) == _by_path(ref, reference(ref)), op
        assert _tree(mine) == _tree(ref), op
    assert mine.calls == len(cases)  # each ran on the scheduler thread
    assert [e.kind for e in mine.event_log.since(0)] == ["cleared"]


def test_event_reads_attach_a_log_once_and_read_it():
    s = InlineScheduler()
    s.event_log = s.tree_cache.event_log = None
    assert handlers.answer(s, ops.EventsLastSeq()) == 0
    log = s.event_log
    assert isinstance(log, CacheEventLog) and s.tree_cache.event_log is log
    log.emit("cleared", "l1", 0)
    log.emit("cleared", "l2", 0)
    assert handlers.answer(s, ops.EventsFirstSeq()) == log.first_seq
    assert handlers.answer(s, ops.EventsSince(1)) == log.since(1)
    assert handlers.answer(s, ops.EventsMissed(0)) == log.missed(0)
    assert handlers.answer(s, ops.EventsWaitFor(1, 0.0)) is True
    assert s.calls == 1 and s.event_log is log  # attached once, on the scheduler thread


def test_an_undeclared_operation_is_refused_before_anything_runs():
    @dataclasses.dataclass(frozen=True)
    class Undeclared(ops.Operation[int]):
        pass

    s = InlineScheduler()
    for op in (Undeclared(), "cache_stats"):
        with pytest.raises(TypeError, match="not an engine operation"):
            handlers.answer(s, op)  # type: ignore[arg-type]
    assert s.calls == 0


def test_only_event_reads_go_to_the_event_threads():
    events = {ops.EventsLastSeq, ops.EventsFirstSeq, ops.EventsSince, ops.EventsMissed}
    events.add(ops.EventsWaitFor)
    assert {type(op) for op in SAMPLES if isinstance(op, ops.EventRead)} == events


def test_the_scheduler_process_replies_with_the_answer_or_the_error(tmp_path):
    ctx = zmq.Context()
    addrs = transport.Addresses.in_dir(tmp_path)
    replies = transport.pull(ctx, addrs.api_reply)
    server = SchedulerServer(InlineScheduler(), set(), addrs, ctx)  # type: ignore[arg-type]
    try:
        server._call(messages.CallReq(1, ops.MatchPrefix(list(range(1, 9)))))
        server._call(messages.CallReq(2, ops.Flush(["l2"])))  # no L2 here
        server._call(messages.CallReq(3, "flush"))  # type: ignore[arg-type]
        got: dict[int, messages.Reply] = {}
        while len(got) < 3:
            batch = transport.recv(replies, 10_000)
            assert batch is not None, f"replies so far: {got}"
            got.update((r.call_id, r) for r in batch)
        assert got[1].ok and got[1].value.matched_tokens == 8
        assert not got[2].ok and isinstance(got[2].value, cache_admin.TierUnavailableError)
        assert not got[3].ok and isinstance(got[3].value, TypeError)
    finally:
        server.calls.shutdown()
        server.event_calls.shutdown()
        server.outbox.close()
        ctx.destroy(linger=0)
