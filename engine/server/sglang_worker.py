"""SMG's gRPC worker protocol: `sglang.grpc.scheduler.SglangScheduler` (vendored from
smg-grpc-proto, protos/smg/) on the daemon's gRPC port, beside `hicache.v1`.

The gateway (`smg launch --worker-urls grpc://host:port`) tokenizes and applies the chat
template itself, with the tokenizer it fetched through GetTokenizer, sends token ids to
Generate, detokenizes the ids streamed back and polls GetLoads. The same auth interceptor and
tenant rules as hicache.v1 apply: a tenant's key confines Generate to its own cache namespace.

SubscribeKvEvents streams the cache's blocks per tier (engine/server/kv_events.py) to a
cache-aware gateway; it needs the user or admin token, never a tenant's (the blocks carry every
namespace's token ids).

What the daemon cannot do is refused with INVALID_ARGUMENT naming the field (logprobs,
multimodal input, constraints, penalties, n > 1, LoRA); Embed, profiling and LoRA loading are
UNIMPLEMENTED (the generated base class).
"""

from __future__ import annotations

import hashlib
import io
import tempfile
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from engine.server import validate
from engine.server.admin import CacheAdminServicer
from engine.server.gen.smg import common_pb2 as smg_common
from engine.server.gen.smg import sglang_scheduler_pb2 as pb
from engine.server.gen.smg import sglang_scheduler_pb2_grpc as pb_grpc
from engine.server.kv_events import (
    Cleared,
    EventBatch,
    KvEventPublisher,
    OutOfRangeError,
    Removed,
    Stored,
)
from engine.server.loads import (
    UnknownSectionError,
    daemon_version,
    loads_report,
    parse_include,
)
from engine.server.openai_api import model_ids
from engine.server.pb import admin_pb2
from engine.server.state import DaemonState, EngineRequest, rpc
from engine.server.validate import ValidationError

TOKENIZER_CHUNK_BYTES = 1 << 20
VERSION = daemon_version()
# our tiers as SMG's (and, for `medium`, vLLM's words for the device and host tiers, SGLang's
# for L3's); a shared server's objects are a pool every daemon on it reads: remote
KV_TIER = {
    "l1": smg_common.KV_CACHE_TIER_DEVICE,
    "l2": smg_common.KV_CACHE_TIER_HOST,
    "disk": smg_common.KV_CACHE_TIER_DISK,
    "external": smg_common.KV_CACHE_TIER_EXTERNAL,
}
KV_MEDIUM = {"l1": "GPU", "l2": "CPU", "disk": "DISK", "external": "EXTERNAL"}
KV_LEVEL = {"l1": 0, "l2": 1, "disk": 2, "external": 3}
KV_LOCALITY = {
    "l1": smg_common.KV_CACHE_LOCALITY_LOCAL,
    "l2": smg_common.KV_CACHE_LOCALITY_LOCAL,
    "disk": smg_common.KV_CACHE_LOCALITY_LOCAL,
    "external": smg_common.KV_CACHE_LOCALITY_REMOTE,
}


def kv_batch(batch: EventBatch, block_size: int) -> smg_common.KvEventBatch:
    """A publisher batch as SMG's KvEventBatch (a snapshot: one chunk, synthesized events with
    event_id 0)."""
    out = smg_common.KvEventBatch(sequence_number=batch.seq, timestamp=batch.timestamp, dp_rank=0)
    for i, ev in enumerate(batch.events):
        event_id = 0 if batch.snapshot_blocks is not None else (batch.seq << 16) + i + 1
        msg = out.events.add(event_id=event_id)
        if isinstance(ev, Stored):
            stored = msg.stored
            stored.tier, stored.medium, stored.locality = (
                KV_TIER[ev.tier],
                KV_MEDIUM[ev.tier],
                KV_LOCALITY[ev.tier],
            )
            if ev.parent_hash is not None:
                stored.parent_block_hash = ev.parent_hash
            if ev.blocks[0].salt:
                stored.cache_salt = ev.blocks[0].salt
            for b in ev.blocks:
                stored.blocks.add(
                    block_hash=b.block_hash,
                    token_ids=b.token_ids,
                    block_size=block_size,
                    cache_level=KV_LEVEL[ev.tier],
                )
        elif isinstance(ev, Removed):
            msg.removed.block_hashes.extend(ev.block_hashes)
            msg.removed.tier, msg.removed.medium = KV_TIER[ev.tier], KV_MEDIUM[ev.tier]
            msg.removed.cache_level = KV_LEVEL[ev.tier]
            msg.removed.locality = KV_LOCALITY[ev.tier]
        else:
            assert isinstance(ev, Cleared)
            msg.cleared.SetInParent()
    if batch.snapshot_blocks is not None:
        out.snapshot.CopyFrom(
            smg_common.KvSnapshotChunk(
                index=0, count=1, blocks=batch.snapshot_blocks, unknown_before=0
            )
        )
    return out


