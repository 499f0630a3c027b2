"""The engine boundary: what the API server (engine/server) asks of an engine, and the records
that cross it. The daemon's handlers type against `EngineFront` only; two classes implement it:

    Engine       engine/runtime/engine.py       in-process: the scheduler thread, the model, the
                                                cache (`hicache serve --processes single`, scripts)
    SplitEngine  engine/server/split_engine.py  the API server side of the split daemon: each
                                                call a message to the scheduler process

NOTE: torch-free, like everything it imports (engine.config, engine.errors, engine.tokenizer,
engine.admin_records, hicache.observe.events / kv_blocks / stats / tier): the split daemon's API server process
never loads torch or engine.runtime (tests/unit/test_engine_boundary.py).
"""

from __future__ import annotations

import queue
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

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

Prompt = str | list[int] | list[dict[str, str]]  # text, token ids, or chat messages
FinishKind = Literal["stop", "length", "abort"]  # EOS / stop token / stop string; budget; abort
CALL_TIMEOUT_S = 30.0  # how long a cache admin call waits for the scheduler thread
SCHEDULER_JOIN_S = 30.0  # shutdown waits this long for the scheduler's current step
L3_DRAIN_S = 60.0  # and this long for queued L3 backups to land (a hung store must not hang it)

_KNOWN = {  # SamplingParams' fields (a sampling_params dict may name no other)
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "final_only",
}


@dataclass
class SamplingParams:
    """A request's sampling options, from a sampling_params dict (``from_dict``), checked here
    at the edge; the scheduler process' Sampler (engine/runtime/sampling.py) reads them."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # One chunk at the end instead of one per token (vLLM's RequestOutputKind.FINAL_ONLY): for
    # callers that wait for the whole output (non-streaming HTTP, Engine.generate); in the split
    # daemon each chunk is a message through the detokenizer process to the API server
    final_only: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        unknown = sorted(set(d) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        p = cls(**d)
        p.validate()
        return p

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.final_only, bool):
            # NOTE: bad input is a ValueError everywhere (HTTP 400 / INVALID_ARGUMENT)
            raise ValueError(f"final_only must be true or false, got {self.final_only!r}")  # noqa: TRY004
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids contains an invalid token id {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


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
    """What the API server calls on an engine: prompts in, streams out, and the cache's admin
    operations. Prompts are tokenized and checked here (`tokenizer_manager`, set by the
    subclass), so a bad one fails the same way in-process and split. The admin operations run
    on the scheduler thread between two steps (engine/runtime/cache_admin.py and
    tenant_cache.py say what each does); ValueError means bad input, engine.errors says what
    else each may raise."""

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

    @abstractmethod
    def model_info(self) -> dict[str, Any]:
        """model_path, architecture, vocab_size, max_context_len, max_total_tokens, ..."""

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

    # --- the cache: figures and events -------------------------------------------------------
    @abstractmethod
    def cache_stats(self) -> CacheStats:
        """Every tier's figures and the scheduler's request counters (hicache/observe/stats.py)."""

    @abstractmethod
    def event_log(self) -> EventLogReader:
        """The cache's event log (one is attached when the tree brought none)."""

    @abstractmethod
    def kv_block_changes(
        self, block_size: int, salt_key: bytes, reset: bool = False
    ) -> BlockChanges:
        """The cache's full blocks stored / removed per tier since the last call (reset: the
        whole state); one caller per engine (the daemon's KvEventPublisher)."""

    # --- the cache: admin operations ---------------------------------------------------------
    @abstractmethod
    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchInfo:
        """What of `key` is cached, per tier, without changing anything."""

    @abstractmethod
    def evict(
        self,
        tier: str,
        num_tokens: int | None = None,
        prefix: list[int] | None = None,
        namespace: str | None = None,
        dry_run: bool = False,
        namespaces: frozenset[str] | None = None,
    ) -> EvictInfo:
        """Evicts >= num_tokens (None: all evictable) of `tier` among the sequences that start
        with `prefix`, or the nodes of `namespaces`, or the whole tree; TierUnavailableError
        for a tier that is not enabled (or l3)."""

    @abstractmethod
    def pin(
        self,
        key: list[int],
        namespace: str | None = None,
        ttl_s: float = 0.0,
        owner: str | None = None,
    ) -> Pin | None:
        """Locks the device-cached prefix of `key` (ttl_s 0: until unpinned); None when
        nothing of it is on L1."""

    @abstractmethod
    def unpin(self, pin_id: str | None = None, owner: str | None = None) -> tuple[int, int]:
        """Releases one pin (None: all; with an owner: only its own); (pins, tokens)."""

    @abstractmethod
    def pin_summary(self) -> tuple[int, int]:
        """(number of pins, tokens they pin)."""

    @abstractmethod
    def flush(self, tiers: list[str] | None = None) -> FlushInfo:
        """Empties the tiers (None: every enabled one); NotIdleError while requests run or
        wait, StorageBusyError while L3 work is in flight; nothing changes then."""

    @abstractmethod
    def flush_namespaces(
        self, namespaces: frozenset[str], tiers: list[str] | None, owner: str | None
    ) -> FlushInfo:
        """Empties the tiers of these namespaces only (a tenant's), releasing the owner's pins;
        other namespaces' requests may keep running."""

    @abstractmethod
    def inspect_tree(
        self,
        offset: int = 0,
        limit: int = 100,
        preview_tokens: int = 16,
        namespaces: frozenset[str] | None = None,
    ) -> tuple[list[NodeInfo], int]:
        """One page of the tree, parents first, and the number of nodes in all."""

    # --- tenants -----------------------------------------------------------------------------
    @abstractmethod
    def apply_quotas(self, quotas: Sequence[TenantQuota]) -> None:
        """Enforce these tenants' quotas from now on (replacing the quotas applied before)."""

    @abstractmethod
    def tenant_view(self, tenant: str, namespaces: frozenset[str]) -> TenantView:
        """What a tenant's namespaces hold per tier, its pins, its quota evictions."""

    @abstractmethod
    def tenant_figures(self, quotas: Sequence[TenantQuota]) -> dict[str, dict[str, dict[str, int]]]:
        """{tenant: {"cached" | "quota" | "evicted": {tier: tokens}}} (for /metrics)."""

    # --- L3 at run time ----------------------------------------------------------------------
    @abstractmethod
    def storage_info(self) -> dict[str, Any]:
        """The attached L3 backend: {"attached", "backend", "address", ...}."""

    @abstractmethod
    def attach_storage(
        self, backend: str, url: str | None = None, directory: str | None = None
    ) -> dict[str, Any]:
        """Attaches an L3 backend (none may be attached); returns storage_info()."""

    @abstractmethod
    def detach_storage(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stops using L3 once its pending work lands; returns what was attached."""

    # --- the engine itself -------------------------------------------------------------------
    def child_pids(self) -> dict[str, int]:
        """The engine's processes other than this one, by role (none in-process)."""
        return {}

    @abstractmethod
    def shutdown(self) -> None:
        """Stops the engine: the scheduler finishes its step (at most SCHEDULER_JOIN_S), queued
        L3 backups land (at most L3_DRAIN_S); idempotent."""
