"""SplitEngine: the EngineFront (engine/front.py) in the API server process, over a scheduler
process and a detokenizer process (seed 002's layout). Requests go as SubmitReq / AbortReq,
every other call as the operation itself (engine/operations.py) in a CallReq, which the
scheduler process answers with the operation's handler (engine/runtime/handlers.py), as the
in-process Engine does (engine/ipc says what travels where). Tokenization and validation happen
here; the scheduler process gets token ids; the detokenizer process returns text increments.

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
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import zmq

from engine import operations as ops
from engine.config import ServerArgs
from engine.detokenizer.process import detokenizer_main
from engine.errors import EngineShutdownError
from engine.front import (
    L3_DRAIN_S,
    SCHEDULER_JOIN_S,
    EngineFront,
    Prompt,
    RequestHandle,
    StreamChunk,
)
from engine.ipc import messages, transport
from engine.tokenizer import TokenizerManager
from hicache.observe.events import CacheEvent

log = logging.getLogger(__name__)
START_TIMEOUT_S = 900.0  # model conversion + load on a slow machine
CALL_MARGIN_S = 10.0  # a call's reply may take this much longer than its own timeout
R = TypeVar("R")


def run_scheduler_process(
    server_args: ServerArgs, addrs: transport.Addresses, conn: Connection, log_level: str
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
        self.addrs = transport.Addresses.in_dir(self._dir)
        self._ctx = zmq.Context()
        self._replies = transport.pull(self._ctx, self.addrs.api_reply)
        self._chunks = transport.pull(self._ctx, self.addrs.api_chunks)
        self._to_sched = transport.push(self._ctx, self.addrs.sched_in)
        mp = multiprocessing.get_context("spawn")
        self.procs: dict[str, multiprocessing.Process] = {}
        try:
            info: messages.SchedulerInfo = self._spawn(
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
                for r in transport.recv(self._replies, 0) or ():
                    with self._lock:
                        fut = self._pending.pop(r.call_id, None)
                    if fut is not None and not fut.done():
                        (fut.set_result if r.ok else fut.set_exception)(r.value)
            if self._chunks in events:
                for m in transport.recv(self._chunks, 0) or ():
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
            transport.send(self._to_sched, [msg])

    def _call(self, op: ops.Operation[R]) -> R:
        """``op`` answered by the scheduler process (waits its ``answer_within()`` plus a
        margin; None: as long as it takes)."""
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        call_id = next(self._ids)
        fut: Future[Any] = Future()
        self._send(messages.CallReq(call_id, op), fut, call_id)
        timeout = op.answer_within()
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
            self._send(messages.SubmitReq(call_id, rid, ids, params, namespace), fut, call_id)
            fut.result()
        except BaseException:
            with self._lock:
                self._handles.pop(rid, None)
                self._pending.pop(call_id, None)
            raise
        return RequestHandle(rid, chunks, self.alive)

    def abort(self, rid: str) -> None:
        if self.failed is None and not self._closed:
            self._send(messages.AbortReq(rid))

    # --- operations: each one CallReq, answered in the scheduler process ----------------------
    def call(self, op: ops.Operation[R]) -> R:
        try:
            return self._call(op)
        finally:
            if op.changes_server_args:  # this process' copy follows the scheduler's
                self.server_args = self._call(ops.GetServerArgs())

    def call_in_scheduler(self, fn: Callable[[Any], Any], timeout: float | None = 60.0) -> Any:
        """fn(scheduler) in the scheduler process: fn must pickle (a module-level function or
        a SchedulerCall of one with plain arguments)."""
        return self.call(ops.InScheduler(fn, timeout))

    def event_log(self) -> RemoteEventLog:
        self.call(ops.EventsLastSeq())  # makes sure the scheduler has one
        return RemoteEventLog(self)

    def shutdown(self) -> None:
        """Stops the scheduler (L3 backups land), then the detokenizer; kills what hangs."""
        if self._closed:
            return
        atexit.unregister(self.shutdown)
        if self.failed is None:
            call_id = next(self._ids)
            fut: Future[Any] = Future()
            try:
                self._send(messages.Shutdown(call_id), fut, call_id)
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
        return self._engine.call(ops.EventsLastSeq())

    @property
    def first_seq(self) -> int:
        return self._engine.call(ops.EventsFirstSeq())

    def since(self, seq: int, limit: int | None = None) -> list[CacheEvent]:
        return self._engine.call(ops.EventsSince(seq, limit))

    def missed(self, seq: int) -> int:
        return self._engine.call(ops.EventsMissed(seq))

    def wait_for(self, seq: int, timeout: float | None = None) -> bool:
        return self._engine.call(ops.EventsWaitFor(seq, timeout))
