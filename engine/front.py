"""The engine boundary: what the API server (engine/server) asks of an engine, and the records
that cross it. The daemon's handlers type against `EngineFront` only; two classes implement it:

    Engine       engine/runtime/engine.py       in-process: the scheduler thread, the model, the
                                                cache (`hicache serve --processes single`, scripts)
    SplitEngine  engine/server/split_engine.py  the API server side of the split daemon: each
                                                call a message to the scheduler process

Besides requests (submit / abort), everything an engine answers is an operation: one dataclass
each in engine/operations.py, run by `EngineFront.call(op)`; the named methods below are the
Python API over them. The engine side answers each with one handler (engine/runtime/handlers.py).

NOTE: torch-free, like everything it imports (engine.config, engine.errors, engine.operations,
engine.admin_records, hicache.observe.events / blocks / stats / tier): the split daemon's API
server process never loads torch or engine.runtime (tests/unit/test_engine_boundary.py).
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, cast

from engine import operations as ops
from engine.admin_records import (
    EvictInfo,
    FlushInfo,
    MatchInfo,
    NodeInfo,
    Pin,
    TenantQuota,
    TenantView,
)
from engine.config import ServerArgs
from engine.errors import EngineShutdownError
from hicache.observe.blocks import BlockChanges
from hicache.observe.events import CacheEvent
from hicache.observe.stats import CacheStats

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerManager

R = TypeVar("R")
Prompt = str | list[int] | list[dict[str, str]]  # text, token ids, or chat messages
FinishKind = Literal["stop", "length", "abort"]  # EOS / stop token / stop string; budget; abort
SCHEDULER_JOIN_S = 30.0  # shutdown waits this long for the scheduler's current step
L3_DRAIN_S = 60.0  # and this long for queued L3 backups to land (a hung store must not hang it)


@dataclass
class StreamChunk:
    """What a request produced since its previous chunk; the last one has `finished`."""

    token_ids: list[int]  # the new ids
    text: str  # the new text (filled in by the detokenizer process in a split daemon)
    finished: bool = False
    finish_reason: FinishKind | None = None
    matched_stop: int | str | None = None  # the stop token id or stop string
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_per_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None  # why an aborted request was aborted


@dataclass
class GenerateResult:
    rid: str
    token_ids: list[int]
    text: str
    finish_reason: FinishKind | None
    matched_stop: int | str | None
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_per_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None


class RequestHandle:
    """A submitted request: its StreamChunks arrive on `chunks` (a thread-safe queue; an
    exception put there ends the stream with that error)."""

    def __init__(
        self,
        rid: str,
        chunks: queue.Queue[StreamChunk | BaseException],
        alive: Callable[[], bool] = lambda: True,
    ):
        self.rid = rid
        self.chunks = chunks
        self.alive = alive  # is whatever fills `chunks` still running?
        self.done = False  # the finished chunk was read

    def __iter__(self) -> Iterator[StreamChunk]:
        while True:
            try:
                chunk = self.chunks.get(timeout=1.0)
            except queue.Empty:
                if not self.alive():
                    raise EngineShutdownError(
                        "the engine stopped before the request finished"
                    ) from None
                continue
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk
            if chunk.finished:
                self.done = True
                return

    def result(self) -> GenerateResult:
        ids: list[int] = []
        text = ""
        last: StreamChunk | None = None
        for chunk in self:
            ids += chunk.token_ids
            text += chunk.text
            last = chunk
        assert last is not None
        return GenerateResult(
            self.rid,
            ids,
            text,
            last.finish_reason,
            last.matched_stop,
            last.prompt_tokens,
            last.cached_tokens,
            last.cached_tokens_per_tier,
            last.error,
        )


class EventLogReader(Protocol):
    """The reads of a cache event log (hicache.observe.events.CacheEventLog; the split daemon's
    RemoteEventLog reads the scheduler process' one)."""

    @property
    def last_seq(self) -> int: ...

    @property
    def first_seq(self) -> int: ...

    def since(self, seq: int, limit: int | None = None) -> list[CacheEvent]: ...

    def missed(self, seq: int) -> int: ...

    def wait_for(self, seq: int, timeout: float | None = None) -> bool: ...


class EngineFront(ABC):
    """What the API server calls on an engine: prompts in, streams out, and operations.
    Prompts are tokenized and checked here (`tokenizer_manager`, set by the subclass), so a bad
    one fails the same way in-process and split. A subclass implements the requests (submit,
    abort), `call` and `event_log` (how its operations travel) and shutdown; every named
    operation below is `call` of the dataclass of the same name (engine/operations.py says
    what each does; the cache's run on the scheduler thread between two steps)."""

    tokenizer_manager: TokenizerManager
    server_args: ServerArgs  # the options the engine runs with (L3 attach / detach change them)

    # --- the model ---------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer, or None for a model without one (token-id prompts only)."""
        return self.tokenizer_manager.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer_manager.vocab_size

    @property
    def max_context_len(self) -> int:
        return self.tokenizer_manager.max_context_len

    def tokenize(self, prompt: Prompt, chat: bool = False) -> list[int]:
        return self.tokenizer_manager.tokenize(prompt, chat)

    # --- requests ----------------------------------------------------------------------------
    @abstractmethod
    def submit(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | None = None,
        namespace: str | None = None,
        rid: str | None = None,
        chat: bool = False,
    ) -> RequestHandle:
        """Queues a request; ValueError (bad input) before anything is queued, QueueFullError
        when max_queued_requests are waiting, EngineShutdownError after shutdown."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Ends the request (its last chunk: finish_reason "abort"); its KV is freed at the
        next scheduler step. An unknown or finished rid is ignored."""

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        namespace: str | None = None,
        chat: bool = False,
    ) -> GenerateResult | list[GenerateResult]:
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], (int, dict))
        )
        # the checks above tell a prompt from a batch of them
        batch = [cast(Prompt, prompts)] if single else list(cast(Sequence[Prompt], prompts))
        if not batch:
            raise ValueError("prompt is empty: give a non-empty string, token-id list or batch")
        params = (
            sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(batch)
        )
        if len(params) != len(batch):
            raise ValueError("sampling_params list must match the number of prompts")
        # the whole outputs are returned: one chunk each (unless the caller says otherwise)
        params = [{"final_only": True, **(sp or {})} for sp in params]
        # Validate everything before queueing anything: a bad prompt never half-runs a batch.
        for p, sp in zip(batch, params):
            self.tokenizer_manager.prepare(p, sp, chat)
        handles = [self.submit(p, sp, namespace, chat=chat) for p, sp in zip(batch, params)]
        results = [h.result() for h in handles]
        return results[0] if single else results

    def generate_stream(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | None = None,
        namespace: str | None = None,
        chat: bool = False,
    ) -> Iterator[StreamChunk]:
        handle = self.submit(prompt, sampling_params, namespace, chat=chat)
        try:
            yield from handle
        finally:
            if not handle.done:
                self.abort(handle.rid)

    # --- everything else: operations (engine/operations.py) ----------------------------------
    @abstractmethod
    def call(self, op: ops.Operation[R]) -> R:
        """Runs one operation on the engine side and returns its answer (waiting at most
        ``op.answer_within()``); EngineShutdownError after shutdown. ValueError means bad
        input; engine.errors says what else each may raise."""

    @abstractmethod
    def event_log(self) -> EventLogReader:
        """The cache's event log (one is attached when the tree brought none)."""

    def model_info(self) -> dict[str, Any]:
        return self.call(ops.GetModelInfo())

    def cache_stats(self) -> CacheStats:
        return self.call(ops.GetCacheStats())

    def kv_block_changes(
        self, block_size: int, salt_key: bytes, reset: bool = False
    ) -> BlockChanges:
        return self.call(ops.KvBlockChanges(block_size, salt_key, reset))

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchInfo:
        return self.call(ops.MatchPrefix(key, namespace))

    def evict(
        self,
        tier: str,
        num_tokens: int | None = None,
        prefix: list[int] | None = None,
        namespace: str | None = None,
        dry_run: bool = False,
        namespaces: frozenset[str] | None = None,
    ) -> EvictInfo:
        return self.call(ops.Evict(tier, num_tokens, prefix, namespace, dry_run, namespaces))

    def pin(
        self,
        key: list[int],
        namespace: str | None = None,
        ttl_s: float = 0.0,
        owner: str | None = None,
    ) -> Pin | None:
        return self.call(ops.PinPrefix(key, namespace, ttl_s, owner))

    def unpin(self, pin_id: str | None = None, owner: str | None = None) -> tuple[int, int]:
        return self.call(ops.Unpin(pin_id, owner))

    def pin_summary(self) -> tuple[int, int]:
        return self.call(ops.PinSummary())

    def flush(self, tiers: list[str] | None = None) -> FlushInfo:
        return self.call(ops.Flush(tiers))

    def flush_namespaces(
        self, namespaces: frozenset[str], tiers: list[str] | None, owner: str | None
    ) -> FlushInfo:
        return self.call(ops.FlushNamespaces(namespaces, tiers, owner))

    def inspect_tree(
        self,
        offset: int = 0,
        limit: int = 100,
        preview_tokens: int = 16,
        namespaces: frozenset[str] | None = None,
    ) -> tuple[list[NodeInfo], int]:
        return self.call(ops.InspectTree(offset, limit, preview_tokens, namespaces))

    def apply_quotas(self, quotas: Sequence[TenantQuota]) -> None:
        self.call(ops.ApplyQuotas(tuple(quotas)))

    def tenant_view(self, tenant: str, namespaces: frozenset[str]) -> TenantView:
        return self.call(ops.GetTenantView(tenant, namespaces))

    def tenant_figures(self, quotas: Sequence[TenantQuota]) -> dict[str, dict[str, dict[str, int]]]:
        return self.call(ops.GetTenantFigures(tuple(quotas)))

    def storage_info(self) -> dict[str, Any]:
        return self.call(ops.GetStorageInfo())

    def attach_storage(
        self, backend: str, url: str | None = None, directory: str | None = None
    ) -> dict[str, Any]:
        return self.call(ops.AttachStorage(backend, url, directory))

    def detach_storage(self, timeout: float = 30.0) -> dict[str, Any]:
        return self.call(ops.DetachStorage(timeout))

    # --- the engine itself -------------------------------------------------------------------
    def child_pids(self) -> dict[str, int]:
        """The engine's processes other than this one, by role (none in-process)."""
        return {}

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the engine: the scheduler finishes its step (at most SCHEDULER_JOIN_S), queued
        L3 backups land (at most L3_DRAIN_S); idempotent."""
