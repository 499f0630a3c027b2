"""Engine: the in-process EngineFront (engine/front.py), and the Python API. Validates input,
hands requests to the scheduler thread, collects their streamed chunks, and runs the cache's
admin operations on the scheduler thread between two steps."""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

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
from engine.errors import EngineShutdownError, QueueFullError
from engine.front import (
    CALL_TIMEOUT_S,
    SCHEDULER_JOIN_S,
    EngineFront,
    Prompt,
    RequestHandle,
    SamplingParams,
    StreamChunk,
)
from engine.runtime import cache_admin, tenant_cache
from engine.runtime.kv_block_view import kv_block_changes
from engine.runtime.model_runner import ModelRunner
from engine.runtime.request import Req
from engine.runtime.scheduler import Scheduler
from engine.runtime.scheduler.stats import cache_stats
from engine.runtime.tree_factory import build_tree_cache, stop_tree_cache
from engine.tokenizer import TokenizerManager
from hicache.observe.blocks import BlockChanges
from hicache.observe.events import CacheEventLog
from hicache.observe.stats import CacheStats

log = logging.getLogger(__name__)
T = TypeVar("T")


class Engine(EngineFront):
    def __init__(self, model: str | None = None, device: str = "cpu", **server_args: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model, device=device, **server_args)
        self.runner = ModelRunner(self.server_args)
        self.tokenizer_manager = TokenizerManager(
            self.runner.tokenizer, self.runner.vocab_size, self.runner.max_context_len
        )
        self.eos_token_ids = eos_token_ids(self.runner.hf_config, self.tokenizer)
        tree_cache = build_tree_cache(self.server_args, self.runner)
        self.scheduler = Scheduler(self.server_args, self.runner, tree_cache, self.max_context_len)
        self._stop = threading.Event()
        self._closed = False
        self._thread = threading.Thread(
            target=self.scheduler.run_loop,
            args=(self._stop,),
            name="hicache-scheduler",
            daemon=True,
        )
        self._thread.start()
        # NOTE: the engine's threads (scheduler, copy workers, L3 backup / prefetch) are daemons,
        # so that an engine never shut down cannot hang interpreter exit; Python therefore does
        # not join them before atexit handlers run, and left alone they would lose queued L3
        # backups and still run torch ops while the interpreter finalizes (abort: "terminate
        # called without an active exception"). An engine not shut down is stopped at exit.
        # The hook holds the engine's parts, never the Engine: a dropped Engine is still freed.
        self._at_exit = functools.partial(_stop_threads, self._stop, self._thread, self.scheduler)
        atexit.register(self._at_exit)

    # --- requests ----------------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        sampling_params: dict[str, Any] | None = None,
        namespace: str | None = None,
        rid: str | None = None,
        chat: bool = False,
    ) -> RequestHandle:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        ids, params = self.tokenizer_manager.prepare(prompt, sampling_params, chat)
        return self.enqueue(ids, params, namespace, rid)

    def enqueue(
        self,
        ids: list[int],
        params: SamplingParams,
        namespace: str | None,
        rid: str | None,
        sink: Callable[[StreamChunk], None] | None = None,
    ) -> RequestHandle:
        """Queue a prepared request (TokenizerManager.prepare); its chunks go to the handle,
        or to `sink` when one is given."""
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        if self.scheduler.num_queued() >= self.server_args.max_queued_requests:
            raise QueueFullError(
                f"{self.server_args.max_queued_requests} requests are already queued; retry later"
            )
        req = Req.new(
            rid,
            ids,
            params,
            self.tokenizer,
            self.eos_token_ids,
            self.max_context_len,
            self.runner.device,
            namespace,
            sink,
        )
        self.scheduler.inbox.put_request(req)
        return RequestHandle(req.rid, req.stream.chunks, self._thread.is_alive)

    def abort(self, rid: str) -> None:
        self.scheduler.inbox.put_abort(rid)

    # --- cache and introspection -------------------------------------------------------------
    def call_in_scheduler(self, fn: Callable[[Scheduler], T], timeout: float | None = 60.0) -> T:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        return self.scheduler.inbox.put_call(fn).result(timeout)

    def cache_stats(self) -> CacheStats:
        """Every tier's figures and the scheduler's counters (hicache/observe/stats.py)."""
        return self.call_in_scheduler(cache_stats)

    def event_log(self) -> CacheEventLog:
        """The cache's event log; one is attached (to the scheduler and its tree) when the tree
        brought none, so that Flush's `cleared` events are still observable."""
        return self.call_in_scheduler(cache_admin.event_log)

    def model_info(self) -> dict[str, Any]:
        return self.runner.model_info()

    def kv_block_changes(
        self, block_size: int, salt_key: bytes, reset: bool = False
    ) -> BlockChanges:
        return self._admin(lambda s: kv_block_changes(s, block_size, salt_key, reset))

    # --- cache admin (engine/runtime/cache_admin.py, tenant_cache.py) -------------------------
    def _admin(self, fn: Callable[[Scheduler], T]) -> T:
        return self.call_in_scheduler(fn, CALL_TIMEOUT_S)

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchInfo:
        return self._admin(lambda s: cache_admin.match_prefix(s, key, namespace))

    def evict(
        self,
        tier: str,
        num_tokens: int | None = None,
        prefix: list[int] | None = None,
        namespace: str | None = None,
        dry_run: bool = False,
        namespaces: frozenset[str] | None = None,
    ) -> EvictInfo:
        return self._admin(
            lambda s: cache_admin.evict(
                s,
                tier,
                num_tokens=num_tokens,
                prefix=prefix,
                namespace=namespace,
                dry_run=dry_run,
                namespaces=namespaces,
            )
        )

    def pin(
        self,
        key: list[int],
        namespace: str | None = None,
        ttl_s: float = 0.0,
        owner: str | None = None,
    ) -> Pin | None:
        return self._admin(lambda s: cache_admin.pin(s, key, namespace, ttl_s, owner=owner))

    def unpin(self, pin_id: str | None = None, owner: str | None = None) -> tuple[int, int]:
        return self._admin(lambda s: cache_admin.unpin(s, pin_id, owner))

    def pin_summary(self) -> tuple[int, int]:
        return self._admin(cache_admin.pin_summary)

    def flush(self, tiers: list[str] | None = None) -> FlushInfo:
        return self._admin(lambda s: cache_admin.flush(s, tiers))

    def flush_namespaces(
        self, namespaces: frozenset[str], tiers: list[str] | None, owner: str | None
    ) -> FlushInfo:
        return self._admin(lambda s: tenant_cache.flush(s, namespaces, tiers, owner))

    def inspect_tree(
        self,
        offset: int = 0,
        limit: int = 100,
        preview_tokens: int = 16,
        namespaces: frozenset[str] | None = None,
    ) -> tuple[list[NodeInfo], int]:
        return self._admin(
            lambda s: cache_admin.inspect_tree(s, offset, limit, preview_tokens, namespaces)
        )

    def apply_quotas(self, quotas: Sequence[TenantQuota]) -> None:
        self._admin(lambda s: tenant_cache.apply_quotas(s, quotas))

    def tenant_view(self, tenant: str, namespaces: frozenset[str]) -> TenantView:
        return self._admin(lambda s: tenant_cache.tenant_view(s, tenant, namespaces))

    def tenant_figures(self, quotas: Sequence[TenantQuota]) -> dict[str, dict[str, dict[str, int]]]:
        return self._admin(lambda s: tenant_cache.tenant_figures(s, quotas))

    # --- L3 at run time -----------------------------------------------------------------------
    def storage_info(self) -> dict[str, Any]:
        """The attached L3 backend: {"attached", "backend", "address", ...} (see storage_info)."""
        return self.call_in_scheduler(cache_admin.storage_info)

    def attach_storage(
        self, backend: str, url: str | None = None, directory: str | None = None
    ) -> dict[str, Any]:
        """Attach an L3 backend to the running engine (none may be attached); its objects
        are the ones a daemon with the same model and options would use. Returns storage_info.
        The backend is built here (a directory scan may take a while), attached on the
        scheduler thread between steps."""
        return cache_admin.build_and_attach_storage(
            self.server_args,
            self.scheduler.tree_cache,
            self.call_in_scheduler,
            backend,
            url,
            directory,
        )

    def detach_storage(self, timeout: float = 30.0) -> dict[str, Any]:
        """Stop using L3 (pending backups and prefetches finish first; see
        L3Tier.detach_storage). Returns what was attached (storage_info before)."""
        return self.call_in_scheduler(
            lambda s: cache_admin.detach_storage(s, timeout), timeout=timeout + 30.0
        )

    def shutdown(self) -> None:
        """Stop the scheduler, land queued L3 backups (at most ``L3_DRAIN_S``; the objects
        left are logged), stop the copy threads and give the pools back. An engine not shut
        down has its threads stopped the same way at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        _stop_threads(self._stop, self._thread, self.scheduler)
        tree = self.scheduler.tree_cache
        if self._thread.is_alive():
            return  # still stepping: it may touch the pools
        # NOTE: the pools (GBs) are also reachable through reference cycles (scheduler <-> tree
        # <-> controller), which only the cyclic GC frees: a script that replaces an engine by
        # a new one held both sets at once (measured: 7.6 GB each, OOM-killed at the third).
        self.runner.kv_pool.release_memory()
        self.runner.model = None
        if tree.host is not None:
            tree.host.release_memory()

    def __enter__(self) -> Engine:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _stop_threads(stop: threading.Event, thread: threading.Thread, scheduler: Scheduler) -> None:
    """Stop the scheduler thread, land the L3 backups it queued, stop the cache's threads."""
    stop.set()
    scheduler.inbox.wake()
    thread.join(timeout=SCHEDULER_JOIN_S)
    stop_tree_cache(scheduler.tree_cache, drain=not thread.is_alive())  # the tree is ours now


def eos_token_ids(hf_config: Any, tokenizer: Any) -> set[int]:
    """The model's end-of-sequence token ids (its config's and its tokenizer's)."""
    ids: set[int] = set()
    eos = getattr(hf_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
