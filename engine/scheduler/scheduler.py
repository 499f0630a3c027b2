"""Scheduler: waiting queue -> prefill/decode batches -> results (seeds 000, 002, 004).

One thread owns every cache structure; other threads talk to it only through the inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from engine.cache_admin import settle
from engine.config import ServerArgs
from engine.request import FinishReason, Req
from engine.scheduler.batch import BatchBuilder, OutOfKVError
from engine.scheduler.policy import SchedulePolicy
from engine.scheduler.prefill import AddResult, PrefillAdder
from engine.scheduler.stats import CacheCounters

log = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler:
    def __init__(self, args: ServerArgs, runner: Any, tree_cache: Any, max_context_len: int):
        self.args = args
        self.runner = runner
        self.tree_cache = tree_cache
        self.max_context_len = max_context_len
        self.page_size = args.page_size
        self.builder = BatchBuilder(
            runner.req_to_token_pool,
            runner.allocator,
            runner.kv_pool,
            tree_cache,
            runner.attn_backend,
            args.page_size,
            runner.device,
        )
        self.policy = SchedulePolicy(args.schedule_policy, tree_cache, args.random_seed)
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.inbox: queue.Queue[tuple] = queue.Queue()
        self.counters = CacheCounters()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.event_log = getattr(tree_cache, "event_log", None)
        self.step_hooks: list[Callable[[Scheduler], None]] = []
        self.forward_ct = 0
        self._inflight: list[Req] = []  # the extend batch being run (for failure cleanup)
        self._oom_streak = 0  # consecutive prefill batches that did not fit
        self._prefill_cap: int | None = None  # max requests per prefill while recovering

    # --- inbox -------------------------------------------------------------------------------
    def num_queued(self) -> int:
        return len(self.waiting) + self.inbox.qsize()

    def is_idle(self) -> bool:
        return not self.waiting and not self.running and self.chunked_req is None

    def process_inbox(self, block: bool, timeout: float = 0.05) -> None:
        try:
            item = self.inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            return
        while True:
            kind = item[0]
            if kind == "req":
                self.waiting.append(item[1])
            elif kind == "abort":
                self.abort(item[1])
            elif kind == "call":
                fn, fut = item[1], item[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn(self))
                    except BaseException as e:  # noqa: BLE001 - delivered to the caller's thread
                        fut.set_exception(e)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    def call(self, fn: Callable[[Scheduler], Any]) -> Future:
        fut: Future = Future()
        self.inbox.put(("call", fn, fut))
        return fut

    # --- main loop ---------------------------------------------------------------------------
    def run_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.process_inbox(block=self.is_idle())
            try:
                self.step()
            except Exception:  # never let one bad batch kill the daemon
                log.exception("scheduler step failed; aborting every request")
                self._fail_all("internal error in the scheduler step")

    def step(self) -> bool:
        check = getattr(self.tree_cache, "check", None)
        if check is not None:  # HiRadixCache: drain finished host writes/loads
            check()
        for hook in self.step_hooks:
            hook(self)
        batch = self.get_new_batch_prefill()
        if batch:
            self.run_extend(batch)
        elif self.running:
            self.run_decode()
        else:
            return False
        if self.args.debug_check_invariants:
            self.check_kv_invariant()
        return True

    def _match(self, req: Req) -> None:
        req.fill_ids = req.all_ids()
        # Keep at least one token to compute: its logits give the next token.
        key = req.fill_ids[: len(req.fill_ids) - 1]
        res = self.tree_cache.match_prefix(key, namespace=req.cache_namespace)
        req.prefix_indices = res.device_indices
        req.last_node = res.last_device_node
        req.host_hit_length = getattr(res, "host_hit_length", 0)
        req.match_result = res
        # NOTE: an L3 prefetch lands in L2, so a later re-match of a still-waiting request sees
        # those tokens as L2; remember the most L3 tokens any match fetched for it.
        tiers = getattr(res, "tier_tokens", None) or {}
        req.l3_seen = max(req.l3_seen, tiers.get("l3", 0))

    def get_new_batch_prefill(self) -> list[Req] | None:
        if not self.waiting and self.chunked_req is None:
            return None
        max_running = self.args.max_running_requests
        if len(self.running) >= max_running and self.chunked_req is None:
            return None
        deprioritized = (
            self.policy.calc_priority(self.waiting, self._match) if self.waiting else set()
        )
        adder = PrefillAdder(
            self.tree_cache,
            self.runner.allocator,
            self.running,
            self.new_token_ratio,
            self.args.max_prefill_tokens,
            self.args.chunked_prefill_size,
            self.page_size,
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        if adder.new_chunked_req is None:
            for req in self.waiting:
                if len(self.running) + len(adder.can_run) >= max_running:
                    break
                if req.rid in deprioritized:
                    continue
                if self._prefill_cap is not None and len(adder.can_run) >= self._prefill_cap:
                    break
                self._load_back(req)
                if adder.add_one_req(req, num_running=len(self.running)) != AddResult.CONTINUE:
                    break
        if not adder.can_run:
            return None
        picked = {id(r) for r in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in picked]
        self.chunked_req = adder.new_chunked_req
        for req in adder.can_run:
            self._count_hit(req)
        return adder.can_run

    def _load_back(self, req: Req) -> None:
        """HiRadixCache hook: bring host-resident prefix KV back to the device."""
        init = getattr(self.tree_cache, "init_load_back", None)
        if init is None:
            return
        # NOTE: called for every admitted request, host hit or not: an earlier request's load
        # may have evicted or demoted nodes this request's match points to; init_load_back
        # re-walks the path and returns the fresh device prefix.
        # NOTE: wait=False: the load overlaps the next forward layer by layer (run_extend sets
        # fb.wait_layer); every path that skips that forward calls _wait_pending_loads.
        indices, node = init(req.last_node, req.match_result, wait=False)
        req.prefix_indices, req.last_node = indices, node

    def _pending_layer_wait(self) -> Callable[[int], None] | None:
        """HiRadixCache: per-layer wait on the in-flight load (None when nothing is loading)."""
        return getattr(self.tree_cache, "pending_layer_wait", lambda: None)()

    def _wait_pending_loads(self) -> None:
        wait = getattr(self.tree_cache, "wait_pending_loads", None)
        if wait is not None:
            wait()

    def _count_hit(self, req: Req) -> None:
        if getattr(req, "_counted", False):
            return
        req._counted = True
        res = req.match_result
        tiers = dict(getattr(res, "tier_tokens", None) or {"l1": len(req.prefix_indices)})
        if req.l3_seen > tiers.get("l3", 0) and tiers.get("l2", 0):
            moved = min(req.l3_seen - tiers.get("l3", 0), tiers["l2"])
            tiers["l2"] -= moved
            tiers["l3"] = tiers.get("l3", 0) + moved
        for tier, n in tiers.items():
            req.cached_tokens_per_tier[tier] = n
        req.cached_tokens = len(req.prefix_indices)
        self.counters.record_match(
            req.cached_tokens_per_tier, len(req.origin_input_ids) - req.cached_tokens
        )

    # --- extend ------------------------------------------------------------------------------
    def run_extend(self, reqs: list[Req]) -> None:
        self._inflight = reqs
        try:
            fb = self.builder.prepare_extend(reqs)
        except OutOfKVError as e:
            # The budget was too optimistic: nothing was allocated, so requeue and decode.
            log.warning("prefill batch of %d did not fit the KV pool; requeued", len(reqs))
            self._wait_pending_loads()  # no forward will wait: land the loads (acked later)
            self._requeue(reqs)
            self._inflight = []
            self._on_prefill_oom(reqs, str(e))
            return
        self._oom_streak, self._prefill_cap = 0, None
        fb.wait_layer = self._pending_layer_wait()
        logits = self.runner.forward(fb)
        next_ids = self.runner.sample(logits, reqs).tolist()  # the one host sync per step
        self.forward_ct += 1
        now = time.monotonic()
        for req, tok in zip(reqs, next_ids):
            req.kv_len += req.extend_len
            req.extend_len = 0
            if req is self.chunked_req:
                req.is_chunked = True
                self._cache_unfinished(req)
                continue
            req.is_chunked = False
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            self._after_token(req)
            if not req.finished():
                self._cache_unfinished(req)
                self.running.append(req)
        self._inflight = []

    def _on_prefill_oom(self, reqs: list[Req], why: str) -> None:
        """Never spin on a batch that cannot fit: decode if anything runs; otherwise let
        in-flight tier copies land (their nodes become evictable), then admit one request at a
        time, and fail a lone request that still cannot fit."""
        self._oom_streak += 1
        if self.running:
            self.run_decode()
            return
        settle(self.tree_cache)
        if self._oom_streak < 2:
            return
        if len(reqs) > 1:
            self._prefill_cap = 1
            return
        req = reqs[0]
        self.waiting.remove(req)
        req.finished_reason = FinishReason(
            "abort", message=f"the KV pool cannot hold this request even when empty ({why})")
        req.emit()
        self._oom_streak = 0

    def _requeue(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req is self.chunked_req:
                self.chunked_req = None
            if req.req_pool_idx is not None:  # a chunked request: give its KV to the tree
                self.release(req)
                self.counters.finished -= 1
                req.reset_for_retract()
            elif req.last_node is not None:
                self.tree_cache.dec_lock_ref(req.last_node)
                req.last_node = None
        self.waiting[:0] = reqs

    def _cache_unfinished(self, req: Req) -> None:
        req.fill_ids = req.all_ids()[: req.kv_len]
        self.tree_cache.cache_unfinished_req(req)

    def _after_token(self, req: Req) -> None:
        if req.to_abort:
            req.finished_reason = FinishReason("abort", message="aborted by the client")
        req.check_finished(self.max_context_len)
        req.emit()
        if req.finished():
            self.release(req)

    def release(self, req: Req) -> None:
        """Gives a finished request's KV to the tree (or frees it), its row back, its lock up."""
        if req.req_pool_idx is not None:
            req.fill_ids = req.all_ids()[: req.kv_len]
            self.tree_cache.cache_finished_req(req)  # also frees the row and the lock
            req.req_pool_idx = None
            self.counters.finished += 1
        elif req.last_node is not None:  # admitted to a batch that never ran
            self.tree_cache.dec_lock_ref(req.last_node)
        req.last_node = None

    # --- decode ------------------------------------------------------------------------------
    def run_decode(self) -> None:
        self._ensure_decode_memory()
        if not self.running:
            return
        reqs = self.running
        fb = self.builder.prepare_decode(reqs)
        # Defensive: decode never reads slots of an in-flight load (those belong to requests
        # whose extend has not run), but a still-loading batch is waited for layer by layer.
        fb.wait_layer = self._pending_layer_wait()
        logits = self.runner.forward(fb)
        next_ids = self.runner.sample(logits, reqs).tolist()
        self.forward_ct += 1
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        still = []
        for req, tok in zip(reqs, next_ids):
            req.kv_len += 1
            req.output_ids.append(tok)
            self._after_token(req)
            if not req.finished():
                still.append(req)
        self.running = still

    def _ensure_decode_memory(self) -> None:
        alloc = self.runner.allocator
        while self.running:
            need = self.builder.decode_pages_needed(self.running) * self.page_size
            if alloc.available_size() < need:
                self.tree_cache.evict(need - alloc.available_size())
            if alloc.available_size() >= need:
                return
            self.retract_one()

    def retract_one(self) -> None:
        """Returns the request with the fewest outputs (longest prompt on ties) to the waiting
        queue; its KV goes into the tree, so re-running it is mostly a cache hit."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        if len(self.running) == 1:
            log.warning("KV pool too small for a single request: retracting %s", victim.rid)
        self.running.remove(victim)
        self.release(victim)
        self.counters.finished -= 1
        self.counters.retractions += 1
        victim.reset_for_retract()
        self.waiting.insert(0, victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    # --- aborts ------------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.finished_reason = FinishReason("abort", message="aborted by the client")
                req.emit()
                return
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if req.rid == rid:
                self._abort_active(req, "aborted by the client")
                return

    def _abort_active(self, req: Req, message: str) -> None:
        req.finished_reason = FinishReason("abort", message=message)
        if req is self.chunked_req:
            self.chunked_req = None
        if req in self.running:
            self.running.remove(req)
        self.release(req)
        req.emit()

    def _fail_all(self, message: str) -> None:
        active = list(self.running) + ([self.chunked_req] if self.chunked_req else [])
        active += [r for r in self._inflight if r not in active and not r.finished()]
        self._inflight = []
        for req in active:
            try:
                self._abort_active(req, message)
            except Exception:
                log.exception("cleanup of %s failed", req.rid)
        self.running = []
        self.chunked_req = None
        # Waiting requests are failed too: a step that fails before running a batch would
        # otherwise fail again on the same queue forever.
        for req in self.waiting:
            if req.last_node is not None and req.req_pool_idx is None:
                req.last_node = None  # matched but never locked
            req.finished_reason = FinishReason("abort", message=message)
            req.emit()
        self.waiting = []

    # --- invariants --------------------------------------------------------------------------
    def held_slots(self) -> torch.Tensor:
        """Slots active requests hold that the tree does not ([n] int64 on CPU)."""
        r2t = self.runner.req_to_token_pool.req_to_token
        parts = [torch.empty(0, dtype=torch.int64)]
        active = self.running + ([self.chunked_req] if self.chunked_req else [])
        for r in active:
            if r.req_pool_idx is not None:
                parts.append(r2t[r.req_pool_idx, : r.kv_len].to(torch.int64).cpu())
        held = torch.cat(parts).unique()
        tree = self.tree_cache.all_device_slots().to(torch.int64).cpu()
        return held[~torch.isin(held, tree)]

    def check_kv_invariant(self) -> None:
        """NOTE: every KV page is exactly one of: free, in the tree, held by a request."""
        ps = self.page_size
        alloc = self.runner.allocator
        free = alloc.debug_free_pages().to(torch.int64).cpu()
        tree = (self.tree_cache.all_device_slots().to(torch.int64).cpu() // ps).unique()
        held = (self.held_slots().cpu() // ps).unique()
        total = alloc.size // ps
        counts = torch.zeros(total + 1, dtype=torch.int64)
        for group in (free, tree, held):
            counts.index_add_(0, group, torch.ones_like(group))
        bad = (counts[1:] != 1).nonzero().flatten() + 1
        if len(bad):
            raise AssertionError(
                f"KV accounting broken for pages {bad[:10].tolist()}: free={len(free)} "
                f"tree={len(tree)} held={len(held)} total={total}"
            )
