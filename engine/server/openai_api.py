"""The OpenAI-compatible HTTP API: GET /v1/models[/{id}], POST /v1/completions and
/v1/chat/completions (JSON or SSE streams), GET /health; beside it what a gateway polls: GET
/v1/loads (and /loads, SGLang's load report) and GET /metrics (Prometheus). A Starlette app served by uvicorn as a
task on the daemon's event loop, beside gRPC, sharing its DaemonState: the same engine, the
same auth and tenant rules, the same `active` requests (drain waits for them) and metrics.

    api = HttpApi(state, settings); port = await api.start(); ...; await api.stop()

Request shapes live in openai_protocol.py; errors, auth and the request lifecycle in
openai_edge.py; this module has the routes and the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.front import EngineFront, Prompt, StreamChunk
from engine.server import openai_edge as edge
from engine.server import openai_protocol as proto
from engine.server.loads import UnknownSectionError, daemon_version, loads_report, parse_include
from engine.server.openai_edge import (
    EventStream,
    HttpError,
    authorize,
    error_response,
    require_engine,
)
from engine.server.settings import DaemonSettings
from engine.server.state import DaemonState, EngineRequest

log = logging.getLogger(__name__)

OWNER = "hicache"
VERSION = daemon_version()
ABORT_ANSWER_S = 2  # at stop: for aborted requests' answers to go out before they are cut


def model_ids(model_path: str, served_model_name: str | None = None) -> tuple[str, ...]:
    """The served model's id (--served-model-name, else the directory's name), then the other
    names it answers to. /v1/models lists them all: a gateway routes by the listed ids and
    refuses a request naming any other."""
    name = os.path.basename(model_path.rstrip("/\\")) or "default"
    name = name.removeprefix("embedded:")
    return tuple(dict.fromkeys(n for n in (served_model_name, name, "default", model_path) if n))


def _endpoint(fn: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Every exception of a handler becomes an OpenAI error response (never a Starlette page)."""

    @functools.wraps(fn)
    async def wrapper(self: OpenAIApi, request: Request) -> Response:
        try:
            return await fn(self, request)
        except Exception as e:  # noqa: BLE001 - mapped to a status
            return error_response(e)

    return wrapper


