"""The scheduler process: owns the Engine (model runner, pools, radix / hierarchical cache and
its controller, the scheduler thread). Takes tokenized requests and admin calls from the API
server, sends token ids to the detokenizer and call results back to the API server."""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, assert_never

import zmq

from engine import ipc
from engine.config import ServerArgs
from engine.front import StreamChunk

log = logging.getLogger(__name__)
CALL_THREADS = 16  # admin calls that may block (on the scheduler thread) run side by side
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
    def __init__(self, engine: Any, addrs: ipc.Addresses, ctx: zmq.Context):
        self.engine = engine
        self.inbox = ipc.pull(ctx, addrs.sched_in)
        self.outbox = ipc.Outbox(
            {"api": ipc.push(ctx, addrs.api_reply), "detok": ipc.push(ctx, addrs.detok_in)}
        )
        self.calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="hicache-call")
        self.event_calls = ThreadPoolExecutor(EVENT_THREADS, thread_name_prefix="hicache-events")
        self._events: Any = None
        self._events_lock = threading.Lock()

    def serve(self) -> None:
        """Until Shutdown: then the engine shuts down (L3 backups land), the detokenizer is
        told, and the Shutdown is answered."""
        while True:
            batch = ipc.recv(self.inbox, 1000)
            for msg in batch or ():
                if isinstance(msg, ipc.SubmitReq):
                    self._submit(msg)
                elif isinstance(msg, ipc.AbortReq):
                    self.engine.abort(msg.rid)
                elif isinstance(msg, ipc.CallReq):
                    pool = self.event_calls if isinstance(msg.op, ipc.EventCall) else self.calls
                    pool.submit(self._call, msg)
                elif isinstance(msg, ipc.Shutdown):
                    self._shutdown(msg)
                    return

    def _reply(self, call_id: int, fn: Any, *args: Any) -> None:
        try:
            reply = ipc.Reply(call_id, True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            reply = ipc.Reply(call_id, False, ipc.picklable_error(e))
        self.outbox.put("api", reply)

    def _submit(self, m: ipc.SubmitReq) -> None:
        sink = _Sink(m.rid, (m.params.skip_special_tokens, list(m.params.stop)), self.outbox)
        self._reply(
            m.call_id, lambda: self.engine.enqueue(m.ids, m.params, m.namespace, m.rid, sink).rid
        )

    def _call(self, m: ipc.CallReq) -> None:
        self._reply(m.call_id, self._run, m)

    def _run(self, m: ipc.CallReq) -> Any:
        """The answer to one operation: each names the method that serves it."""
        op = m.op
        match op:
            case ipc.InScheduler():
                return self.engine.call_in_scheduler(op.fn, op.timeout)
            case ipc.CacheStats():
                return self.engine.cache_stats()
            case ipc.ModelInfo():
                return self.engine.model_info()
            case ipc.StorageInfo():
                return self.engine.storage_info()
            case ipc.GetServerArgs():
                return self.engine.server_args
            case ipc.AttachStorage():
                return self.engine.attach_storage(op.backend, op.url, op.directory)
            case ipc.DetachStorage():
                return self.engine.detach_storage(op.timeout)
            case ipc.KvBlockChanges():
                return self.engine.kv_block_changes(op.block_size, op.salt_key, op.reset)
            case ipc.MatchPrefix():
                return self.engine.match_prefix(op.key, op.namespace)
            case ipc.Evict():
                return self.engine.evict(
                    op.tier, op.num_tokens, op.prefix, op.namespace, op.dry_run, op.namespaces
                )
            case ipc.PinPrefix():
                return self.engine.pin(op.key, op.namespace, op.ttl_s, op.owner)
            case ipc.Unpin():
                return self.engine.unpin(op.pin_id, op.owner)
            case ipc.PinSummary():
                return self.engine.pin_summary()
            case ipc.Flush():
                return self.engine.flush(op.tiers)
            case ipc.FlushNamespaces():
                return self.engine.flush_namespaces(op.namespaces, op.tiers, op.owner)
            case ipc.InspectTree():
                return self.engine.inspect_tree(
                    op.offset, op.limit, op.preview_tokens, op.namespaces
                )
            case ipc.ApplyQuotas():
                return self.engine.apply_quotas(op.quotas)
            case ipc.TenantView():
                return self.engine.tenant_view(op.tenant, op.namespaces)
            case ipc.TenantFigures():
                return self.engine.tenant_figures(op.quotas)
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

    def _event_log(self) -> Any:
        """The engine's event log (the scheduler always has one), fetched once."""
        with self._events_lock:
            if self._events is None:
                self._events = self.engine.event_log()
            return self._events

    def _shutdown(self, m: ipc.Shutdown) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.event_calls.shutdown(wait=False, cancel_futures=True)
        self._reply(m.call_id, self.engine.shutdown)
        self.outbox.put("detok", ipc.DetokStop())
        self.outbox.close()


def scheduler_main(
    server_args: ServerArgs, addrs: ipc.Addresses, conn: Connection, log_level: str
) -> None:
    """The process' entry point: load, say ready (or why not) on `conn`, serve."""
    ipc.child_setup("scheduler", log_level)
    try:
        from engine.runtime.engine import Engine

        kw = server_args.to_dict()
        engine = Engine(model=kw.pop("model_path"), device=kw.pop("device"), **kw)
    except BaseException:  # noqa: BLE001 - reported to the API server, which exits
        conn.send(("error", traceback.format_exc()))
        return
    ctx = zmq.Context()
    server = SchedulerServer(engine, addrs, ctx)
    conn.send(
        (
            "ready",
            ipc.SchedulerInfo(
                engine.tokenizer, engine.vocab_size, engine.max_context_len, engine.server_args
            ),
        )
    )
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
