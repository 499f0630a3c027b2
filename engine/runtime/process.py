"""The scheduler process: one loop, on its main thread, reads its ZMQ socket and runs the
scheduler (engine/runtime/scheduler: the model runner, the KV pools, the radix / hierarchical
cache and its controller). Takes tokenized requests and admin calls from the API server, sends
token ids to the detokenizer and call results back to the API server.

    loop      drain the socket (SubmitReq: a request added to the scheduler; AbortReq; CallReq;
              Shutdown), run one scheduler pass (``Scheduler.run_once``: its inbox, a step); a
              pass that did nothing polls the socket and the scheduler's inbox (copy acks, the
              threads below) until the scheduler's next deadline (``sleep_time``)
    calls     answered by the operation's handler (engine/runtime/handlers.py) on the loop
              between two steps, every launched step's results handled first
              (``Scheduler.run_call``); handlers declared to run on the caller's thread run on
              threads here: reads of the event log (WatchCacheEvents streams wait there), an L3
              attach / detach (building a backend scans its directory), the model's facts;
              their work on the scheduler goes back to the loop through the scheduler's inbox
    shutdown  the loop stops, the scheduler closes (no forward outlives it), the queued L3
              backups land, the copy threads stop; the detokenizer is told, the Shutdown answered

The in-process ``Engine`` (engine/runtime/engine.py) is the same scheduler on a thread of a
script's process; this process runs none.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

import zmq

from engine import operations as ops
from engine.config import ServerArgs
from engine.errors import QueueFullError
from engine.front import StreamChunk
from engine.ipc import messages, transport
from engine.runtime import handlers
from engine.runtime.request import Req
from engine.runtime.scheduler import Scheduler, lifecycle
from engine.runtime.tree_factory import stop_tree_cache

log = logging.getLogger(__name__)
CALL_THREADS = 4  # handlers that wait off the loop: L3 attach / detach, the model's facts
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
    """The loop of the scheduler process over ``scheduler`` (whose thread it runs on)."""

    def __init__(
        self,
        scheduler: Scheduler,
        eos_token_ids: set[int],
        addrs: transport.Addresses,
        ctx: zmq.Context,
    ):
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.sock = transport.pull(ctx, addrs.sched_in)
        self.outbox = transport.Outbox(
            {
                "api": transport.push(ctx, addrs.api_reply),
                "detok": transport.push(ctx, addrs.detok_in),
            }
        )
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(scheduler.inbox.fileno(), zmq.POLLIN)
        self.calls = ThreadPoolExecutor(CALL_THREADS, thread_name_prefix="hicache-call")
        self.event_calls = ThreadPoolExecutor(EVENT_THREADS, thread_name_prefix="hicache-events")

    def serve(self) -> None:
        """Until Shutdown: then the scheduler stops (L3 backups land), the detokenizer is told,
        and the Shutdown is answered."""
        s = self.scheduler
        while True:
            for msg in self._received():
                if isinstance(msg, messages.Shutdown):
                    self._shutdown(msg)
                    return
                self._on(msg)
            if not s.run_once():
                self.poller.poll(max(1, round(s.sleep_time() * 1000)))

    def _received(self) -> list[Any]:
        """Every message the socket holds now (no wait)."""
        msgs: list[Any] = []
        while (batch := transport.recv(self.sock, 0)) is not None:
            msgs.extend(batch)
        return msgs

    def _on(self, msg: Any) -> None:
        if isinstance(msg, messages.SubmitReq):
            self._reply(msg.call_id, self._submit, msg)
        elif isinstance(msg, messages.AbortReq):
            lifecycle.abort(self.scheduler, msg.rid)
        elif isinstance(msg, messages.CallReq):
            self._call(msg)

    def _call(self, m: messages.CallReq) -> None:
        """On the loop between two steps, or on a call thread where the handler waits
        (engine/runtime/handlers.py: its work on the scheduler comes back through the inbox)."""
        try:
            h = handlers.handler(m.op)
        except TypeError as e:
            self._reply(m.call_id, _raise, e)
            return
        if h.caller_thread:
            pool = self.event_calls if isinstance(m.op, ops.EventRead) else self.calls
            pool.submit(self._reply, m.call_id, h.fn, self.scheduler, m.op)
        else:
            self._reply(m.call_id, self.scheduler.run_call, lambda s: h.fn(s, m.op))

    def _reply(self, call_id: int, fn: Callable[..., Any], *args: Any) -> None:
        try:
            reply = messages.Reply(call_id, True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered to the caller
            reply = messages.Reply(call_id, False, transport.picklable_error(e))
        self.outbox.put("api", reply)

    def _submit(self, m: messages.SubmitReq) -> str:
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

    def _shutdown(self, m: messages.Shutdown) -> None:
        self.calls.shutdown(wait=False, cancel_futures=True)
        self.event_calls.shutdown(wait=False, cancel_futures=True)
        self._reply(m.call_id, self._stop)
        self.outbox.put("detok", messages.DetokStop())
        self.outbox.close()

    def _stop(self) -> None:
        """The loop has stopped: the scheduler closes, the queued L3 backups land (at most
        ``L3_DRAIN_S``), the copy threads stop."""
        self.scheduler.close()
        stop_tree_cache(self.scheduler.tree_cache, drain=True)


def scheduler_main(
    server_args: ServerArgs, addrs: transport.Addresses, conn: Connection, log_level: str
) -> None:
    """The process' entry point: load, say ready (or why not) on `conn`, serve."""
    transport.child_setup("scheduler", log_level)
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
    info = messages.SchedulerInfo(runner.tokenizer, runner.vocab_size, runner.max_context_len, args)
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


def _raise(e: BaseException) -> None:
    raise e