class OpenAIApi:
    """The routes, over the daemon's shared state."""

    def __init__(
        self,
        state: DaemonState,
        max_body_bytes: int = 64 * 2**20,
        served_model_name: str | None = None,
    ):
        self.state = state
        self.served_model_name = served_model_name
        self.max_body_bytes = max_body_bytes
        self._models: tuple[EngineFront, tuple[str, ...]] | None = None  # (engine, model_ids)
        self.running: dict[str, EngineRequest] = {}  # engine rid -> its open request
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/loads", self.loads, methods=["GET"]),
                Route("/loads", self.loads, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self._http_exception, Exception: self._crash},
        )

    # --- plumbing -----------------------------------------------------------------------------
    @staticmethod
    async def _http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return JSONResponse(
            proto.error_body(message, "invalid_request_error", None, code),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @staticmethod
    async def _crash(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    async def _model_ids(self, engine: EngineFront) -> tuple[str, ...]:
        if self._models is None or self._models[0] is not engine:
            info = await self.state.run(engine.model_info)
            ids = model_ids(str(info.get("model_path") or ""), self.served_model_name)
            self._models = (engine, ids)
        return self._models[1]

    def _model_card(self, model_id: str, engine: EngineFront) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": int(self.state.start_time),
            "owned_by": OWNER,
            "max_model_len": engine.max_context_len,
        }

    async def _served_model(self, engine: EngineFront, asked: str | None) -> str:
        ids = await self._model_ids(engine)
        if asked is not None and asked not in ids:
            raise HttpError(
                404,
                "invalid_request_error",
                f"the model {asked!r} does not exist; this server has {ids[0]!r}",
                param="model",
                code="model_not_found",
            )
        return ids[0]

    # --- routes -------------------------------------------------------------------------------
    @_endpoint
    async def health(self, request: Request) -> Response:
        require_engine(self.state)
        return JSONResponse({"status": "ok"})

    @_endpoint
    async def list_models(self, request: Request) -> Response:
        authorize(request.headers, self.state)
        engine = require_engine(self.state)
        ids = await self._model_ids(engine)
        return JSONResponse({"object": "list", "data": [self._model_card(m, engine) for m in ids]})

    @_endpoint
    async def get_model(self, request: Request) -> Response:
        authorize(request.headers, self.state)
        engine = require_engine(self.state)
        asked = request.path_params["model_id"]
        await self._served_model(engine, asked)
        return JSONResponse(self._model_card(asked, engine))

    @_endpoint
    async def loads(self, request: Request) -> Response:
        authorize(request.headers, self.state)
        engine = require_engine(self.state)
        try:
            include = parse_include(request.query_params.getlist("include"))
        except UnknownSectionError as e:
            raise proto.InvalidRequestError(str(e), "include") from None
        model = request.query_params.get("model")
        if model is not None:  # SMG's `/loads?model=<id>`: this daemon serves one model
            await self._served_model(engine, model)
        stats = await self.state.run(engine.cache_stats)
        return JSONResponse(
            loads_report(stats, engine.server_args.max_running_requests, VERSION, include)
        )

    @_endpoint
    async def metrics(self, request: Request) -> Response:
        """The Prometheus text of --metrics-port, on this port too. NOTE: with auth on it needs
        the user or admin token: a tenant's key is refused (the figures name every tenant)."""
        if authorize(request.headers, self.state).tenant is not None:
            raise HttpError(403, "permission_error", "/metrics needs the user or admin token")
        metrics = self.state.metrics
        if metrics is None:
            raise HttpError(404, "invalid_request_error", "metrics are off", code="not_found")
        body = await self.state.run(metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @_endpoint
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    @_endpoint
    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        st = self.state
        who = authorize(request.headers, st)
        engine = require_engine(st)
        body = await edge.read_json(request, self.max_body_bytes)
        parse = proto.parse_chat if chat else proto.parse_completion
        req = parse(body, engine.vocab_size, engine.max_context_len)
        model = await self._served_model(engine, req.model)
        namespace = who.namespace(req.namespace)
        prompt = req.prompt
        if chat:  # the chat template applies here; the engine gets token ids
            prompt = await self._chat_ids(engine, prompt)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        # a JSON answer needs only the whole output: one chunk instead of one per token
        params = req.params if req.stream else {**req.params, "final_only": True}
        run = await EngineRequest.start(
            st, engine, prompt, params, namespace, who.request_id(rid), self.running
        )
        created = int(time.time())
        if req.stream:
            return EventStream(
                self._events(run, rid, model, created, chat, req.include_usage), run.release
            )
        try:
            text, last = await self._collect(request, run)
        finally:
            run.release()
        if last.finish_reason == "abort":
            raise edge.aborted(last, st)
        build = proto.chat_response if chat else proto.completion_response
        return JSONResponse(build(rid, model, created, text, last))

    async def _chat_ids(self, engine: EngineFront, messages: Prompt) -> list[int]:
        try:
            return await self.state.run_input(engine.tokenize, messages)
        except Exception as e:
            # A template may refuse a conversation (roles that do not alternate, ...): jinja's
            # TemplateError is the client's input, not a server fault.
            if type(e).__module__.startswith("jinja2"):
                raise proto.InvalidRequestError(
                    f"the chat template rejected the messages: {e}", "messages"
                ) from None
            raise

    async def _collect(self, request: Request, run: EngineRequest) -> tuple[str, StreamChunk]:
        """The whole completion; the request is cancelled if the client goes away first."""

        async def collect() -> tuple[str, StreamChunk]:
            parts, last = [], None
            async for chunk in run.chunks():
                parts.append(chunk.text)
                last = chunk
            assert last is not None
            return "".join(parts), last

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(edge.until_disconnected(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # no-op when done
        if not work.done() or work.cancelled():
            # nginx's "client closed request"; nobody reads it
            raise HttpError(499, "invalid_request_error", "the client closed the connection")
        return work.result()

    async def _events(
        self,
        run: EngineRequest,
        rid: str,
        model: str,
        created: int,
        chat: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        extra: dict[str, Any] = {"usage": None} if include_usage else {}

        def piece(text: str | None, finish_reason: str | None = None) -> dict[str, Any]:
            if chat:
                delta = {} if text is None else {"content": text}
                return {**proto.chat_chunk(rid, model, created, delta, finish_reason), **extra}
            return {
                **proto.completion_chunk(rid, model, created, text or "", finish_reason),
                **extra,
            }

        try:
            if chat:  # OpenAI's first chunk: the role, no text yet
                role = proto.chat_chunk(rid, model, created, {"role": "assistant", "content": ""})
                yield edge.sse({**role, **extra})
            async for chunk in run.chunks():
                if chunk.text:
                    yield edge.sse(piece(chunk.text))
                if not chunk.finished:
                    continue
                if chunk.finish_reason == "abort":
                    e = edge.aborted(chunk, self.state)
                    yield edge.sse(proto.error_body(str(e), e.type_, None, e.code))
                    break
                yield edge.sse(piece(None, chunk.finish_reason))
                if include_usage:
                    yield edge.sse(proto.usage_chunk(piece(None), chunk))
        except Exception as e:  # noqa: BLE001 - the status line has gone: report in-band
            body = json.loads(bytes(error_response(e).body))
            yield edge.sse(body)
        yield "data: [DONE]\n\n"


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: SIGTERM / SIGINT belong to the daemon (a drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpApi:
    """The OpenAI API's HTTP server on the running event loop: start() binds (port 0: a free
    port) and returns the port; stop() closes it, aborting the requests still open."""

    def __init__(self, state: DaemonState, settings: DaemonSettings):
        self.state = state
        self.settings = settings
        self.api = OpenAIApi(state, settings.max_message_mb * 2**20, settings.served_model_name)
        self.port = 0
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, port: int | None = None) -> int:
        host = self.settings.http_host
        port = self.settings.http_port if port is None else port
        # NOTE: we bind the socket ourselves so that the port is known (and an error raised
        # here) before uvicorn runs.
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
        # NOTE: uvicorn's own lines (start, stop, one per request) only when debugging: we log
        # the address ourselves, and its errors still show.
        level = self.settings.log_level.lower()
        level = level if level in ("debug", "trace") else "warning"
        config = uvicorn.Config(
            self.api.app,
            host=host,
            port=port,
            lifespan="off",
            log_config=None,
            log_level=level,
            access_log=level != "warning",
        )
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[sock]), name="hicache-http"
        )
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what stopped it
                raise OSError(f"the HTTP server on {host}:{port} stopped while starting")
            await asyncio.sleep(0.01)
        self.port = sock.getsockname()[1]
        log.info("HTTP (OpenAI API) on %s:%d", host, self.port)
        return self.port

    async def stop(self, grace: float = 0.0) -> None:
        """Stops serving. Open requests get `grace` seconds to finish; then their engine
        requests are aborted, so that each still gets an answer (503, or an error event in its
        stream), and what has not answered ABORT_ANSWER_S later is cancelled."""
        if self._server is None or self._task is None:
            return
        running = self.api.running
        deadline = time.monotonic() + grace
        while running and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for run in list(running.values()):
            run.engine.abort(run.rid)
        self._server.config.timeout_graceful_shutdown = ABORT_ANSWER_S
        self._server.should_exit = True
        try:
            await self._task
        except (Exception, SystemExit):  # stopping anyway
            log.exception("the HTTP server failed while stopping")
        self._server = self._task = None
