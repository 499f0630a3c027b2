"""Scheduler: waiting queue -> prefill/decode batches -> results.

One thread owns every cache structure: the one its loop runs on. A loop pass (``run_once``)
takes the inbox's messages (new requests, aborts, calls, copy acks' wake-ups: ``inbox.py``) and
runs a step; a pass that did nothing sleeps until the next message or prefetch deadline
(``sleep_time``), never spinning. Two loops run it: ``run_loop`` on the in-process Engine's
thread, and the scheduler process' own, which also reads its ZMQ socket (runtime/process.py).
What it asks of the cache goes through its ``CacheManager`` (``cache.py``); how a request
leaves (finished, retracted, requeued, aborted, failed) is ``lifecycle.py``.

With overlap (``ServerArgs.overlap_enabled``), forwards run on a ``ForwardWorker`` thread: a step
launches its batch, then handles the previous batch's results while that forward runs
(``overlap``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import TYPE_CHECKING, TypeVar

from engine.config import ServerArgs
from engine.runtime.cache_admin import expire_pins
from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.pins import PinTable
from engine.runtime.request import Req
from engine.runtime.scheduler import invariants, lifecycle, oom
from engine.runtime.scheduler.batch import BatchBuilder, OutOfKVError
from engine.runtime.scheduler.cache import CacheManager
from engine.runtime.scheduler.hooks import StepHook, StepHookHandle, StepHooks
from engine.runtime.scheduler.inbox import Abort, Arrival, Call, Inbox
from engine.runtime.scheduler.overlap import ForwardWorker, Launched
from engine.runtime.scheduler.policy import SchedulePolicy
from engine.runtime.scheduler.prefill import AddResult, PrefillAdder
from engine.runtime.scheduler.stats import CacheCounters
from hicache.tree.base import BasePrefixCache

if TYPE_CHECKING:
    from engine.runtime.model_runner import ModelRunner
    from engine.runtime.tenant_cache import QuotaEnforcer

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # longest sleep with nothing to do (pin TTLs are checked at this resolution)
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


T = TypeVar("T")


class Scheduler:
    def __init__(
        self,
        args: ServerArgs,
        runner: ModelRunner,
        tree_cache: BasePrefixCache,
        max_context_len: int,
        step_hooks: Sequence[StepHook] = (),
    ):
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
        self.worker = (
            ForwardWorker(runner, args.max_running_requests + 8) if args.overlap_enabled() else None
        )
        self.counters = CacheCounters()
        # CPU: a prefill reads the KV of its L2 hit from host memory in place (cache.py)
        reads_host_kv = (
            self.worker is None
            and runner.device.type == "cpu"
            and runner.attn_backend.reads_host_kv
        )
        self.cache_manager = CacheManager(
            tree_cache, self.counters, reads_host_kv, self.wait_forwards
        )
        self.policy = SchedulePolicy(
            args.schedule_policy,
            tree_cache,
            self.cache_manager.l3_hit,
            args.random_seed,
            max_bypass=args.schedule_max_bypass,
        )
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.inbox = Inbox()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.event_log = tree_cache.event_log
        self.admin_pins = PinTable()  # admin / tenant pins (cache_admin.pin)
        self.step_hooks = StepHooks()
        self.step_hooks.add(expire_pins)  # pins past their TTL are released at the next step
        for hook in step_hooks:
            self.step_hooks.add(hook)
        # tenant quotas, when configured (tenant_cache.set_quota_enforcer: a hook, an L3 gate)
        self.quota_enforcer: QuotaEnforcer | None = None
        self.quota_hook: StepHookHandle | None = None
        self.forward_ct = 0
        self.inflight: list[Req] = []  # the batch being launched or handled (failure cleanup)
        self.launched: deque[Launched] = deque()  # forwards whose results are not handled yet
        # finished (or aborted) while a launched forward still writes their KV: released once
        # their last launched batch is handled
        self.deferred: list[Req] = []
        self.oom = oom.OomRecovery()
        self.loop_iterations = 0  # loop passes (each one a step or a wake-up)
        self.cache_manager.set_wake(self.inbox.wake)  # copy acks wake a sleeping loop

    # --- any thread: ``inbox`` (put_request, put_abort, put_call, wake) -------------------------
    def num_queued(self) -> int:
        """Requests not yet admitted: waiting, or still in the inbox (not wake-ups, aborts or
        admin calls)."""
        # NOTE: an abort still in the inbox frees its place already (the client is gone); for
        # a running request that undercounts by one until the abort is processed
        return max(0, len(self.waiting) + self.inbox.pending_arrivals())

    # --- the scheduler thread: the loop ---------------------------------------------------------
    def add_request(self, req: Req) -> None:
        """A new request: it waits, matched (and its L3 read started)."""
        self.waiting.append(req)
        self.cache_manager.arrive(req)

    def run_call(self, fn: Callable[[Scheduler], T]) -> T:
        """``fn(self)`` between two steps; it sees every launched step's results."""
        self.sync()
        return fn(self)

    def is_idle(self) -> bool:
        return (
            not self.waiting
            and not self.running
            and self.chunked_req is None
            and not self.launched
            and not self.deferred
        )

    def run_once(self) -> bool:
        """One loop pass: the inbox's messages, then a step. False: nothing could run (the loop
        may sleep ``sleep_time``: nothing is launched then, every step handles what it did)."""
        self.loop_iterations += 1
        try:
            self.take_inbox()
            return self.step()
        except Exception:  # never let one bad batch kill the daemon
            log.exception("scheduler step failed; aborting every request")
            lifecycle.fail_all(self, "internal error in the scheduler step")
            return True

    def sleep_time(self) -> float:
        """How long a loop with nothing to do may sleep: until the next prefetch deadline, at
        most ``IDLE_WAIT_S``. NOTE: sleeping instead of polling leaves the GIL to copy threads;
        every message and copy ack wakes the inbox (``fileno``)."""
        deadline = self.cache_manager.deadline()
        if deadline is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.001, deadline - time.monotonic()))

    def run_loop(self, stop: threading.Event) -> None:
        """The in-process Engine's scheduler thread: passes until ``stop``."""
        try:
            while not stop.is_set():
                if not self.run_once() and not stop.is_set():
                    self.inbox.wait(self.sleep_time())
        finally:
            self.close()

    def close(self) -> None:
        """The loop ended: no forward may outlive it (the pools go next), and no caller may
        wait on it (queued and later calls fail now, event waits end)."""
        self.wait_forwards()
        if self.worker is not None:
            self.worker.close()
        self.inbox.close()
        if self.event_log is not None:
            self.event_log.close()

    def take_inbox(self) -> None:
        """What was put in the inbox: requests join, aborts and calls run (on the loop)."""
        for msg in self.inbox.take(block=False, timeout=0.0):
            if isinstance(msg, Arrival):
                self.add_request(msg.req)
            elif isinstance(msg, Abort):
                lifecycle.abort(self, msg.rid)
            elif isinstance(msg, Call) and msg.future.set_running_or_notify_cancel():
                try:
                    msg.future.set_result(self.run_call(msg.fn))
                except BaseException as e:  # noqa: BLE001 - delivered to the caller's thread
                    msg.future.set_exception(e)

    def step(self) -> bool:
        self.cache_manager.check()  # finished host writes / loads / L3 work
        self.step_hooks.run(self)
        if self.launched and self.launched[-1].is_extend and (self.waiting or self.chunked_req):
            # NOTE: the next prefill goes after this one's tree insert: a chunk continues from
            # it, and waiting requests may share its prompt's prefix (a prefill is long next to
            # building a batch, so little overlap is lost)
            self.sync()
        batch = self.get_new_batch_prefill()
        launched = None
        if batch:
            launched = self.run_extend(batch)
        elif self.running:
            launched = self.run_decode()
        # overlap: the batch just launched runs while the earlier ones' results are handled
        done = self._handle_launched(keep=launched if self.worker is not None else None)
        if not batch and launched is None and not done:
            return False
        if self.args.debug_check_invariants:
            invariants.check(self)
        return True

    # --- launched forwards -------------------------------------------------------------------
    def _launch(
        self,
        fb: ForwardBatch,
        reqs: list[Req],
        lens: list[int],
        is_extend: bool,
        chunked: Req | None = None,
    ) -> Launched:
        """Run (or hand to the worker) the forward + sampling of ``fb``."""
        self.cache_manager.before_forward(fb, is_extend)
        job = Launched(reqs, lens, is_extend, chunked)
        self.forward_ct += 1
        if self.worker is None:
            try:
                logits = self.runner.forward(fb)
            finally:
                self.cache_manager.after_forward(fb)
            job.future.set_result(self.runner.sample(logits, reqs).tolist())  # the host sync
        else:
            slot = self.worker.reserve(len(reqs))
            for i, req in enumerate(reqs):
                req.kv.future_slot = slot + i
            self.worker.submit(fb, reqs, slot, job.future)
        for req in reqs:
            req.kv.num_pending += 1
        self.launched.append(job)
        return job

    def _handle_launched(self, keep: Launched | None) -> bool:
        """Handle the results of every launched batch older than ``keep``."""
        done = False
        while self.launched and self.launched[0] is not keep:
            self._handle(self.launched.popleft())
            done = True
        return done

    def sync(self) -> None:
        """Handle every launched batch (waits for their forwards)."""
        self._handle_launched(keep=None)

    def wait_forwards(self) -> None:
        """Wait until no forward runs (their results stay to be handled): before anything but a
        forward writes device KV slots, which an in-flight forward may still read or write."""
        if self.launched:
            wait([j.future for j in self.launched])

    def _handle(self, job: Launched) -> None:
        self.inflight = job.reqs
        next_ids = job.future.result()
        for req, tok, n in zip(job.reqs, next_ids, job.lens):
            req.kv.num_pending -= 1
            req.kv.kv_len += n
            if req.finished():
                # NOTE: finished or aborted after this batch was built: its KV is whole now,
                # the token is dropped; its release waited for this batch (``lifecycle.retire``)
                if not req.kv.num_pending and req in self.deferred:
                    self.deferred.remove(req)
                    lifecycle.release(self, req)
                continue
            if req is job.chunked:
                lifecycle.cache_unfinished(self, req)
                continue
            req.output_ids.append(tok)
            lifecycle.after_token(self, req)
            if job.is_extend and not req.finished():
                lifecycle.cache_unfinished(self, req)
        self.running = [r for r in self.running if not r.finished()]
        self.inflight = []

    def _finishing(self, req: Req) -> bool:
        """Its launched tokens end it by length: another decode step would be wasted."""
        if not req.kv.num_pending:
            return False
        return (
            len(req.output_ids) + req.kv.num_pending >= req.max_new_tokens
            or req.seqlen + req.kv.num_pending >= self.max_context_len
        )

    def get_new_batch_prefill(self) -> list[Req] | None:
        if not self.waiting and self.chunked_req is None:
            return None
        max_running = self.args.max_running_requests
        if len(self.running) >= max_running and self.chunked_req is None:
            return None
        deprioritized = (
            self.policy.calc_priority(self.waiting, self.cache_manager.match)
            if self.waiting
            else set()
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
        cont = id(self.chunked_req)
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        if adder.new_chunked_req is None:
            for i, req in enumerate(self.waiting):
                if len(self.running) + len(adder.can_run) >= max_running:
                    break
                if req.rid in deprioritized:
                    continue
                if self.oom.prefill_cap is not None and len(adder.can_run) >= self.oom.prefill_cap:
                    break
                if not self.cache_manager.ready(req, self.waiting[i + 1 :]):
                    continue  # its L3 prefetch policy says wait; later requests may go
                self.cache_manager.match(req)  # an earlier admission or L3 read may change it
                res = adder.add_one_req(
                    req, num_running=len(self.running), load_back=self.cache_manager.load_back
                )
                if res != AddResult.CONTINUE:
                    break
        if not adder.can_run:
            return None
        picked = {id(r) for r in adder.can_run}
        self.waiting = [r for r in self.waiting if id(r) not in picked]
        # a chunked request's next chunk is no new overtake
        self.policy.count_bypasses(self.waiting, [r for r in adder.can_run if id(r) != cont])
        self.chunked_req = adder.new_chunked_req
        for req in adder.can_run:
            self.cache_manager.count_hit(req)
        return adder.can_run

    # --- extend ------------------------------------------------------------------------------
    def run_extend(self, reqs: list[Req]) -> Launched | None:
        self.inflight = reqs
        try:
            fb = self.builder.prepare_extend(reqs)
        except OutOfKVError as e:
            # The budget was too optimistic: nothing was allocated, so requeue and decode.
            log.warning("prefill batch of %d did not fit the KV pool (%s); requeued", len(reqs), e)
            self.sync()  # launched steps may finish requests and free their KV
            self.cache_manager.wait_pending_loads()  # no forward will wait for them
            lifecycle.requeue(self, reqs)
            self.inflight = []
            return oom.recover(self, reqs, str(e))
        self.oom.fitted()
        chunked = self.chunked_req if any(r is self.chunked_req for r in reqs) else None
        job = self._launch(fb, reqs, [r.kv.extend_len for r in reqs], True, chunked)
        for req in reqs:
            req.kv.extend_len = 0
            if req is not chunked:
                self.running.append(req)  # decodes next step, its first token as a placeholder
        self.inflight = []
        return job

    # --- decode ------------------------------------------------------------------------------
    def run_decode(self) -> Launched | None:
        reqs = self._ensure_decode_memory()
        if not reqs:
            return None
        # NOTE: decode never reads slots of an in-flight load (those belong to requests whose
        # extend has not run), but a still-loading batch is waited for layer by layer (_launch).
        fb = self.builder.prepare_decode(reqs)
        self.new_token_ratio = max(
            MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY
        )
        return self._launch(fb, reqs, [1] * len(reqs), False)

    def _ensure_decode_memory(self) -> list[Req]:
        """The requests to decode, with room for one more token each (retracting if needed)."""
        alloc = self.runner.allocator
        while True:
            reqs = [r for r in self.running if not self._finishing(r)]
            if not reqs:
                return reqs
            need = self.builder.decode_pages_needed(reqs) * self.page_size
            if alloc.available_size() < need:
                self.tree_cache.evict(need - alloc.available_size())
            if alloc.available_size() >= need:
                return reqs
            lifecycle.retract_one(self)
