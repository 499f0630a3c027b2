"""A request that does not decode (bad UTF-8 in a string field, garbage bytes, a truncated
message) is the client's error: INVALID_ARGUMENT, not the UNKNOWN grpc gives when a
deserializer raises.

The interceptor wraps every handler's deserializer so that it returns an `Undecodable` marker
instead of raising, and the handler's behaviour so that the marker aborts the call.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple, TypeVar, cast

import grpc

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Undecodable(NamedTuple):
    error: str


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - any decode failure is the client's input
            return Undecodable(str(e) or type(e).__name__)

    return decode


async def _reject(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request message cannot be decoded: {request.error}"
    )


def _guard_unary(behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """`behavior`: a coroutine function, or a plain one (the grpc stubs' type for it)."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await _reject(request, context)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return unary


def _guard_stream(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if not inspect.isasyncgenfunction(behavior):
        # a coroutine that streams with context.write() (grpc's own health Watch)
        return _guard_unary(behavior)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Undecodable):
            await _reject(request, context)
        async for item in behavior(request, context):
            yield item

    return stream


def guarded(handler: grpc.RpcMethodHandler[Req, Resp]) -> grpc.RpcMethodHandler[Req, Resp]:
    """The same handler with undecodable requests answered INVALID_ARGUMENT. Only the
    unary-request shapes are wrapped (no RPC of ours streams requests)."""
    if handler.request_streaming:
        return handler
    decode = _safe(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.response_streaming:
        assert handler.unary_stream is not None, "grpc sets the behaviour of its shape"
        wrapped = grpc.unary_stream_rpc_method_handler(
            _guard_stream(handler.unary_stream), decode, serialize
        )
    else:
        assert handler.unary_unary is not None, "grpc sets the behaviour of its shape"
        wrapped = grpc.unary_unary_rpc_method_handler(
            _guard_unary(handler.unary_unary), decode, serialize
        )
    # NOTE: the deserializer may now give an Undecodable, which the guard answers before the
    # handler's behaviour runs: the behaviour still sees only `Req`s
    return cast("grpc.RpcMethodHandler[Req, Resp]", wrapped)


class DecodeGuard(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Req, Resp] | None]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = await continuation(handler_call_details)
        return handler if handler is None else guarded(handler)
