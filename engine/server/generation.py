"""GenerationService: streaming Generate, Abort, GetModelInfo, GetServerInfo."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from engine.front import StreamChunk
from engine.server import validate
from engine.server.pb import FINISH_TO_ENUM, gen_grpc, gen_pb2, tier_tokens
from engine.server.state import DaemonState, EngineRequest, rpc

VERSION = "0.1.0"


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hicache")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return VERSION


def usage(chunk: StreamChunk) -> gen_pb2.Usage:
    return gen_pb2.Usage(
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        cached_tokens=chunk.cached_tokens,
        cached_tokens_per_tier=tier_tokens(chunk.cached_tokens_per_tier),
    )


def complete(chunk: StreamChunk) -> gen_pb2.GenerateComplete:
    msg = gen_pb2.GenerateComplete(
        finish_reason=FINISH_TO_ENUM.get(
            chunk.finish_reason or "", gen_pb2.FINISH_REASON_UNSPECIFIED
        ),
        usage=usage(chunk),
    )
    stop = chunk.matched_stop
    if isinstance(stop, bool) or stop is None:
        pass
    elif isinstance(stop, int):
        msg.matched_token_id = stop
    else:
        msg.matched_stop_string = str(stop)
    if chunk.finish_reason == "abort" and chunk.error:
        msg.abort_message = chunk.error
    return msg


class GenerationServicer(gen_grpc.GenerationServiceServicer):
    def __init__(self, state: DaemonState):
        self.state = state

    @rpc
    async def Generate(
        self, request: gen_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gen_pb2.GenerateResponse]:
        st = self.state
        engine = await st.require_engine(context)
        prompt = validate.prompt(request.prompt, request.HasField("prompt"), engine.vocab_size)
        params = validate.sampling(request.sampling_params, engine.vocab_size)
        who = st.principal(context)
        ns = who.namespace(validate.namespace(request.cache_namespace))
        rid = (
            validate.request_id(request.request_id)
            if request.request_id
            else f"grpc-{uuid.uuid4().hex[:16]}"
        )
        client_rid, rid = rid, who.request_id(rid)
        if rid in st.active:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {client_rid!r} is already running"
            )
        run = await EngineRequest.start(st, engine, prompt, params, ns, rid)
        try:
            async for chunk in run.chunks():
                if chunk.token_ids or chunk.text:
                    yield gen_pb2.GenerateResponse(
                        request_id=client_rid,
                        chunk=gen_pb2.GenerateChunk(
                            token_ids=chunk.token_ids, text=chunk.text, usage=usage(chunk)
                        ),
                    )
                if chunk.finished:
                    if chunk.finish_reason == "abort" and rid in st.drain_aborted:
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE,
                            "the server is shutting down: the request was aborted",
                        )
                    yield gen_pb2.GenerateResponse(request_id=client_rid, complete=complete(chunk))
        finally:
            run.release()  # client cancel, deadline, or server shutdown: the KV is freed

    @rpc
    async def Abort(
        self, request: gen_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.AbortResponse:
        engine = await self.state.require_engine(context, while_draining=True)
        if not request.request_id:
            raise validate.ValidationError("request_id is required")
        rid = self.state.principal(context).request_id(request.request_id)
        found = self.state.active.get(rid) is not None
        if found:
            engine.abort(rid)
        return gen_pb2.AbortResponse(found=found)

    @rpc
    async def GetModelInfo(
        self, request: gen_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.GetModelInfoResponse:
        engine = await self.state.require_engine(context)
        info = dict(engine.model_info())
        known = {
            k: info.pop(k, None)
            for k in (
                "model_path",
                "architecture",
                "vocab_size",
                "max_context_len",
                "num_layers",
                "dtype",
            )
        }
        return gen_pb2.GetModelInfoResponse(
            model_path=str(known["model_path"] or ""),
            architecture=str(known["architecture"] or ""),
            vocab_size=int(known["vocab_size"] or 0),
            max_context_len=int(known["max_context_len"] or 0),
            num_layers=int(known["num_layers"] or 0),
            dtype=str(known["dtype"] or ""),
            extra={k: json.dumps(v, default=str) for k, v in info.items()},
        )

    @rpc
    async def GetServerInfo(
        self, request: gen_pb2.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> gen_pb2.GetServerInfoResponse:
        st = self.state
        public = st.settings.public_dict()
        who = st.principal(context)
        if who.tenant is not None:  # a tenant sees itself, not who else shares the daemon
            public["tenants"] = [who.tenant.public_dict()]
        config = {f"daemon.{k}": json.dumps(v) for k, v in public.items()}
        features = ["generate", "cache_namespaces"]
        if st.engine is not None:
            args = st.engine.server_args
            config.update({k: json.dumps(v, default=str) for k, v in args.public_dict().items()})
            # NOTE: the tree_factory's rules: no radix cache, no lower tiers; no L2, no L3.
            hier = args.enable_hierarchical_cache and not args.disable_radix_cache
            features += ["radix_cache"] if not args.disable_radix_cache else []
            features += ["hierarchical_cache"] if hier else []
            features += ["l3_storage"] if hier and args.hicache_storage_backend else []
        config["process.api_server"] = json.dumps(os.getpid())
        pids = st.engine.child_pids() if st.engine is not None else {}
        for name, pid in pids.items():
            config[f"process.{name}"] = json.dumps(pid)  # the split daemon's children
        features += ["cache_events"] if st.event_log is not None else []
        features += ["auth"] if st.settings.auth_enabled else []
        features += ["tenants"] if st.settings.tenants else []
        features += ["admin_auth"] if st.settings.admin_token else []
        features += ["tls"] if st.settings.tls_cert else []
        features += ["metrics"] if st.settings.metrics_port else []
        return gen_pb2.GetServerInfoResponse(
            version=_version(),
            features=features,
            uptime_s=time.time() - st.start_time,
            config=config,
            active_requests=len(st.active),
            draining=st.draining,
        )