def sampling(sp: pb.SamplingParams, vocab_size: int) -> dict[str, Any]:
    """SGLang's SamplingParams as an engine sampling_params dict. NOTE: proto3 scalars have no
    presence: a zero top_p / top_k / repetition_penalty means "not given" (the gateway sets
    every field it knows), a zero temperature is greedy."""
    f = "sampling_params"
    refused = [
        (sp.frequency_penalty != 0, "frequency_penalty"),
        (sp.presence_penalty != 0, "presence_penalty"),
        (sp.repetition_penalty not in (0.0, 1.0), "repetition_penalty"),
        (sp.n > 1, "n"),
        (sp.min_new_tokens > 0, "min_new_tokens"),
        (sp.WhichOneof("constraint") is not None, sp.WhichOneof("constraint") or "constraint"),
        (len(sp.logit_bias) > 0, "logit_bias"),
        (len(sp.custom_params.fields) > 0, "custom_params"),
    ]
    for bad, name in refused:
        if bad:
            raise ValidationError(f"{f}.{name} is not supported by this server")
    out: dict[str, Any] = {"temperature": sp.temperature}
    if not sp.temperature >= 0:  # also NaN
        raise ValidationError(f"{f}.temperature must be >= 0, got {sp.temperature}")
    if sp.top_p:
        if not 0 < sp.top_p <= 1:
            raise ValidationError(f"{f}.top_p must be in (0, 1], got {sp.top_p:g}")
        out["top_p"] = sp.top_p
    if sp.top_k:
        if sp.top_k < 1 and sp.top_k != -1:
            raise ValidationError(f"{f}.top_k must be -1 (off) or >= 1, got {sp.top_k}")
        out["top_k"] = sp.top_k
    if sp.min_p:
        if not 0 <= sp.min_p <= 1:
            raise ValidationError(f"{f}.min_p must be in [0, 1], got {sp.min_p:g}")
        out["min_p"] = sp.min_p
    if sp.HasField("max_new_tokens"):
        if sp.max_new_tokens < 1:
            raise ValidationError(f"{f}.max_new_tokens must be >= 1, got {sp.max_new_tokens}")
        out["max_new_tokens"] = sp.max_new_tokens
    if len(sp.stop) > validate.MAX_STOP_STRINGS:
        raise ValidationError(
            f"{f}.stop has {len(sp.stop)} strings; the limit is {validate.MAX_STOP_STRINGS}"
        )
    for i, s in enumerate(sp.stop):
        if not s or len(s) > validate.MAX_STOP_LEN:
            raise ValidationError(
                f"{f}.stop[{i}] must have 1..{validate.MAX_STOP_LEN} characters, got {len(s)}"
            )
    if sp.stop:
        out["stop"] = list(sp.stop)
    bad_id = next((t for t in sp.stop_token_ids if t >= vocab_size), None)
    if bad_id is not None:
        raise ValidationError(
            f"{f}.stop_token_ids: {bad_id} is out of the vocabulary [0, {vocab_size})"
        )
    if sp.stop_token_ids:
        out["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.ignore_eos:
        out["ignore_eos"] = True
    out["skip_special_tokens"] = sp.skip_special_tokens
    return out


def input_ids(request: pb.GenerateRequest, vocab_size: int) -> list[int]:
    """The prompt's token ids; refuses what the engine cannot take."""
    refused = [
        (request.HasField("mm_inputs"), "mm_inputs"),
        (request.return_logprob or request.top_logprobs_num > 0, "return_logprob"),
        (len(request.token_ids_logprob) > 0, "token_ids_logprob"),
        (request.return_hidden_states, "return_hidden_states"),
        (len(request.input_embeds) > 0, "input_embeds"),
        (bool(request.lora_id), "lora_id"),
        (bool(request.custom_logit_processor), "custom_logit_processor"),
        (bool(request.disaggregated_params.bootstrap_host), "disaggregated_params"),
        (
            request.HasField("data_parallel_rank") and request.data_parallel_rank != 0,
            "data_parallel_rank",
        ),
    ]
    for bad, name in refused:
        if bad:
            raise ValidationError(f"{name} is not supported by this server")
    ids = list(request.tokenized.input_ids)
    if not ids:
        raise ValidationError("tokenized.input_ids is empty")
    bad_at = next((i for i, t in enumerate(ids) if t >= vocab_size), None)
    if bad_at is not None:
        raise ValidationError(
            f"tokenized.input_ids[{bad_at}] = {ids[bad_at]} is out of the "
            f"vocabulary [0, {vocab_size})"
        )
    return ids


def tokenizer_zip(tokenizer: Any) -> bytes:
    """The tokenizer's files (save_pretrained: tokenizer.json, its config with the chat
    template, special tokens) as a zip, what SMG's GetTokenizer client unpacks."""
    with tempfile.TemporaryDirectory(prefix="hicache-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for path in sorted(Path(tmp).rglob("*")):
                if path.is_file():
                    zf.write(path, path.relative_to(tmp).as_posix())
        return buf.getvalue()


class SglangWorkerServicer(pb_grpc.SglangSchedulerServicer):
    def __init__(
        self, state: DaemonState, kv_events: KvEventPublisher, served_model_name: str | None = None
    ):
        self.state = state
        self.kv_events = kv_events
        self.served_model_name = served_model_name
        self.admin = CacheAdminServicer(state)  # FlushCache is hicache.v1's Flush of every tier
        self._tokenizer_zip: tuple[Any, bytes] | None = None  # (engine, zip)

    @rpc
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        st = self.state
        engine = await st.require_engine(context)
        ids = input_ids(request, engine.vocab_size)
        params = sampling(request.sampling_params, engine.vocab_size)
        if not request.stream:  # one Complete with every output id
            params["final_only"] = True
        who = st.principal(context)
        client_rid = (
            validate.request_id(request.request_id)
            if request.request_id
            else f"smg-{uuid.uuid4().hex[:16]}"
        )
        rid = who.request_id(client_rid)
        if rid in st.active:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"request_id {client_rid!r} is already running"
            )
        run = await EngineRequest.start(st, engine, ids, params, who.namespace(None), rid)
        output: list[int] = []
        try:
            async for chunk in run.chunks():
                output += chunk.token_ids
                if request.stream and chunk.token_ids:
                    yield pb.GenerateResponse(
                        request_id=client_rid,
                        chunk=pb.GenerateStreamChunk(
                            token_ids=chunk.token_ids,
                            prompt_tokens=chunk.prompt_tokens,
                            completion_tokens=chunk.completion_tokens,
                            cached_tokens=chunk.cached_tokens,
                        ),
                    )
                if not chunk.finished:
                    continue
                if chunk.finish_reason == "abort" and rid in st.drain_aborted:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        "the server is shutting down: the request was aborted",
                    )
                done = pb.GenerateComplete(
                    output_ids=output,
                    finish_reason=chunk.finish_reason or "stop",
                    prompt_tokens=chunk.prompt_tokens,
                    completion_tokens=chunk.completion_tokens,
                    cached_tokens=chunk.cached_tokens,
                )
                stop = chunk.matched_stop
                if isinstance(stop, int) and not isinstance(stop, bool):
                    done.matched_token_id = stop
                elif isinstance(stop, str):
                    done.matched_stop_str = stop
                yield pb.GenerateResponse(request_id=client_rid, complete=done)
        finally:
            run.release()  # client cancel, deadline, or server shutdown: the KV is freed

    @rpc
    async def HealthCheck(
        self, request: pb.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthCheckResponse:
        st = self.state
        if st.draining:
            return pb.HealthCheckResponse(healthy=False, message="the server is shutting down")
        if not st.ready:
            return pb.HealthCheckResponse(healthy=False, message="the model is still loading")
        return pb.HealthCheckResponse(healthy=True, message="serving")

    @rpc
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        engine = await self.state.require_engine(context, while_draining=True)
        if not request.request_id:
            raise ValidationError("request_id is required")
        rid = self.state.principal(context).request_id(request.request_id)
        if self.state.active.get(rid) is None:
            return pb.AbortResponse(success=False, message="no such running request")
        engine.abort(rid)
        return pb.AbortResponse(success=True, message="aborted")

    @rpc
    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        engine = await self.state.require_engine(context)
        info = await self.state.run(engine.model_info)
        path = str(info.get("model_path") or "")
        tok = engine.tokenizer
        eos = tok.eos_token_id
        return pb.GetModelInfoResponse(
            model_path=path,
            tokenizer_path=path,
            is_generation=True,
            served_model_name=model_ids(path, self.served_model_name)[0],
            max_context_length=engine.max_context_len,
            vocab_size=engine.vocab_size,
            max_req_input_len=engine.max_context_len - 1,
            model_type=str(info.get("architecture") or ""),
            architectures=[str(info.get("architecture") or "")],
            eos_token_ids=[] if eos is None else [int(eos)],
            pad_token_id=int(tok.pad_token_id or 0),
            bos_token_id=int(tok.bos_token_id or 0),
        )

    @rpc
    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetServerInfoResponse:
        st = self.state
        engine = await st.require_engine(context)
        info = await st.run(engine.model_info)
        args = struct_pb2.Struct()
        args.update(json_safe(engine.server_args.public_dict()))
        started = pb.GetServerInfoResponse(
            server_args=args,
            active_requests=len(st.active),
            is_paused=st.draining,
            uptime_seconds=time.time() - st.start_time,
            sglang_version=f"hicache {VERSION}",
            server_type="grpc",
            max_total_num_tokens=int(info["max_total_tokens"]),
        )
        started.start_time.FromSeconds(int(st.start_time))
        return started

    @rpc
    async def GetLoads(
        self, request: pb.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadsResponse:
        engine = await self.state.require_engine(context)
        if request.HasField("dp_rank") and request.dp_rank != 0:
            raise ValidationError(f"dp_rank {request.dp_rank} does not exist (one rank: 0)")
        try:
            include = parse_include(list(request.include))
        except UnknownSectionError as e:
            raise ValidationError(f"include: {e}") from None
        stats = await self.state.run(engine.cache_stats)
        report = loads_report(stats, engine.server_args.max_running_requests, VERSION, include)
        return json_format.ParseDict(report, pb.GetLoadsResponse(), ignore_unknown_fields=True)

    @rpc
    async def FlushCache(
        self, request: smg_common.FlushCacheRequest, context: grpc.aio.ServicerContext
    ) -> smg_common.FlushCacheResponse:
        flush = admin_pb2.FlushRequest()
        if request.timeout_s:
            flush.timeout_s = request.timeout_s
        done = await self.admin.Flush(flush, context)
        return smg_common.FlushCacheResponse(
            success=True, message=f"flushed every tier: {done.freed_tokens} tokens freed"
        )

    @rpc
    async def GetTokenizer(
        self, request: smg_common.GetTokenizerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common.GetTokenizerChunk]:
        engine = await self.state.require_engine(context)
        if self._tokenizer_zip is None or self._tokenizer_zip[0] is not engine:
            self._tokenizer_zip = (engine, await self.state.run(tokenizer_zip, engine.tokenizer))
        data = self._tokenizer_zip[1]
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            yield smg_common.GetTokenizerChunk(
                data=data[start:end], sha256=digest if end >= len(data) else ""
            )

    @rpc
    async def SubscribeKvEvents(
        self, request: smg_common.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[smg_common.KvEventBatch]:
        st = self.state
        await st.require_engine(context)
        if st.principal(context).tenant is not None:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                "KV events need the user or admin token (they carry every namespace's token ids)",
            )
        try:
            async for batch in self.kv_events.subscribe(request.start_sequence_number):
                yield kv_batch(batch, self.kv_events.block_size)
        except OutOfRangeError as e:
            # SMG then drops what it knows of this worker and subscribes again from 0
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(e))

    @rpc
    async def ListLoadedLoRAAdapters(
        self, request: pb.ListLoadedLoRAAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListLoadedLoRAAdaptersResponse:
        return pb.ListLoadedLoRAAdaptersResponse()  # the daemon serves no LoRA adapters


def json_safe(d: dict[str, Any]) -> dict[str, Any]:
    """A dict a protobuf Struct takes: numbers, strings, bools, None, lists and dicts of them."""

    def conv(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, dict):
            return {str(k): conv(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        return str(v)

    return {str(k): conv(v) for k, v in d.items()}
