"""Python clients for the hicache daemon: `HicacheClient` (blocking) and `AsyncHicacheClient`
(asyncio). Both return the protobuf messages of hicache.v1; failures raise grpc.RpcError.

    with HicacheClient("127.0.0.1:50051") as c:
        for r in c.generate("Hello", max_new_tokens=16, temperature=0):
            print(r.chunk.text, end="")
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.client.requests import (
    PromptLike,
    detach_request,
    evict_request,
    flush_request,
    generate_request,
    make_prompt,
    unpin_request,
    watch_request,
)
from engine.server.pb import admin_grpc, admin_pb2, gen_grpc, gen_pb2


def _credentials(
    tls: bool, ca_cert: str | None, client_cert: str | None, client_key: str | None
) -> grpc.ChannelCredentials | None:
    """TLS when asked for or implied by a file (ca_cert: PEM roots, else the system's;
    client_cert + client_key: PEM pair for a daemon that requires client certificates, mTLS).
    Raises ValueError for half a pair, OSError for a file that cannot be read."""
    if bool(client_cert) != bool(client_key):
        raise ValueError("client_cert and client_key go together")
    if not (tls or ca_cert or client_cert):
        return None

    def pem(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(pem(ca_cert), pem(client_key), pem(client_cert))


_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * 2**20),
    ("grpc.max_send_message_length", 64 * 2**20),
]


class _Base:
    def __init__(self, addr: str, token: str | None, admin_token: str | None) -> None:
        self.addr = addr
        self._md = (("authorization", f"Bearer {token}"),) if token else ()
        admin = admin_token or token
        self._admin_md = (("authorization", f"Bearer {admin}"),) if admin else ()

    def _stubs(self, channel: Any) -> None:
        self.channel = channel
        self.gen = gen_grpc.GenerationServiceStub(channel)
        self.admin = admin_grpc.CacheAdminServiceStub(channel)
        self.health_stub = health_pb2_grpc.HealthStub(channel)


class HicacheClient(_Base):
    """Blocking client. `timeout` (seconds) applies to unary calls. TLS: `tls=True` (system
    roots) or `ca_cert`; mTLS: `client_cert` + `client_key` as well (each implies TLS)."""

    def __init__(
        self,
        addr: str = "127.0.0.1:50051",
        token: str | None = None,
        admin_token: str | None = None,
        tls: bool = False,
        ca_cert: str | None = None,
        timeout: float | None = 60.0,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        super().__init__(addr, token, admin_token)
        creds = _credentials(tls, ca_cert, client_cert, client_key)
        self.timeout = timeout
        self._stubs(
            grpc.secure_channel(addr, creds, _OPTIONS)
            if creds
            else grpc.insecure_channel(addr, _OPTIONS)
        )

    def __enter__(self) -> HicacheClient:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def _u(self, fn: Any, req: Any, admin: bool = False, timeout: float | None = None) -> Any:
        return fn(
            req,
            metadata=self._admin_md if admin else self._md,
            timeout=timeout if timeout is not None else self.timeout,
        )

    # --- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptLike,
        *,
        chat: bool = False,
        namespace: str = "",
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> Iterator[gen_pb2.GenerateResponse]:
        req = generate_request(prompt, chat, namespace, request_id, **sampling)
        return self.gen.Generate(req, metadata=self._md, timeout=timeout)

    def generate_text(
        self, prompt: PromptLike, **kw: Any
    ) -> tuple[str, list[int], gen_pb2.GenerateComplete]:
        text, ids, done = "", [], gen_pb2.GenerateComplete()
        for r in self.generate(prompt, **kw):
            if r.HasField("chunk"):
                text += r.chunk.text
                ids += list(r.chunk.token_ids)
            else:
                done = r.complete
        return text, ids, done

    def abort(self, request_id: str) -> gen_pb2.AbortResponse:
        return self._u(self.gen.Abort, gen_pb2.AbortRequest(request_id=request_id))

    def model_info(self) -> gen_pb2.GetModelInfoResponse:
        return self._u(self.gen.GetModelInfo, gen_pb2.GetModelInfoRequest())

    def server_info(self) -> gen_pb2.GetServerInfoResponse:
        return self._u(self.gen.GetServerInfo, gen_pb2.GetServerInfoRequest())

    # --- cache admin -------------------------------------------------------------------------
    def cache_stats(self) -> admin_pb2.GetCacheStatsResponse:
        return self._u(self.admin.GetCacheStats, admin_pb2.GetCacheStatsRequest())

    def match_prefix(
        self, prompt: PromptLike, chat: bool = False, namespace: str = ""
    ) -> admin_pb2.MatchPrefixResponse:
        return self._u(
            self.admin.MatchPrefix,
            admin_pb2.MatchPrefixRequest(
                prompt=make_prompt(prompt, chat), cache_namespace=namespace
            ),
        )

    def prefetch(
        self,
        prompt: PromptLike,
        chat: bool = False,
        namespace: str = "",
        pin: bool = False,
        pin_ttl_s: float = 0.0,
        timeout: float | None = None,
    ) -> Iterator[admin_pb2.PrefetchResponse]:
        req = admin_pb2.PrefetchRequest(
            prompt=make_prompt(prompt, chat),
            cache_namespace=namespace,
            pin=pin,
            pin_ttl_s=pin_ttl_s,
        )
        return self.admin.Prefetch(req, metadata=self._admin_md, timeout=timeout)

    def evict(self, tier: str = "l1", **kw: Any) -> admin_pb2.EvictResponse:
        return self._u(self.admin.Evict, evict_request(tier, **kw), admin=True)

    def pin(
        self, prompt: PromptLike, ttl_s: float = 0.0, chat: bool = False, namespace: str = ""
    ) -> admin_pb2.PinResponse:
        return self._u(
            self.admin.Pin,
            admin_pb2.PinRequest(
                prompt=make_prompt(prompt, chat), cache_namespace=namespace, ttl_s=ttl_s
            ),
            admin=True,
        )

    def unpin(self, pin_id: str | None = None) -> admin_pb2.UnpinResponse:
        return self._u(self.admin.Unpin, unpin_request(pin_id), admin=True)

    def flush(
        self, tiers: list[str] | None = None, timeout_s: float | None = None
    ) -> admin_pb2.FlushResponse:
        rpc_timeout = None if self.timeout is None else max(self.timeout, (timeout_s or 10) + 5)
        return self._u(
            self.admin.Flush, flush_request(tiers, timeout_s), admin=True, timeout=rpc_timeout
        )

    def storage(self) -> admin_pb2.StorageInfo:
        """The daemon's L3 backend (attached, backend, address, ...)."""
        return self._u(self.admin.GetStorage, admin_pb2.GetStorageRequest()).storage

    def attach_storage(
        self, backend: str, url: str = "", directory: str = ""
    ) -> admin_pb2.StorageInfo:
        """Attach an L3 backend to the running daemon ("redis" with a url, or "file")."""
        return self._u(
            self.admin.AttachStorage,
            admin_pb2.AttachStorageRequest(backend=backend, url=url, directory=directory),
            admin=True,
        ).storage

    def detach_storage(self, timeout_s: float | None = None) -> admin_pb2.StorageInfo:
        """Detach L3 once its in-flight work finished (at most timeout_s, default 30)."""
        rpc_timeout = None if self.timeout is None else max(self.timeout, (timeout_s or 30) + 5)
        return self._u(
            self.admin.DetachStorage, detach_request(timeout_s), admin=True, timeout=rpc_timeout
        ).detached

    def inspect_tree(
        self, page_size: int = 100, page_token: str = "", preview_tokens: int = 16
    ) -> admin_pb2.InspectTreeResponse:
        return self._u(
            self.admin.InspectTree,
            admin_pb2.InspectTreeRequest(
                page_size=page_size, page_token=page_token, preview_tokens=preview_tokens
            ),
        )

    def iter_tree(
        self, page_size: int = 500, preview_tokens: int = 16
    ) -> Iterator[admin_pb2.TreeNodeInfo]:
        token = ""
        while True:
            page = self.inspect_tree(page_size, token, preview_tokens)
            yield from page.nodes
            token = page.next_page_token
            if not token:
                return

    def watch_events(
        self,
        after_seq: int | None = None,
        kinds: list[str] | None = None,
        tiers: list[str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[admin_pb2.WatchCacheEventsResponse]:
        return self.admin.WatchCacheEvents(
            watch_request(after_seq, kinds, tiers), metadata=self._md, timeout=timeout
        )

    def health(self, service: str = "", timeout: float | None = 5.0) -> str:
        # the grpcio-health-checking stubs declare no HealthStub methods (grpc adds them at run time)
        r = self.health_stub.Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=service), timeout=timeout
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


class AsyncHicacheClient(_Base):
    """asyncio client (grpc.aio); the same methods as HicacheClient, awaitable."""

    def __init__(
        self,
        addr: str = "127.0.0.1:50051",
        token: str | None = None,
        admin_token: str | None = None,
        tls: bool = False,
        ca_cert: str | None = None,
        timeout: float | None = 60.0,
        client_cert: str | None = None,
        client_key: str | None = None,
    ) -> None:
        super().__init__(addr, token, admin_token)
        creds = _credentials(tls, ca_cert, client_cert, client_key)
        self.timeout = timeout
        self._stubs(
            grpc.aio.secure_channel(addr, creds, _OPTIONS)
            if creds
            else grpc.aio.insecure_channel(addr, _OPTIONS)
        )

    async def __aenter__(self) -> AsyncHicacheClient:  # noqa: PYI034
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def _u(self, fn: Any, req: Any, admin: bool = False) -> Any:
        return await fn(req, metadata=self._admin_md if admin else self._md, timeout=self.timeout)

    def generate(
        self,
        prompt: PromptLike,
        *,
        chat: bool = False,
        namespace: str = "",
        request_id: str = "",
        timeout: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[gen_pb2.GenerateResponse]:
        req = generate_request(prompt, chat, namespace, request_id, **sampling)
        return self.gen.Generate(req, metadata=self._md, timeout=timeout)

    async def abort(self, request_id: str) -> gen_pb2.AbortResponse:
        return await self._u(self.gen.Abort, gen_pb2.AbortRequest(request_id=request_id))

    async def model_info(self) -> gen_pb2.GetModelInfoResponse:
        return await self._u(self.gen.GetModelInfo, gen_pb2.GetModelInfoRequest())

    async def server_info(self) -> gen_pb2.GetServerInfoResponse:
        return await self._u(self.gen.GetServerInfo, gen_pb2.GetServerInfoRequest())

    async def cache_stats(self) -> admin_pb2.GetCacheStatsResponse:
        return await self._u(self.admin.GetCacheStats, admin_pb2.GetCacheStatsRequest())

    async def match_prefix(
        self, prompt: PromptLike, chat: bool = False, namespace: str = ""
    ) -> admin_pb2.MatchPrefixResponse:
        return await self._u(
            self.admin.MatchPrefix,
            admin_pb2.MatchPrefixRequest(
                prompt=make_prompt(prompt, chat), cache_namespace=namespace
            ),
        )

    def prefetch(
        self,
        prompt: PromptLike,
        chat: bool = False,
        namespace: str = "",
        pin: bool = False,
        pin_ttl_s: float = 0.0,
    ) -> AsyncIterator[admin_pb2.PrefetchResponse]:
        req = admin_pb2.PrefetchRequest(
            prompt=make_prompt(prompt, chat),
            cache_namespace=namespace,
            pin=pin,
            pin_ttl_s=pin_ttl_s,
        )
        return self.admin.Prefetch(req, metadata=self._admin_md)

    async def evict(self, tier: str = "l1", **kw: Any) -> admin_pb2.EvictResponse:
        return await self._u(self.admin.Evict, evict_request(tier, **kw), admin=True)

    async def pin(
        self, prompt: PromptLike, ttl_s: float = 0.0, chat: bool = False, namespace: str = ""
    ) -> admin_pb2.PinResponse:
        return await self._u(
            self.admin.Pin,
            admin_pb2.PinRequest(
                prompt=make_prompt(prompt, chat), cache_namespace=namespace, ttl_s=ttl_s
            ),
            admin=True,
        )

    async def unpin(self, pin_id: str | None = None) -> admin_pb2.UnpinResponse:
        return await self._u(self.admin.Unpin, unpin_request(pin_id), admin=True)

    async def flush(
        self, tiers: list[str] | None = None, timeout_s: float | None = None
    ) -> admin_pb2.FlushResponse:
        return await self._u(self.admin.Flush, flush_request(tiers, timeout_s), admin=True)

    async def storage(self) -> admin_pb2.StorageInfo:
        return (await self._u(self.admin.GetStorage, admin_pb2.GetStorageRequest())).storage

    async def attach_storage(
        self, backend: str, url: str = "", directory: str = ""
    ) -> admin_pb2.StorageInfo:
        r = await self._u(
            self.admin.AttachStorage,
            admin_pb2.AttachStorageRequest(backend=backend, url=url, directory=directory),
            admin=True,
        )
        return r.storage

    async def detach_storage(self, timeout_s: float | None = None) -> admin_pb2.StorageInfo:
        r = await self._u(self.admin.DetachStorage, detach_request(timeout_s), admin=True)
        return r.detached

    async def inspect_tree(
        self, page_size: int = 100, page_token: str = "", preview_tokens: int = 16
    ) -> admin_pb2.InspectTreeResponse:
        return await self._u(
            self.admin.InspectTree,
            admin_pb2.InspectTreeRequest(
                page_size=page_size, page_token=page_token, preview_tokens=preview_tokens
            ),
        )

    def watch_events(
        self,
        after_seq: int | None = None,
        kinds: list[str] | None = None,
        tiers: list[str] | None = None,
    ) -> AsyncIterator[admin_pb2.WatchCacheEventsResponse]:
        return self.admin.WatchCacheEvents(
            watch_request(after_seq, kinds, tiers), metadata=self._md
        )

    async def health(self, service: str = "") -> str:
        # the grpcio-health-checking stubs declare no HealthStub methods (grpc adds them at run time)
        r = await self.health_stub.Check(  # type: ignore[attr-defined]
            health_pb2.HealthCheckRequest(service=service), timeout=5.0
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
