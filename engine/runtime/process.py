"""The scheduler process: one loop, on its main thread, reads its ZMQ socket and runs the
scheduler (engine/runtime/scheduler: the model runner, the KV pools, the radix / hierarchical
cache and its controller). Takes tokenized requests and admin calls from the API server, sends
token ids to the detokenizer and call results back to the API server.

    loop      drain the socket (SubmitReq: a request added to the scheduler; AbortReq; CallReq;
              Shutdown), run one scheduler pass (``Scheduler.run_once``: its inbox, a step); a
              pass that did nothing polls the socket and the scheduler's inbox (copy acks, the
              threads below) until the scheduler's next deadline (``sleep_time``)
    calls     answered by the loop between two steps, every launched step's results handled
              first (``Scheduler.run_call``), with the function each operation names; those
              that wait run on threads: reads of the event log (WatchCacheEvents streams wait
              there) and an L3 attach (building the backend scans its directory), whose work on
              the scheduler goes back to the loop through the scheduler's inbox
    shutdown  the loop stops, the scheduler closes (no forward outlives it), the queued L3
              backups land, the copy threads stop; the detokenizer is told, the Shutdown answered

The in-process ``Engine`` (engine/runtime/engine.py) is the same scheduler on a thread of a
script's process; this process runs none.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, TypeVar, assert_never

import zmq

from engine import ipc
from engine.config import ServerArgs
from engine.errors import QueueFullError
from engine.front import StreamChunk
from engine.runtime import cache_admin, tenant_cache
from engine.runtime.kv_block_view import kv_block_changes
from engine.runtime.request import Req
from engine.runtime.scheduler import Scheduler, lifecycle
from engine.runtime.scheduler.stats import cache_stats
from engine.runtime.tree_factory import stop_tree_cache
from hicache.observe.events import CacheEventLog

log = logging.getLogger(__name__)
T = TypeVar("T")
CALL_THREADS = 4  # L3 attaches (a backend is built off the loop)
EVENT_THREADS = 32  # event-log reads: WatchCacheEvents streams wait here, not on admin calls


class _Sink:
    """A request's chunks, to the detokenizer; the first carries what its text needs."""

    def __init__(self, rid: str, start: tuple[bool, list[str]], outbox: ipc.Outbox):
        self.rid, self.outbox = rid, outbox
        self.start: tuple[bool, list[str]] | None = start  # sent with the first chunk only

    def __call__(self, chunk: StreamChunk) -> None:
        self.outbox.put("detok", ipc.TokenOut(self.rid, chunk, self.start))
        self.start = None


