"""SplitEngine: the EngineFront (engine/front.py) in the API server process, over a scheduler
process and a detokenizer process (seed 002's layout). Each call is one typed operation
(engine/ipc.py) that the scheduler process' Engine answers with the method of the same name. Tokenization and validation happen here; the scheduler
process gets token ids; the detokenizer process returns text increments.

Start-up waits for each child's ready signal. A child that exits ends every in-flight request
with EngineShutdownError, fails every pending call, stops the other child and calls
`on_failure(reason)` (the daemon goes NOT_SERVING and exits with status 1). shutdown() drains
in order: scheduler (its queued L3 backups land), then the detokenizer, which flushes last.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

import zmq

from engine import ipc
from engine.admin_records import (
    EvictInfo,
    FlushInfo,
    MatchInfo,
    NodeInfo,
    Pin,
    TenantQuota,
    TenantView,
)
from engine.config import ServerArgs
from engine.detokenizer.process import detokenizer_main
from engine.errors import EngineShutdownError
from engine.front import (
    CALL_TIMEOUT_S,
    L3_DRAIN_S,
    SCHEDULER_JOIN_S,
    EngineFront,
    Prompt,
    RequestHandle,
    StreamChunk,
)
from engine.tokenizer import TokenizerManager
from hicache.observe.blocks import BlockChanges
from hicache.observe.events import CacheEvent
from hicache.observe.stats import CacheStats

log = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0  # model conversion + load on a slow machine
CALL_MARGIN_S = 10.0  # a call's reply may take this much longer than its own timeout


def run_scheduler_process(
    server_args: ServerArgs, addrs: ipc.Addresses, conn: Connection, log_level: str
) -> None:
    """The scheduler process' target: the runtime (torch, the model) is imported there only,
    never in this process."""
    from engine.runtime.process import scheduler_main

    scheduler_main(server_args, addrs, conn, log_level)


class SplitEngine(EngineFront):
    def __init__(
        self,
        server_args: ServerArgs,
        on_failure: Callable[[str], None] | None = None,
        log_level: str = "info",
    ):
        self.server_args = server_args
        self.on_failure = on_failure
        self.failed: str | None = None  # why a child died
        self._closed = False
        self._stopping = threading.Event()  # the router's stop
        self._ids = itertools.count(1)
        self._pending: dict[int, Future[Any]] = {}
        self._handles: dict[str, queue.Queue[StreamChunk | BaseException]] = {}
        self._lock = threading.Lock()  # _pending, _handles, the send socket
        self._dir = tempfile.mkdtemp(prefix="hicache-ipc-")
        self.addrs = ipc.Addresses.in_dir(self._dir)
        self._ctx = zmq.Context()
        self._replies = ipc.pull(self._ctx, self.addrs.api_reply)
        self._chunks = ipc.pull(self._ctx, self.addrs.api_chunks)
        self._to_sched = ipc.push(self._ctx, self.addrs.sched_in)
        mp = multiprocessing.get_context("spawn")
        self.procs: dict[str, multiprocessing.Process] = {}
        try:
            info: ipc.SchedulerInfo = self._spawn(
                mp, "scheduler", run_scheduler_process, (server_args, self.addrs), log_level
            )
            self.server_args = info.server_args
            self.tokenizer_manager = TokenizerManager(
                info.tokenizer, info.vocab_size, info.max_context_len
            )
            self._spawn(
                mp, "detokenizer", detokenizer_main, (info.tokenizer, self.addrs), log_level
            )
        except BaseException:
            self._kill_children()
            self._close_sockets()
            raise
        self._router = threading.Thread(target=self._route, name="hicache-router", daemon=True)
        self._router.start()
        self._monitor = threading.Thread(target=self._watch, name="hicache-monitor", daemon=True)
        self._monitor.start()
        # NOTE: before multiprocessing's own exit hook (atexit runs last-in first-out) kills the
        # children: a script that never called shutdown() still lands its L3 backups
        atexit.register(self.shutdown)

    # --- processes ---------------------------------------------------------------------------
    def _spawn(self, mp: Any, name: str, target: Callable, args: tuple, log_level: str) -> Any:
        """Starts a child and waits for its ready signal; raises if it fails or dies first."""
        ours, theirs = mp.Pipe(duplex=False)
        proc = mp.Process(
            target=target, args=(*args, theirs, log_level), name=f"hicache-{name}", daemon=True
        )
        proc.start()
        theirs.close()
        self.procs[name] = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            ready = multiprocessing.connection.wait([ours, proc.sentinel], 1.0)
            if ours in ready:
                try:
                    kind, payload = ours.recv()
                except EOFError:
                    kind, payload = "error", f"exited with code {proc.exitcode}"
                if kind == "ready":
                    log.info("%s process ready (pid %d)", name, proc.pid)
                    return payload
                raise RuntimeError(f"the {name} process failed to start:\n{payload}")
            if proc.sentinel in ready:
                proc.join(5)
                raise RuntimeError(f"the {name} process exited with code {proc.exitcode}")
        raise TimeoutError(f"the {name} process was not ready after {START_TIMEOUT_S:.0f}s")

    def _watch(self) -> None:
        """Blocks until a child exits; unless we are shutting down, that is a failure."""
        sentinels = {p.sentinel: name for name, p in self.procs.items()}
        gone = multiprocessing.connection.wait(list(sentinels))
        if self._closed:
            return
        ready = gone[0]
        assert isinstance(ready, int), "wait() returns the sentinels it was given"
        name = sentinels[ready]
        proc = self.procs[name]
        proc.join(1)
        self._fail(f"the {name} process exited unexpectedly (exit code {proc.exitcode})")

    def _fail(self, reason: str) -> None:
        log.error("%s: ending every request and stopping", reason)
        self.failed = reason
        err = EngineShutdownError(reason)
        with self._lock:
            pending, self._pending = self._pending, {}
            handles, self._handles = self._handles, {}
        for fut in pending.values():
            fut.set_exception(err)
        for q in handles.values():
            q.put(err)
        self._kill_children()
        if self.on_failure is not None:
            self.on_failure(reason)

    def _kill_children(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)

    def alive(self) -> bool:
        return self.failed is None and not self._closed

    # --- the router: replies and chunks to whoever waits for them -----------------------------
    def _route(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replies, zmq.POLLIN)
        poller.register(self._chunks, zmq.POLLIN)
        while not self._stopping.is_set():
            events = dict(poller.poll(200))
            if self._replies in events:
                for r in ipc.recv(self._replies, 0) or ():
                    with self._lock:
                        fut = self._pending.pop(r.call_id, None)
                    if fut is not None and not fut.done():
                        (fut.set_result if r.ok else fut.set_exception)(r.value)
            if self._chunks in events:
                for m in ipc.recv(self._chunks, 0) or ():
                    with self._lock:
                        q = (self._handles.pop if m.chunk.finished else self._handles.get)(
                            m.rid, None
                        )
                    if q is not None:
                        q.put(m.chunk)

    def _send(self, msg: Any, fut: Future[Any] | None = None, call_id: int = 0) -> None:
        with self._lock:
            if self.failed is not None:
                raise EngineShutdownError(self.failed)
            if fut is not None:
                self._pending[call_id] = fut
            ipc.send(self._to_sched, [msg])

    def _call(self, op: ipc.Operation, timeout: float | None = None) -> Any:
        """``op`` answered by the scheduler process (waits ``timeout`` plus a margin; None:
        as long as it takes)."""
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        call_id = next(self._ids)
        fut: Future[Any] = Future()
        self._send(ipc.CallReq(call_id, op), fut, call_id)
        try:
            return fut.result(None if timeout is None else timeout + CALL_MARGIN_S)
        finally:
            with self._lock:
                self._pending.pop(call_id, None)

    # --- requests ----------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | None = None,
        namespace: str | None = None,
        rid: str | None = None,
        chat: bool = False,
    ) -> RequestHandle:
        if self._closed or self.failed is not None:
            raise EngineShutdownError(self.failed or "the engine has been shut down")
        ids, params = self.tokenizer_manager.prepare(prompt, sampling_params, chat)
        rid = rid if rid is not None else f"req-{uuid.uuid4().hex[:16]}"
        chunks: queue.Queue[StreamChunk | BaseException] = queue.Queue()
        call_id = next(self._ids)
        fut: Future[Any] = Future()
        with self._lock:
            if rid in self._handles:
                raise ValueError(f"request id {rid!r} is already running")
            self._handles[rid] = chunks
        try:
            self._send(ipc.SubmitReq(call_id, rid, ids, params, namespace), fut, call_id)
            fut.result()
        except BaseException:
            with self._lock:
                self._handles.pop(rid, None)
                self._pending.pop(call_id, None)
            raise
        return RequestHandle(rid, chunks, self.alive)

    def abort(self, rid: str) -> None:
        if self.failed is None and not self._closed:
            self._send(ipc.AbortReq(rid))

    # --- cache and introspection -------------------------------------------------------------
    def call_in_scheduler(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """fn(scheduler) in the scheduler process: fn must pickle (a module-level function or
        a SchedulerCall of one with plain arguments)."""
        return self._call(ipc.InScheduler(fn, timeout), timeout=timeout)

    def cache_stats(self) -> CacheStats:
        """The scheduler process's record (pickled across)."""
        return self._call(ipc.CacheStats())

    def model_info(self) -> dict[str, Any]:
        return self._call(ipc.ModelInfo())

    def event_log(self) -> RemoteEventLog:
        self._call(ipc.EventsLastSeq())  # makes sure the scheduler has one
        return RemoteEventLog(self)

    def kv_block_changes(
        self, block_size: int, salt_key: bytes, reset: bool = False
    ) -> BlockChanges:
        return self._call(ipc.KvBlockChanges(block_size, salt_key, reset), CALL_TIMEOUT_S)

    # --- cache admin: each call one operation, answered in the scheduler process --------------
    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchInfo:
        return self._call(ipc.MatchPrefix(key, namespace), CALL_TIMEOUT_S)

    def evict(
        self,
        tier: str,
        num_tokens: int | None = None,
        prefix: list[int] | None = None,
        namespace: str | None = None,
        dry_run: bool = False,
        namespaces: frozenset[str] | None = None,
    ) -> EvictInfo:
        op = ipc.Evict(tier, num_tokens, prefix, namespace, dry_run, namespaces)
        return self._call(op, CALL_TIMEOUT_S)

    def pin(
        self,
        key: list[int],
        namespace: str | None = None,
        ttl_s: float = 0.0,
        owner: str | None = None,
    ) -> Pin | None:
        return self._call(ipc.PinPrefix(key, namespace, ttl_s, owner), CALL_TIMEOUT_S)

    def unpin(self, pin_id: str | None = None, owner: str | None = None) -> tuple[int, int]:
        return self._call(ipc.Unpin(pin_id, owner), CALL_TIMEOUT_S)

    def pin_summary(self) -> tuple[int, int]:
        return self._call(ipc.PinSummary(), CALL_TIMEOUT_S)

    def flush(self, tiers: list[str] | None = None) -> FlushInfo:
        return self._call(ipc.Flush(tiers), CALL_TIMEOUT_S)

    def flush_namespaces(
        self, namespaces: frozenset[str], tiers: list[str] | None, owner: str | None
    ) -> FlushInfo:
        return self._call(ipc.FlushNamespaces(namespaces, tiers, owner), CALL_TIMEOUT_S)

    def inspect_tree(
        self,
        offset: int = 0,
        limit: int = 100,
        preview_tokens: int = 16,
        namespaces: frozenset[str] | None = None,
    ) -> tuple[list[NodeInfo], int]:
        op = ipc.InspectTree(offset, limit, preview_tokens, namespaces)
        return self._call(op, CALL_TIMEOUT_S)

    def apply_quotas(self, quotas: Sequence[TenantQuota]) -> None:
        self._call(ipc.ApplyQuotas(tuple(quotas)), CALL_TIMEOUT_S)

    def tenant_view(self, tenant: str, namespaces: frozenset[str]) -> TenantView:
        return self._call(ipc.TenantView(tenant, namespaces), CALL_TIMEOUT_S)

    def tenant_figures(self, quotas: Sequence[TenantQuota]) -> dict[str, dict[str, dict[str, int]]]:
        return self._call(ipc.TenantFigures(tuple(quotas)), CALL_TIMEOUT_S)

    def storage_info(self) -> dict[str, Any]:
        return self._call(ipc.StorageInfo())

    def attach_storage(
        self, backend: str, url: str | None = None, directory: str | None = None
    ) -> dict[str, Any]:
        try:
            return self._call(ipc.AttachStorage(backend, url, directory))
        finally:
            self.server_args = self._call(ipc.GetServerArgs())

    def detach_storage(self, timeout: float = 30.0) -> dict[str, Any]:
        try:
            return self._call(ipc.DetachStorage(timeout), timeout=timeout + 30.0)
        finally:
            self.server_args = self._call(ipc.GetServerArgs())

    def shutdown(self) -> None:
        """Stops the scheduler (L3 backups land), then the detokenizer; kills what hangs."""
        if self._closed:
            return
        atexit.unregister(self.shutdown)
        if self.failed is None:
            call_id = next(self._ids)
            fut: Future[Any] = Future()
            try:
                self._send(ipc.Shutdown(call_id), fut, call_id)
                fut.result(SCHEDULER_JOIN_S + L3_DRAIN_S + CALL_MARGIN_S)
            except Exception:  # a hung or dead scheduler is killed below
                log.exception("the scheduler process did not shut down cleanly")
        self._closed = True
        for name in ("scheduler", "detokenizer"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.join(10)
                if proc.is_alive():
                    log.warning("the %s process did not exit; killing it", name)
        self._kill_children()
        self._stopping.set()
        self._router.join(5)
        with self._lock:
            handles, self._handles = self._handles, {}
        for q in handles.values():
            q.put(EngineShutdownError("the engine was shut down"))
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._closed = True
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

    def child_pids(self) -> dict[str, int]:
        """The scheduler and detokenizer processes' ids."""
        return {name: p.pid for name, p in self.procs.items() if p.pid is not None}

    def __repr__(self) -> str:
        return f"SplitEngine(pid={os.getpid()}, children={self.child_pids()})"


class RemoteEventLog:
    """The scheduler process' CacheEventLog, read from the API server (WatchCacheEvents)."""

    def __init__(self, engine: SplitEngine):
        self._engine = engine

    @property
    def last_seq(self) -> int:
        return self._engine._call(ipc.EventsLastSeq())

    @property
    def first_seq(self) -> int:
        return self._engine._call(ipc.EventsFirstSeq())

    def since(self, seq: int, limit: int | None = None) -> list[CacheEvent]:
        return self._engine._call(ipc.EventsSince(seq, limit))

    def missed(self, seq: int) -> int:
        return self._engine._call(ipc.EventsMissed(seq))

    def wait_for(self, seq: int, timeout: float | None = None) -> bool:
        return self._engine._call(ipc.EventsWaitFor(seq, timeout), timeout=timeout)
