"""The OpenAI HTTP edge's plumbing: errors in OpenAI's shape with their HTTP status, the gRPC
auth rules read from an `Authorization` header, and one engine request's lifecycle (claimed in
DaemonState.active, counted in the metrics, aborted unless it finished), streamed or not."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.errors import EngineShutdownError, QueueFullError
from engine.front import EngineFront, StreamChunk
from engine.server import openai_protocol as proto
from engine.server.auth import bearer, check, tenant_of
from engine.server.pb import GENERATION_SERVICE
from engine.server.state import DaemonState
from engine.server.tenants import PermissionDeniedError, Principal
from engine.server.validate import ValidationError

log = logging.getLogger(__name__)

GENERATE_METHOD = f"/{GENERATION_SERVICE}/Generate"  # HTTP calls follow Generate's auth rules

# First match wins: (exception type, HTTP status, OpenAI error type, code).
_STATUS: list[tuple[type[BaseException], int, str, str | None]] = [
    (ValidationError, 400, "invalid_request_error", None),
    (PermissionDeniedError, 403, "permission_error", None),
    (QueueFullError, 429, "rate_limit_error", "queue_full"),
    (EngineShutdownError, 503, "server_error", "unavailable"),
]


class HttpError(Exception):
    """An error answered as-is: HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.type_, self.param, self.code = status, type_, param, code


def error_response(exc: BaseException) -> JSONResponse:
    """Any exception as OpenAI's `{"error": {message, type, param, code}}` with its status."""
    if isinstance(exc, HttpError):
        status, body = exc.status, proto.error_body(str(exc), exc.type_, exc.param, exc.code)
    elif isinstance(exc, proto.InvalidRequestError):
        status, body = 400, proto.error_body(str(exc), "invalid_request_error", exc.param)
    else:
        for typ, status, type_, code in _STATUS:
            if isinstance(exc, typ):
                body = proto.error_body(str(exc) or typ.__name__, type_, None, code)
                break
        else:
            log.exception("internal error in an HTTP handler", exc_info=exc)
            status = 500
            body = proto.error_body(
                f"internal error: {type(exc).__name__}: {exc}",
                "server_error",
                None,
                "internal_error",
            )
    return JSONResponse(body, status_code=status)


def unavailable(message: str, code: str) -> HttpError:
    return HttpError(503, "server_error", message, code=code)


def authorize(headers: Headers, state: DaemonState) -> Principal:
    """Who calls, from `Authorization: Bearer <key>`, by the rules the gRPC AuthInterceptor
    applies to Generate: with a token, an admin token or tenants set, a missing or unknown key
    is 401; a tenant's key makes the call that tenant's."""
    presented = bearer(headers.items())
    s = state.settings
    if s.auth_enabled:
        denied = check(GENERATE_METHOD, presented, s.token, s.admin_token, state.tenants)
        if denied is not None:
            code, message = denied
            if code != grpc.StatusCode.UNAUTHENTICATED:
                raise HttpError(403, "permission_error", message)
            if presented is None:
                message = "missing 'Authorization: Bearer <key>' header"
            raise HttpError(401, "authentication_error", message, code="invalid_api_key")
    if not state.tenants.tenants:
        return Principal()
    return Principal(tenant_of(presented, state.tenants))


def require_engine(state: DaemonState) -> EngineFront:
    if state.draining:
        raise unavailable("the server is shutting down", "draining")
    if not state.ready or state.engine is None:
        raise unavailable("the model is still loading", "loading")
    return state.engine


async def read_json(request: Request, limit: int) -> Any:
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise HttpError(
                413, "invalid_request_error", f"the request body is larger than {limit} bytes"
            )
    try:
        return json.loads(bytes(body))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise proto.InvalidRequestError(f"the request body is not valid JSON: {e}") from None


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that releases its engine request however the response ends: done, the
    client gone (Starlette cancels the body), or the server stopping."""

    def __init__(self, body: AsyncIterator[str], release: Callable[[], None]):
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def until_disconnected(receive: Receive) -> None:
    # NOTE: the body has been read: receive() now blocks until the client goes away.
    while (await receive())["type"] != "http.disconnect":
        pass


def aborted(chunk: StreamChunk, state: DaemonState) -> HttpError:
    """The error for a request the engine ended with `abort` (another client's Abort, an engine
    failure, or the server stopping)."""
    if state.draining:
        return unavailable("the server is shutting down: the request was aborted", "draining")
    message = f"the request was aborted: {chunk.error or 'no reason given'}"
    return HttpError(500, "server_error", message, code="request_aborted")
