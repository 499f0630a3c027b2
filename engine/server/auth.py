"""Bearer-token authentication: an aio ServerInterceptor.

- health checks are always allowed;
- with --token, every other RPC needs `authorization: Bearer <token>` (the admin token works too);
- with --admin-token, CacheAdmin mutations need the admin token: none presented ->
  UNAUTHENTICATED, another token -> PERMISSION_DENIED.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from engine.server.pb import CACHE_ADMIN_SERVICE

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
ADMIN_MUTATIONS = frozenset(
    f"/{CACHE_ADMIN_SERVICE}/{m}" for m in (
        "Prefetch", "Evict", "Pin", "Unpin", "Flush", "AttachStorage", "DetachStorage"
    )
)


def bearer(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = value.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return None


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def check(
    method: str, presented: str | None, token: str | None, admin_token: str | None
) -> tuple[grpc.StatusCode, str] | None:
    """None when allowed, else the status to fail with."""
    if method.startswith(EXEMPT_PREFIXES):
        return None
    if admin_token and method in ADMIN_MUTATIONS:
        if presented is None:
            return grpc.StatusCode.UNAUTHENTICATED, "this RPC needs the admin bearer token"
        if not _same(presented, admin_token):
            return grpc.StatusCode.PERMISSION_DENIED, "this RPC needs the admin token"
        return None
    if not token or _same(presented, token) or _same(presented, admin_token):
        return None
    if presented is None:
        return grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
    return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"


def _denying(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler:
    async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str | None, admin_token: str | None):
        self.token = token or None
        self.admin_token = admin_token or None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        denied = check(
            handler_call_details.method,
            bearer(handler_call_details.invocation_metadata),
            self.token,
            self.admin_token,
        )
        return handler if denied is None else _denying(handler, *denied)
