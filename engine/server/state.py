"""Shared daemon state, the error -> status mapping, and the queue.Queue -> asyncio bridge."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import queue
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from engine.errors import EngineShutdownError, NotIdleError, QueueFullError, TierUnavailableError
from engine.front import EngineFront, EventLogReader, Prompt, RequestHandle, StreamChunk
from engine.server.auth import bearer, tenant_of
from engine.server.tenants import PermissionDeniedError, Principal, TenantTable
from engine.server.validate import ValidationError
from hicache.errors import StorageBusyError

if TYPE_CHECKING:
    from engine.server.metrics import Metrics
    from engine.server.settings import DaemonSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

# First match wins: (exception type, status code).
_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (ValidationError, grpc.StatusCode.INVALID_ARGUMENT),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineShutdownError, grpc.StatusCode.UNAVAILABLE),
    (NotIdleError, grpc.StatusCode.FAILED_PRECONDITION),
    (TierUnavailableError, grpc.StatusCode.FAILED_PRECONDITION),
    (StorageBusyError, grpc.StatusCode.FAILED_PRECONDITION),
    (TimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
]


@dataclass
class DaemonState:
    """What every servicer shares. `engine` is None until the model is loaded."""

    settings: DaemonSettings
    pool: ThreadPoolExecutor
    engine: EngineFront | None = None
    ready: bool = False
    draining: bool = False
    start_time: float = field(default_factory=time.time)
    # rid -> its handle (None while the engine is taking the request)
    active: dict[str, RequestHandle | None] = field(default_factory=dict)
    # rids the stop aborted once the drain's grace ran out (answered UNAVAILABLE, not ABORT)
    drain_aborted: set[str] = field(default_factory=set)
    event_log: EventLogReader | None = None
    metrics: Metrics | None = None
    tenants: TenantTable = field(default_factory=TenantTable)

    def __post_init__(self) -> None:
        self.tenants = TenantTable(self.settings.tenants)

    def principal(self, context: grpc.aio.ServicerContext) -> Principal:
        """Who makes this call (the auth interceptor has already let the token in)."""
        if not self.tenants.tenants:
            return Principal()
        tenant = tenant_of(bearer(context.invocation_metadata()), self.tenants)
        return Principal(tenant)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs a blocking call on the bridge pool (never on the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(fn, *args)
        )

    async def run_input(self, fn: Callable[..., T], *args: Any) -> T:
        """Like run() for engine calls that check user input (submit, tokenize): their
        ValueError becomes INVALID_ARGUMENT."""
        try:
            return await self.run(fn, *args)
        except ValueError as e:
            raise ValidationError(str(e)) from e

    async def submit(
        self,
        engine: EngineFront,
        prompt: Prompt,
        params: dict[str, Any],
        namespace: str | None,
        rid: str,
    ) -> RequestHandle:
        """engine.submit(...) off the event loop. If the call goes away (client cancel,
        deadline) while the engine is taking the request, the request is aborted as soon as it
        is in: it must not run for nobody."""
        fut = asyncio.get_running_loop().run_in_executor(
            self.pool, functools.partial(engine.submit, prompt, params, namespace, rid)
        )
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() else engine.abort(rid)
            )
            raise
        except ValueError as e:
            raise ValidationError(str(e)) from e

    async def require_engine(
        self, context: grpc.aio.ServicerContext, while_draining: bool = False
    ) -> EngineFront:
        """The engine, or the call ends UNAVAILABLE: still loading, or draining (new work is
        refused; ``while_draining`` lets through what only ends work, e.g. Abort)."""
        if self.draining and not while_draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if not self.ready or self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.engine


async def abort_for(exc: BaseException, context: grpc.aio.ServicerContext) -> None:
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    for typ, code in _STATUS:
        if isinstance(exc, typ):
            await context.abort(code, _details(str(exc) or typ.__name__))
    log.exception("internal error in an RPC handler", exc_info=exc)
    await context.abort(
        grpc.StatusCode.INTERNAL, _details(f"internal error: {type(exc).__name__}: {exc}")
    )


MAX_DETAILS = 2000  # characters of a status message (gRPC's metadata limit is 16 KiB)


def _details(text: str) -> str:
    """A status message no longer than MAX_DETAILS: one that echoes a long input (a path, a
    value) must still reach the client with our code."""
    if len(text) <= MAX_DETAILS:
        return text
    return f"{text[:MAX_DETAILS]}... ({len(text)} characters)"


def rpc(fn: Callable) -> Callable:
    """Maps exceptions raised by a unary or server-streaming handler to gRPC status codes."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for item in fn(self, request, context):
                    yield item
            except Exception as e:  # noqa: BLE001 - mapped to a status
                await abort_for(e, context)

        return stream

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            await abort_for(e, context)

    return unary


