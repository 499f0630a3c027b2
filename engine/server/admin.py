"""CacheAdminService: cache statistics, side-effect-free matching, prefetch, evict, pin, flush,
tree inspection and the cache event stream. Each handler checks its request here, at the edge,
and asks the engine one operation (engine/operations.py, ``engine.call``; the tree work runs on
the scheduler thread); a prefetch that must compute runs as an engine request, as Generate's do
(``EngineRequest``: the drain waits for it, the metrics count it)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from engine import operations as ops
from engine.admin_records import FlushInfo
from engine.errors import NotIdleError
from engine.front import EngineFront
from engine.server import validate
from engine.server.admin_pb import (
    event_message,
    node_message,
    stats_message,
    storage_info,
    tenant_stats_message,
)
from engine.server.pb import (
    EVENT_TO_ENUM,
    TIER_TO_ENUM,
    admin_grpc,
    admin_pb2,
    common_pb2,
    tier_tokens,
)
from engine.server.settings import ensure_dir
from engine.server.state import DaemonState, EngineRequest, rpc
from hicache.errors import StorageBusyError

DEFAULT_FLUSH_TIMEOUT_S = 10.0
DEFAULT_DETACH_TIMEOUT_S = 30.0
# a prefetch that computes: the prompt's prefill, one greedy token (never returned)
PREFETCH_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}


class CacheAdminServicer(admin_grpc.CacheAdminServiceServicer):
    def __init__(self, state: DaemonState):
        self.state = state

    async def _ids(
        self, engine: EngineFront, prompt: common_pb2.Prompt, present: bool, field: str
    ) -> list[int]:
        p = validate.prompt(prompt, present, engine.vocab_size, field)
        return await self.state.run_input(engine.tokenize, p)

    @rpc
    async def GetCacheStats(
        self, request: admin_pb2.GetCacheStatsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetCacheStatsResponse:
        st = self.state
        engine = await st.require_engine(context)
        stats = await st.run(engine.call, ops.GetCacheStats())
        who = st.principal(context)
        if who.tenant is not None:  # its own namespaces' share only
            namespaces = who.namespaces()
            assert namespaces is not None, "a tenant always has namespaces"
            view = await st.run(engine.call, ops.GetTenantView(who.tenant.name, namespaces))
            return tenant_stats_message(stats, who.tenant, view)
        num_pins, pinned = await st.run(engine.call, ops.PinSummary())
        return stats_message(stats, pinned, num_pins)

    @rpc
    async def MatchPrefix(
        self, request: admin_pb2.MatchPrefixRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.MatchPrefixResponse:
        st = self.state
        engine = await st.require_engine(context)
        ns = st.principal(context).namespace(validate.namespace(request.cache_namespace))
        ids = await self._ids(engine, request.prompt, request.HasField("prompt"), "prompt")
        m = await st.run(engine.call, ops.MatchPrefix(ids, ns))
        return admin_pb2.MatchPrefixResponse(
            prompt_tokens=len(ids),
            matched_tokens=m.matched_tokens,
            matched_per_tier=tier_tokens(m.per_tier),
            page_size=m.page_size,
        )

    @rpc
    async def Prefetch(
        self, request: admin_pb2.PrefetchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PrefetchResponse]:
        st = self.state
        engine = await st.require_engine(context)
        who = st.principal(context)
        ns = who.namespace(validate.namespace(request.cache_namespace))
        ttl = validate.seconds(request.pin_ttl_s, "pin_ttl_s")
        ids = await self._ids(engine, request.prompt, request.HasField("prompt"), "prompt")
        t0 = time.monotonic()

        def resp(
            stage: admin_pb2.PrefetchStage, per_tier: dict[str, int], **kw: Any
        ) -> admin_pb2.PrefetchResponse:
            return admin_pb2.PrefetchResponse(
                stage=stage,
                prompt_tokens=len(ids),
                cached_per_tier=tier_tokens(per_tier),
                elapsed_s=time.monotonic() - t0,
                **kw,
            )

        m = await st.run(engine.call, ops.MatchPrefix(ids, ns))
        yield resp(admin_pb2.PREFETCH_STAGE_MATCHED, m.per_tier)
        computed = 0
        # The scheduler always computes the last prompt token, so only len-1 can be a device hit.
        if m.per_tier["l1"] < (len(ids) - 1) // m.page_size * m.page_size:
            rid = who.request_id(f"prefetch-{uuid.uuid4().hex[:16]}")
            run = await EngineRequest.start(st, engine, ids, PREFETCH_PARAMS, ns, rid)
            try:  # NOTE: from here a cancel (even at the next yield) aborts the request
                yield resp(admin_pb2.PREFETCH_STAGE_RUNNING, m.per_tier)
                async for chunk in run.chunks():
                    if chunk.finished and chunk.finish_reason == "abort":
                        if rid in st.drain_aborted:
                            await context.abort(
                                grpc.StatusCode.UNAVAILABLE,
                                "the server is shutting down: the prefetch was aborted",
                            )
                        await context.abort(
                            grpc.StatusCode.ABORTED, f"prefetch aborted: {chunk.error or ''}"
                        )
                    if chunk.finished:
                        computed = chunk.prompt_tokens - chunk.cached_tokens
            finally:
                run.release()  # client cancel, deadline, or server shutdown: the KV is freed
        pin_id = ""
        if request.pin:
            p = await st.run(engine.call, ops.PinPrefix(ids, ns, ttl, who.name))
            pin_id = p.pin_id if p is not None else ""
        m = await st.run(engine.call, ops.MatchPrefix(ids, ns))
        yield resp(
            admin_pb2.PREFETCH_STAGE_DONE, m.per_tier, computed_tokens=computed, pin_id=pin_id
        )

    @rpc
    async def Evict(
        self, request: admin_pb2.EvictRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.EvictResponse:
        st = self.state
        engine = await st.require_engine(context)
        tier = validate.tier(request.tier)
        who = st.principal(context)
        ns = who.namespace(validate.namespace(request.cache_namespace))
        target = request.WhichOneof("target")
        num_tokens, prefix = None, None
        if target is None:
            raise validate.ValidationError("target is required (one of num_tokens, prefix, all)")
        if target == "num_tokens":
            if request.num_tokens < 1:
                raise validate.ValidationError("num_tokens must be >= 1")
            num_tokens = request.num_tokens
        elif target == "prefix":
            prefix = await self._ids(engine, request.prefix, True, "prefix")
        elif not request.all:
            raise validate.ValidationError("all must be true when it is the target")
        namespaces = who.namespaces() if prefix is None else None
        op = ops.Evict(tier, num_tokens, prefix, ns, request.dry_run, namespaces)
        info = await st.run(engine.call, op)
        if st.metrics is not None and not request.dry_run:
            st.metrics.admin_evicted(tier, info.evicted_tokens)
        return admin_pb2.EvictResponse(
            tier=TIER_TO_ENUM[tier],
            evicted_tokens=info.evicted_tokens,
            evicted_nodes=info.evicted_nodes,
            dry_run=request.dry_run,
        )

    @rpc
    async def Pin(
        self, request: admin_pb2.PinRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.PinResponse:
        st = self.state
        engine = await st.require_engine(context)
        who = st.principal(context)
        ns = who.namespace(validate.namespace(request.cache_namespace))
        ttl = validate.seconds(request.ttl_s, "ttl_s")
        ids = await self._ids(engine, request.prompt, request.HasField("prompt"), "prompt")
        p = await st.run(engine.call, ops.PinPrefix(ids, ns, ttl, who.name))
        if p is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "nothing of this prompt is cached on L1; Prefetch it first",
            )
        return admin_pb2.PinResponse(pin_id=p.pin_id, pinned_tokens=p.tokens, expires_in_s=ttl)

    @rpc
    async def Unpin(
        self, request: admin_pb2.UnpinRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.UnpinResponse:
        st = self.state
        engine = await st.require_engine(context)
        target = request.WhichOneof("target")
        if (
            target is None
            or (target == "all" and not request.all)
            or (target == "pin_id" and not request.pin_id)
        ):
            raise validate.ValidationError("target is required (a pin_id, or all=true)")
        pin_id = request.pin_id if target == "pin_id" else None
        owner = st.principal(context).name
        n, tokens = await st.run(engine.call, ops.Unpin(pin_id, owner))
        if pin_id is not None and n == 0:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no pin {validate.shown(pin_id)} (expired?)"
            )
        return admin_pb2.UnpinResponse(unpinned=n, unpinned_tokens=tokens)

    @rpc
    async def Flush(
        self, request: admin_pb2.FlushRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.FlushResponse:
        st = self.state
        engine = await st.require_engine(context)
        tiers = sorted({validate.tier(t, "tiers", default=None) for t in request.tiers})
        timeout = (
            validate.seconds(request.timeout_s, "timeout_s", 3600.0)
            if request.HasField("timeout_s")
            else DEFAULT_FLUSH_TIMEOUT_S
        )
        who = st.principal(context)
        namespaces = who.namespaces()
        op: ops.Operation[FlushInfo]
        if namespaces is not None:  # a tenant's only; others' requests may run meanwhile
            op = ops.FlushNamespaces(namespaces, tiers or None, who.name)
        else:
            op = ops.Flush(tiers or None)

        remaining = context.time_remaining()
        deadline = time.monotonic() + min(timeout, remaining if remaining is not None else timeout)
        while True:
            try:
                info = await st.run(engine.call, op)
                break
            except (NotIdleError, StorageBusyError) as e:
                if time.monotonic() >= deadline:
                    why = (
                        f"the engine is not idle ({len(st.active)} streams running)"
                        if isinstance(e, NotIdleError)
                        else "L3 backups / prefetches are still in flight"
                    )
                    await context.abort(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        f"{why} after {timeout:g}s; nothing was flushed",
                    )
                await asyncio.sleep(0.05)
        return admin_pb2.FlushResponse(
            flushed=[TIER_TO_ENUM[t] for t in info.flushed],
            freed_tokens=info.freed_tokens,
            unpinned=info.unpinned,
        )

    @rpc
    async def InspectTree(
        self, request: admin_pb2.InspectTreeRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.InspectTreeResponse:
        st = self.state
        engine = await st.require_engine(context)
        limit = request.page_size or 100
        preview = request.preview_tokens or 16
        if limit > 1000:
            raise validate.ValidationError(f"page_size must be <= 1000, got {limit}")
        if preview > 256:
            raise validate.ValidationError(f"preview_tokens must be <= 256, got {preview}")
        token = request.page_token
        if token and not token.isdigit():
            raise validate.ValidationError(
                f"page_token {token[:40]!r} is not a token this server returned"
            )
        offset = int(token or 0)
        namespaces = st.principal(context).namespaces()
        nodes, total = await st.run(
            engine.call, ops.InspectTree(offset, limit, preview, namespaces)
        )
        texts = await st.run(lambda: [engine.tokenizer.decode(n.preview_ids) for n in nodes])
        out = [node_message(n, text) for n, text in zip(nodes, texts)]
        nxt = str(offset + len(nodes)) if offset + len(nodes) < total else ""
        return admin_pb2.InspectTreeResponse(nodes=out, next_page_token=nxt, total_nodes=total)

    @rpc
    async def WatchCacheEvents(
        self, request: admin_pb2.WatchCacheEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.WatchCacheEventsResponse]:
        st = self.state
        await st.require_engine(context)
        kinds = set(request.kinds)
        if kinds - set(EVENT_TO_ENUM.values()):
            raise validate.ValidationError(f"kinds has unknown values {sorted(kinds)}")
        tiers = {validate.tier(t, "tiers", default=None) for t in request.tiers}
        namespaces = st.principal(context).namespaces()  # a tenant sees its own events only
        evlog = st.event_log
        if evlog is None:
            await context.abort(
                grpc.StatusCode.UNIMPLEMENTED, "this engine's cache does not record events"
            )
        seq = request.after_seq if request.HasField("after_seq") else evlog.last_seq
        while not st.draining:
            missed = evlog.missed(seq)
            events = evlog.since(seq, limit=1024)
            if not events:
                await st.run(evlog.wait_for, seq, 0.5)
                continue
            for ev in events:
                seq = ev.seq
                if (
                    (kinds and EVENT_TO_ENUM[ev.kind] not in kinds)
                    or (tiers and ev.tier not in tiers)
                    or (namespaces is not None and ev.namespace not in namespaces)
                ):
                    continue
                yield admin_pb2.WatchCacheEventsResponse(missed=missed, event=event_message(ev))
                missed = 0

    @rpc
    async def GetStorage(
        self, request: admin_pb2.GetStorageRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.GetStorageResponse:
        engine = await self.state.require_engine(context)
        return admin_pb2.GetStorageResponse(
            storage=storage_info(await self.state.run(engine.call, ops.GetStorageInfo()))
        )

    @rpc
    async def AttachStorage(
        self, request: admin_pb2.AttachStorageRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.AttachStorageResponse:
        st = self.state
        engine = await st.require_engine(context)
        backend = request.backend
        if backend == "redis":
            if not request.url:
                raise validate.ValidationError("url is required with backend 'redis'")
            if request.directory:
                raise validate.ValidationError("directory is for backend 'file'")
        elif backend == "file":
            if request.url:
                raise validate.ValidationError("url is for backend 'redis'")
        else:
            raise validate.ValidationError(
                f"backend must be 'file' or 'redis', got {validate.shown(backend)}"
            )
        directory = None
        if backend == "file":
            directory = await st.run_input(
                ensure_dir, request.directory or engine.server_args.hicache_storage_dir or ""
            )
        op = ops.AttachStorage(backend, request.url or None, directory)
        info = await st.run_input(engine.call, op)
        return admin_pb2.AttachStorageResponse(storage=storage_info(info))

    @rpc
    async def DetachStorage(
        self, request: admin_pb2.DetachStorageRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.DetachStorageResponse:
        engine = await self.state.require_engine(context)
        timeout = (
            validate.seconds(request.timeout_s, "timeout_s", 3600.0)
            if request.HasField("timeout_s")
            else DEFAULT_DETACH_TIMEOUT_S
        )
        before = await self.state.run_input(engine.call, ops.DetachStorage(timeout))
        return admin_pb2.DetachStorageResponse(detached=storage_info(before))
