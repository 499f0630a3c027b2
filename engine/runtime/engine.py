"""Engine: the in-process EngineFront (engine/front.py), and the Python API. Validates input,
hands requests to the scheduler thread and collects their streamed chunks; answers every other
operation with its handler (engine/runtime/handlers.py), on the scheduler thread between two
steps for the cache's."""

from __future__ import annotations

import atexit
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from engine import operations as ops
from engine.config import ServerArgs
from engine.errors import EngineShutdownError, QueueFullError
from engine.front import (
    SCHEDULER_JOIN_S,
    EngineFront,
    Prompt,
    RequestHandle,
    StreamChunk,
)
from engine.runtime import cache_admin, handlers
from engine.runtime.model_runner import ModelRunner
from engine.runtime.request import Req
from engine.runtime.scheduler import Scheduler
from engine.runtime.tree_factory import build_tree_cache, stop_tree_cache
from engine.sampling_params import SamplingParams
from engine.tokenizer import TokenizerManager
from hicache.observe.events import CacheEventLog

log = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class Engine(EngineFront):
    def __init__(self, model_path: str | None = None, device: str = "cpu", **server_args: Any):
        """``model_path`` (SGLang's name; ``model=`` is accepted too): an HF model directory, a
        .gguf file, or None for the embedded SmolLM2. Every other option is a ServerArgs field
        by name (engine/config.py; SGLang's spellings of them too, ``ALIASES``)."""
        if model_path is not None:
            server_args["model_path"] = model_path
        self.server_args = ServerArgs.from_kwargs(device=device, **server_args)
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

    # --- operations (engine/operations.py) ------------------------------------------------------
    def call(self, op: ops.Operation[R]) -> R:
        if self._closed:
            raise EngineShutdownError("the engine has been shut down")
        return handlers.answer(self.scheduler, op)

    def call_in_scheduler(self, fn: Callable[[Scheduler], T], timeout: float | None = 60.0) -> T:
        """fn(scheduler) on the scheduler thread between two steps (scripts and tests)."""
        return self.call(ops.InScheduler(fn, timeout))

    def event_log(self) -> CacheEventLog:
        """The cache's event log (attached when the tree brought none)."""
        return self.call_in_scheduler(cache_admin.event_log)

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
