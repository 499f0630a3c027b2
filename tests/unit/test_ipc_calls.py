"""The operations the API server asks of the scheduler process (engine/ipc.py): each one is
answered by the engine or event-log method it names, survives pickling, and nothing else can
be asked for."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import zmq

from engine import ipc
from engine.admin_records import TenantQuota
from engine.runtime.process import SchedulerServer


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


class FakeEngine:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.server_args = {"hicache_storage_backend": None}
        self.events = FakeEventLog()
        self.event_logs_made = 0

    def call_in_scheduler(self, fn: Any, timeout: float | None) -> Any:
        self.calls.append(("call_in_scheduler", timeout))
        return fn("the scheduler")

    def cache_stats(self) -> dict[str, int]:
        self.calls.append(("cache_stats",))
        return {"hits": 1}

    def model_info(self) -> dict[str, str]:
        self.calls.append(("model_info",))
        return {"model": "tiny"}

    def storage_info(self) -> dict[str, str]:
        self.calls.append(("storage_info",))
        return {"backend": "file"}

    def attach_storage(
        self, backend: str, url: str | None = None, directory: str | None = None
    ) -> dict[str, str]:
        self.calls.append(("attach_storage", backend, url, directory))
        return {"attached": backend}

    def detach_storage(self, timeout: float = 30.0) -> dict[str, bool]:
        self.calls.append(("detach_storage", timeout))
        return {"detached": True}

    def event_log(self) -> FakeEventLog:
        self.event_logs_made += 1
        return self.events

    # the cache admin methods of EngineFront: each records its name and arguments
    def _admin(self, name: str, *args: Any) -> tuple[Any, ...]:
        self.calls.append((name, *args))
        return (name, *args)

    def kv_block_changes(self, block_size: int, salt_key: bytes, reset: bool = False) -> Any:
        return self._admin("kv_block_changes", block_size, salt_key, reset)

    def match_prefix(self, key: list[int], namespace: str | None = None) -> Any:
        return self._admin("match_prefix", key, namespace)

    def evict(
        self,
        tier: str,
        num_tokens: int | None = None,
        prefix: list[int] | None = None,
        namespace: str | None = None,
        dry_run: bool = False,
        namespaces: frozenset[str] | None = None,
    ) -> Any:
        return self._admin("evict", tier, num_tokens, prefix, namespace, dry_run, namespaces)

    def pin(
        self,
        key: list[int],
        namespace: str | None = None,
        ttl_s: float = 0.0,
        owner: str | None = None,
    ) -> Any:
        return self._admin("pin", key, namespace, ttl_s, owner)

    def unpin(self, pin_id: str | None = None, owner: str | None = None) -> Any:
        return self._admin("unpin", pin_id, owner)

    def pin_summary(self) -> Any:
        return self._admin("pin_summary")

    def flush(self, tiers: list[str] | None = None) -> Any:
        return self._admin("flush", tiers)

    def flush_namespaces(
        self, namespaces: frozenset[str], tiers: list[str] | None, owner: str | None
    ) -> Any:
        return self._admin("flush_namespaces", namespaces, tiers, owner)

    def inspect_tree(
        self,
        offset: int = 0,
        limit: int = 100,
        preview_tokens: int = 16,
        namespaces: frozenset[str] | None = None,
    ) -> Any:
        return self._admin("inspect_tree", offset, limit, preview_tokens, namespaces)

    def apply_quotas(self, quotas: Any) -> Any:
        return self._admin("apply_quotas", quotas)

    def tenant_view(self, tenant: str, namespaces: frozenset[str]) -> Any:
        return self._admin("tenant_view", tenant, namespaces)

    def tenant_figures(self, quotas: Any) -> Any:
        return self._admin("tenant_figures", quotas)


def shout(who: str) -> str:
    return who.upper()


@pytest.fixture
def server(tmp_path):
    ctx = zmq.Context()
    srv = SchedulerServer(FakeEngine(), ipc.Addresses.in_dir(tmp_path), ctx)
    yield srv
    srv.calls.shutdown()
    srv.event_calls.shutdown()
    srv.outbox.close()
    ctx.destroy(linger=0)


def ask(server: SchedulerServer, op: ipc.Operation) -> Any:
    """``op`` as it travels (pickled in a CallReq), answered by the scheduler process."""
    req = pickle.loads(pickle.dumps(ipc.CallReq(1, op)))
    assert req.op == op
    return server._run(req)


def test_engine_operations_call_the_method_they_name(server):
    engine = server.engine
    assert ask(server, ipc.InScheduler(shout, 5.0)) == "THE SCHEDULER"
    assert ask(server, ipc.CacheStats()) == {"hits": 1}
    assert ask(server, ipc.ModelInfo()) == {"model": "tiny"}
    assert ask(server, ipc.StorageInfo()) == {"backend": "file"}
    assert ask(server, ipc.AttachStorage("redis", "redis://h:1", None)) == {"attached": "redis"}
    assert ask(server, ipc.DetachStorage(12.5)) == {"detached": True}
    assert ask(server, ipc.GetServerArgs()) is engine.server_args
    assert engine.calls == [
        ("call_in_scheduler", 5.0),
        ("cache_stats",),
        ("model_info",),
        ("storage_info",),
        ("attach_storage", "redis", "redis://h:1", None),
        ("detach_storage", 12.5),
    ]
    assert engine.event_logs_made == 0


def test_cache_admin_operations_call_the_method_they_name(server):
    ns = frozenset({"a", "b"})
    quotas = (TenantQuota("t", ns, {"l1": 8, "l2": 0, "l3": 0}),)
    cases = [
        (ipc.KvBlockChanges(4, b"k", True), ("kv_block_changes", 4, b"k", True)),
        (ipc.MatchPrefix([1, 2], "a"), ("match_prefix", [1, 2], "a")),
        (ipc.Evict("l2", 5, [1], "a", True, ns), ("evict", "l2", 5, [1], "a", True, ns)),
        (ipc.PinPrefix([3], None, 2.5, "t"), ("pin", [3], None, 2.5, "t")),
        (ipc.Unpin("pin-1", "t"), ("unpin", "pin-1", "t")),
        (ipc.PinSummary(), ("pin_summary",)),
        (ipc.Flush(["l1"]), ("flush", ["l1"])),
        (ipc.FlushNamespaces(ns, None, "t"), ("flush_namespaces", ns, None, "t")),
        (ipc.InspectTree(10, 20, 4, ns), ("inspect_tree", 10, 20, 4, ns)),
        (ipc.ApplyQuotas(quotas), ("apply_quotas", quotas)),
        (ipc.TenantView("t", ns), ("tenant_view", "t", ns)),
        (ipc.TenantFigures(quotas), ("tenant_figures", quotas)),
    ]
    for op, call in cases:
        assert ask(server, op) == call
    assert server.engine.calls == [call for _, call in cases]
    assert not any(isinstance(op, ipc.EventCall) for op, _ in cases)


def test_event_operations_read_one_event_log(server):
    engine = server.engine
    assert ask(server, ipc.EventsLastSeq()) == 7
    assert ask(server, ipc.EventsFirstSeq()) == 3
    assert ask(server, ipc.EventsSince(4, 10)) == ["e4", "e5"]
    assert ask(server, ipc.EventsMissed(1)) == 2
    assert ask(server, ipc.EventsWaitFor(9, 0.5)) is True
    assert engine.events.calls == [("since", 4, 10), ("missed", 1), ("wait_for", 9, 0.5)]
    assert engine.event_logs_made == 1 and engine.calls == []


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
        server._run(ipc.CallReq(1, "cache_stats"))  # type: ignore[arg-type]
    assert server.engine.calls == []