ChunkQueue = queue.Queue[StreamChunk | BaseException]  # RequestHandle.chunks


def _get_batch(q: ChunkQueue, timeout: float) -> list[StreamChunk | BaseException]:
    """Blocks up to timeout for one item, then takes whatever else is already there."""
    try:
        items = [q.get(timeout=timeout)]
    except queue.Empty:
        return []
    while not (isinstance(items[-1], StreamChunk) and items[-1].finished):
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            break
    return items


async def iter_chunks(
    q: ChunkQueue, pool: ThreadPoolExecutor, poll_s: float = 0.2
) -> AsyncIterator[StreamChunk]:
    """Yields a request's StreamChunks until the finished one; the blocking gets run on `pool`.
    NOTE: on cancellation the pending get returns within poll_s; the caller aborts the request."""
    loop = asyncio.get_running_loop()
    while True:
        for chunk in await loop.run_in_executor(pool, _get_batch, q, poll_s):
            if isinstance(chunk, BaseException):  # the engine failed under the request
                raise chunk
            yield chunk
            if chunk.finished:
                return


class EngineRequest:
    """One engine request at an API edge (gRPC Generate, the HTTP API): claimed in
    state.active (the drain waits for it), counted in the metrics, and aborted - its KV freed -
    by release() unless it finished."""

    def __init__(
        self,
        state: DaemonState,
        engine: EngineFront,
        handle: RequestHandle,
        running: dict[str, EngineRequest] | None,
        t0: float,
    ):
        self.state, self.engine, self.handle, self.rid = state, engine, handle, handle.rid
        self.running = {} if running is None else running  # the edge's open requests
        self.metrics = state.metrics
        self.finished = False
        self.released = False
        self.t0 = t0  # when it was submitted (time.monotonic())

    @classmethod
    async def start(
        cls,
        state: DaemonState,
        engine: EngineFront,
        prompt: Prompt,
        params: dict[str, Any],
        namespace: str | None,
        rid: str,
        running: dict[str, EngineRequest] | None = None,
    ) -> EngineRequest:
        """Submits; the caller has checked that `rid` is not in state.active. NOTE: the id is
        claimed before the first await: on the one event loop, check and claim are one step."""
        t0 = time.monotonic()
        state.active[rid] = None
        try:
            handle = await state.submit(engine, prompt, params, namespace, rid=rid)
        except BaseException:
            state.active.pop(rid, None)
            raise
        run = cls(state, engine, handle, running, t0)
        state.active[rid] = handle
        run.running[rid] = run
        if run.metrics is not None:
            run.metrics.stream_started()
        return run

    async def chunks(self) -> AsyncIterator[StreamChunk]:
        """The request's StreamChunks, up to and including the finished one."""
        t_first = t_last = None
        async for chunk in iter_chunks(self.handle.chunks, self.state.pool):
            if chunk.token_ids:
                t_last = time.monotonic()
                t_first = t_last if t_first is None else t_first
            if chunk.finished:
                self.finished = True
                if self.metrics is not None:
                    self.metrics.request_finished(chunk, self.t0, t_first, t_last)
            yield chunk

    def release(self) -> None:
        """Idempotent; client gone, failure or shutdown before the end: abort, free the KV."""
        if self.released:
            return
        self.released = True
        if not self.finished:
            self.engine.abort(self.rid)
        self.state.active.pop(self.rid, None)
        self.running.pop(self.rid, None)
        if self.metrics is not None:
            self.metrics.stream_ended()
