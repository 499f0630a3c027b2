"""Bearer-token authentication: an aio ServerInterceptor.

- health checks are always allowed;
- with --token, every other RPC needs `authorization: Bearer <token>` (the admin token works too);
- with tenants, a tenant's token works too, and no token at all is refused (even without
  --token): handlers confine a tenant's calls to its namespaces (engine/server/tenants.py);
- with --admin-token, CacheAdmin mutations need the admin token: none presented ->
  UNAUTHENTICATED, another token -> PERMISSION_DENIED. A tenant's token may make the mutations
  that act on its own cache (TENANT_MUTATIONS), never the ones on the daemon (storage).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from engine.server.pb import CACHE_ADMIN_SERVICE, SGLANG_SERVICE
from engine.server.tenants import Tenant, TenantTable

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# NOTE: SMG's worker HealthCheck is a probe like grpc.health's: it says only healthy or not
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", f"/{SGLANG_SERVICE}/HealthCheck")
ADMIN_MUTATIONS = frozenset(
    [
        f"/{CACHE_ADMIN_SERVICE}/{m}"
        for m in ("Prefetch", "Evict", "Pin", "Unpin", "Flush", "AttachStorage", "DetachStorage")
    ]
    + [f"/{SGLANG_SERVICE}/FlushCache"]
)
TENANT_MUTATIONS = frozenset(
    [f"/{CACHE_ADMIN_SERVICE}/{m}" for m in ("Prefetch", "Evict", "Pin", "Unpin", "Flush")]
    + [f"/{SGLANG_SERVICE}/FlushCache"]
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


def tenant_of(presented: str | None, tenants: TenantTable | None) -> Tenant | None:
    if presented is None or tenants is None:
        return None
    for tok, tenant in tenants.by_token.items():
        if _same(presented, tok):
            return tenant
    return None


def check(
    method: str,
    presented: str | None,
    token: str | None,
    admin_token: str | None,
    tenants: TenantTable | None = None,
) -> tuple[grpc.StatusCode, str] | None:
    """None when allowed, else the status to fail with."""
    if method.startswith(EXEMPT_PREFIXES):
        return None
    tenant = tenant_of(presented, tenants)
    if tenant is not None:
        if method in ADMIN_MUTATIONS and method not in TENANT_MUTATIONS:
            return grpc.StatusCode.PERMISSION_DENIED, "this RPC needs the admin token"
        return None
    # NOTE: with tenants every caller must say who it is: an unknown token is never let in
    with_tenants = bool(tenants and tenants.tenants)
    known = _same(presented, token) or _same(presented, admin_token)
    if admin_token and method in ADMIN_MUTATIONS and (known or not with_tenants):
        if presented is None:
            return grpc.StatusCode.UNAUTHENTICATED, "this RPC needs the admin bearer token"
        if not _same(presented, admin_token):
            return grpc.StatusCode.PERMISSION_DENIED, "this RPC needs the admin token"
        return None
    if known or (not token and not with_tenants):
        return None
    if presented is None:
        return grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
    return grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token"


def _denying(
    handler: grpc.RpcMethodHandler[Req, Resp], code: grpc.StatusCode, details: str
) -> grpc.RpcMethodHandler[Req, Resp]:
    async def deny(request: Any, context: grpc.aio.ServicerContext[Req, Resp]) -> None:
        await context.abort(code, details)

    decode, serialize = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, decode, serialize)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, decode, serialize)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, decode, serialize)
    return grpc.unary_unary_rpc_method_handler(deny, decode, serialize)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self, token: str | None, admin_token: str | None, tenants: TenantTable | None = None
    ):
        self.token = token or None
        self.admin_token = admin_token or None
        self.tenants = tenants

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        denied = check(
            handler_call_details.method,
            bearer(handler_call_details.invocation_metadata),
            self.token,
            self.admin_token,
            self.tenants,
        )
        return handler if denied is None else _denying(handler, *denied)