class SchedulerServer:
    """The loop of the scheduler process over ``scheduler`` (whose thread it runs on)."""

    def __init__(
        self, scheduler: Scheduler, eos_token_ids: set[int], addrs: ipc.Addresses, ctx: zmq.Context
    ):
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.sock = ipc.pull(ctx, addrs.sched_in)
        self.outbox = ipc.Outbox(
            {"api": ipc.push(ctx, addrs.api_reply), "detok": ipc.push(ctx, addrs.detok_in)}
        )
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(scheduler.inbox.fileno(), zmq.POLLIN)
        self.calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="hicache-call")
        self.event_calls = ThreadPoolExecutor(EVENT_THREADS, thread_name_prefix="hicache-events")
        self._events: CacheEventLog | None = None
        self._events_lock = threading.Lock()

    def serve(self) -> None:
        """Until Shutdown: then the scheduler stops (L3 backups land), the detokenizer is told,
        and the Shutdown is answered."""
        s = self.scheduler
        while True:
            for msg in self._received():
                if isinstance(msg, ipc.Shutdown):
                    self._shutdown(msg)
                    return
                self._on(msg)
            if not s.run_once():
                self.poller.poll(max(1, round(s.sleep_time() * 1000)))

    def _received(self) -> list[Any]:
        """Every message the socket holds now (no wait)."""
        msgs: list[Any] = []
        while (batch := ipc.recv(self.sock, 0)) is not None:
            msgs.extend(batch)
        return msgs

    def _on(self, msg: Any) -> None:
        if isinstance(msg, ipc.SubmitReq):
            self._reply(msg.call_id, self._submit, msg)
        elif isinstance(msg, ipc.AbortReq):
            lifecycle.abort(self.scheduler, msg.rid)
        elif isinstance(msg, ipc.CallReq):
            op = msg.op
            if isinstance(op, ipc.EventCall):
                self.event_calls.submit(self._reply, msg.call_id, self._run, op)
            elif isinstance(op, ipc.AttachStorage):
                self.calls.submit(self._reply, msg.call_id, self._run, op)
            else:
                self._reply(msg.call_id, self.scheduler.run_call, lambda s: self._run(op))

    def _reply(self, call_id: int, fn: Callable[..., Any], *args: Any) -> None:
        try:
            reply = ipc.Reply(call_id, True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            reply = ipc.Reply(call_id, False, ipc.picklable_error(e))
        self.outbox.put("api", reply)

    def _submit(self, m: ipc.SubmitReq) -> str:
        s = self.scheduler
        if s.num_queued() >= s.args.max_queued_requests:
            raise QueueFullError(
                f"{s.args.max_queued_requests} requests are already queued; retry later"
            )
        sink = _Sink(m.rid, (m.params.skip_special_tokens, list(m.params.stop)), self.outbox)
        req = Req.new(
            m.rid,
            m.ids,
            m.params,
            s.runner.tokenizer,
            self.eos_token_ids,
            s.max_context_len,
            s.runner.device,
            m.namespace,
            sink,
        )
        s.add_request(req)
        return req.rid

    def _in_loop(self, fn: Callable[[Scheduler], T]) -> T:
        """From a call thread: ``fn(scheduler)`` on the loop, between two steps."""
        return self.scheduler.inbox.put_call(fn).result()

    def _run(self, op: ipc.Operation) -> Any:
        """The answer to one operation: each names the function that serves it (on the loop,
        but for the event log's and an L3 attach, which run on a call thread)."""
        s = self.scheduler
        match op:
            case ipc.InScheduler():
                return op.fn(s)
            case ipc.CacheStats():
                return cache_stats(s)
            case ipc.ModelInfo():
                return s.runner.model_info()
            case ipc.StorageInfo():
                return cache_admin.storage_info(s)
            case ipc.GetServerArgs():
                return s.args
            case ipc.AttachStorage():
                return cache_admin.build_and_attach_storage(
                    s.args, s.tree_cache, self._in_loop, op.backend, op.url, op.directory
                )
            case ipc.DetachStorage():
                return cache_admin.detach_storage(s, op.timeout)
            case ipc.KvBlockChanges():
                return kv_block_changes(s, op.block_size, op.salt_key, op.reset)
            case ipc.MatchPrefix():
                return cache_admin.match_prefix(s, op.key, op.namespace)
            case ipc.Evict():
                return cache_admin.evict(
                    s,
                    op.tier,
                    num_tokens=op.num_tokens,
                    prefix=op.prefix,
                    namespace=op.namespace,
                    dry_run=op.dry_run,
                    namespaces=op.namespaces,
                )
            case ipc.PinPrefix():
                return cache_admin.pin(s, op.key, op.namespace, op.ttl_s, owner=op.owner)
            case ipc.Unpin():
                return cache_admin.unpin(s, op.pin_id, op.owner)
            case ipc.PinSummary():
                return cache_admin.pin_summary(s)
            case ipc.Flush():
                return cache_admin.flush(s, op.tiers)
            case ipc.FlushNamespaces():
                return tenant_cache.flush(s, op.namespaces, op.tiers, op.owner)
            case ipc.InspectTree():
                return cache_admin.inspect_tree(
                    s, op.offset, op.limit, op.preview_tokens, op.namespaces
                )
            case ipc.ApplyQuotas():
                return tenant_cache.apply_quotas(s, op.quotas)
            case ipc.TenantView():
                return tenant_cache.tenant_view(s, op.tenant, op.namespaces)
            case ipc.TenantFigures():
                return tenant_cache.tenant_figures(s, op.quotas)
            case ipc.EventsLastSeq():
                return self._event_log().last_seq
            case ipc.EventsFirstSeq():
                return self._event_log().first_seq
            case ipc.EventsSince():
                return self._event_log().since(op.seq, op.limit)
            case ipc.EventsMissed():
                return self._event_log().missed(op.seq)
            case ipc.EventsWaitFor():
                return self._event_log().wait_for(op.seq, op.timeout)
            case _:
                assert_never(op)

    def _event_log(self) -> CacheEventLog:
        """The scheduler's event log (made on the loop the first time), fetched once."""
        with self._events_lock:
            if self._events is None:
                self._events = self._in_loop(cache_admin.event_log)
            return self._events

    def _shutdown(self, m: ipc.Shutdown) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.event_calls.shutdown(wait=False, cancel_futures=True)
        self._reply(m.call_id, self._stop)
        self.outbox.put("detok", ipc.DetokStop())
        self.outbox.close()

    def _stop(self) -> None:
        """The loop has stopped: the scheduler closes, the queued L3 backups land (at most
        ``L3_DRAIN_S``), the copy threads stop."""
        self.scheduler.close()
        stop_tree_cache(self.scheduler.tree_cache, drain=True)


def scheduler_main(
    server_args: ServerArgs, addrs: ipc.Addresses, conn: Connection, log_level: str
) -> None:
    """The process' entry point: load, say ready (or why not) on `conn`, serve."""
    ipc.child_setup("scheduler", log_level)
    try:
        from engine.runtime.engine import eos_token_ids
        from engine.runtime.model_runner import ModelRunner
        from engine.runtime.tree_factory import build_tree_cache

        args = ServerArgs.from_kwargs(**server_args.to_dict())
        runner = ModelRunner(args)
        tree = build_tree_cache(args, runner)
        scheduler = Scheduler(args, runner, tree, runner.max_context_len)
        eos = eos_token_ids(runner.hf_config, runner.tokenizer)
    except BaseException:  # noqa: BLE001 - reported to the API server, which exits
        conn.send(("error", traceback.format_exc()))
        return
    ctx = zmq.Context()
    server = SchedulerServer(scheduler, eos, addrs, ctx)
    info = ipc.SchedulerInfo(runner.tokenizer, runner.vocab_size, runner.max_context_len, args)
    conn.send(("ready", info))
    log.info("scheduler ready")
    server.serve()
    ctx.destroy(linger=2000)
    # NOTE: its work is done (L3 backups landed, the Shutdown answered, sockets closed). The
    # interpreter's teardown after this (torch, the model, every module: CPU-bound, several
    # seconds on a loaded two-core machine) does nothing the next start needs, and the API
    # server waits only so long before it kills the process: end here.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
