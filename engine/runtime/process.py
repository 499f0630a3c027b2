"""The scheduler process: owns the Engine (model runner, pools, radix / hierarchical cache and
its controller, the scheduler thread). Takes tokenized requests and admin calls from the API
server, sends token ids to the detokenizer and call results back to the API server."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import zmq

from engine import operations as ops
from engine.config import ServerArgs
from engine.front import StreamChunk
from engine.ipc import messages, transport

log = logging.getLogger(__name__)
CALL_THREADS = 16  # admin calls that may block (on the scheduler thread) run side by side
EVENT_THREADS = 32  # event-log reads: WatchCacheEvents streams wait here, not on admin calls


class _Sink:
    """A request's chunks, to the detokenizer; the first carries what its text needs."""

    def __init__(self, rid: str, start: tuple[bool, list[str]], outbox: transport.Outbox):
        self.rid, self.outbox = rid, outbox
        self.start: tuple[bool, list[str]] | None = start  # sent with the first chunk only

    def __call__(self, chunk: StreamChunk) -> None:
        self.outbox.put("detok", messages.TokenOut(self.rid, chunk, self.start))
        self.start = None


class SchedulerServer:
    def __init__(self, engine: Any, addrs: transport.Addresses, ctx: zmq.Context):
        self.engine = engine
        self.inbox = transport.pull(ctx, addrs.sched_in)
        self.outbox = transport.Outbox(
            {
                "api": transport.push(ctx, addrs.api_reply),
                "detok": transport.push(ctx, addrs.detok_in),
            }
        )
        self.calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="hicache-call")
        self.event_calls = ThreadPoolExecutor(EVENT_THREADS, thread_name_prefix="hicache-events")

    def serve(self) -> None:
        """Until Shutdown: then the engine shuts down (L3 backups land), the detokenizer is
        told, and the Shutdown is answered."""
        while True:
            batch = transport.recv(self.inbox, 1000)
            for msg in batch or ():
                if isinstance(msg, messages.SubmitReq):
                    self._submit(msg)
                elif isinstance(msg, messages.AbortReq):
                    self.engine.abort(msg.rid)
                elif isinstance(msg, messages.CallReq):
                    pool = self.event_calls if isinstance(msg.op, ops.EventRead) else self.calls
                    pool.submit(self._call, msg)
                elif isinstance(msg, messages.Shutdown):
                    self._shutdown(msg)
                    return

    def _reply(self, call_id: int, fn: Any, *args: Any) -> None:
        try:
            reply = messages.Reply(call_id, True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            reply = messages.Reply(call_id, False, transport.picklable_error(e))
        self.outbox.put("api", reply)

    def _submit(self, m: messages.SubmitReq) -> None:
        sink = _Sink(m.rid, (m.params.skip_special_tokens, list(m.params.stop)), self.outbox)
        self._reply(
            m.call_id, lambda: self.engine.enqueue(m.ids, m.params, m.namespace, m.rid, sink).rid
        )

    def _call(self, m: messages.CallReq) -> None:
        self._reply(m.call_id, self.engine.call, m.op)

    def _shutdown(self, m: messages.Shutdown) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.event_calls.shutdown(wait=False, cancel_futures=True)
        self._reply(m.call_id, self.engine.shutdown)
        self.outbox.put("detok", messages.DetokStop())
        self.outbox.close()


def scheduler_main(
    server_args: ServerArgs, addrs: transport.Addresses, conn: Connection, log_level: str
) -> None:
    """The process' entry point: load, say ready (or why not) on `conn`, serve."""
    transport.child_setup("scheduler", log_level)
    try:
        from engine.runtime.engine import Engine

        engine = Engine(**server_args.to_dict())
    except BaseException:  # noqa: BLE001 - reported to the API server, which exits
        conn.send(("error", traceback.format_exc()))
        return
    ctx = zmq.Context()
    server = SchedulerServer(engine, addrs, ctx)
    conn.send(
        (
            "ready",
            messages.SchedulerInfo(
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
