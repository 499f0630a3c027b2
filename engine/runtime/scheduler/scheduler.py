"""Scheduler: waiting queue -> prefill/decode batches -> results.

One thread owns every cache structure; other threads talk to it only through the inbox.
The loop never spins: when a step does nothing it blocks on the inbox, which new requests,
aborts, admin calls and every cache-copy acknowledgement (``wake``) feed, with a timeout for
prefetch deadlines. What it asks of the cache goes through its ``CacheManager``
(``scheduler/cache.py``): a waiting request's match, its L3 read and whether it may be admitted
while that runs, its load back, its hit per tier, the host reads around a forward.

With overlap (``ServerArgs.overlap_enabled``), forwards run on a ``ForwardWorker`` thread: a step launches its
batch, then handles the previous batch's results while that forward runs (``overlap``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ServerArgs
from engine.runtime.cache_admin import expire_pins
from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.pins import PinTable
from engine.runtime.request import FinishReason, Req
from engine.runtime.scheduler import invariants
from engine.runtime.scheduler.batch import BatchBuilder, OutOfKVError
from engine.runtime.scheduler.cache import CacheManager
from engine.runtime.scheduler.inbox import Abort, Arrival, Call, Inbox
from engine.runtime.scheduler.oom import OomAction, OomRecovery
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


StepHook = Callable[["Scheduler"], object]  # runs at the start of every step; result unused


@dataclass(frozen=True)
class StepHookHandle:
    """A registered step hook (``Scheduler.add_step_hook``); ``remove_step_hook`` takes it."""

    hook_id: int


@dataclass(frozen=True)
class SchedulerCall:
    """fn(scheduler, *args, **kwargs) as a value: picklable when fn is a module-level function
    and the arguments are plain data, so the split daemon sends it to the scheduler process."""

    fn: Callable[..., Any]
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, scheduler: Scheduler) -> Any:
        return self.fn(scheduler, *self.args, **self.kwargs)


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
            tree_cache, self.counters, reads_host_kv, self._wait_forwards
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
        self._step_hooks: dict[int, StepHook] = {}  # run in registration order
        self._hook_ids = itertools.count(1)
        self.add_step_hook(expire_pins)  # pins past their TTL are released at the next step
        for hook in step_hooks:
            self.add_step_hook(hook)
        # tenant quotas, when configured (set_quota_enforcer)
        self.quota_enforcer: QuotaEnforcer | None = None
        self._quota_hook: StepHookHandle | None = None
        self.forward_ct = 0
        self._inflight: list[Req] = []  # the batch being launched or handled (failure cleanup)
        self.launched: deque[Launched] = deque()  # forwards whose results are not handled yet
        # finished (or aborted) while a launched forward still writes their KV: released once
        # their last launched batch is handled
        self.deferred: list[Req] = []
        self.oom = OomRecovery()
        self.loop_iterations = 0  # run_loop passes (each one a step or a wake-up)
        self.cache_manager.set_wake(self.wake)  # copy acks wake a sleeping loop

    # --- step hooks --------------------------------------------------------------------------
    def add_step_hook(self, hook: StepHook) -> StepHookHandle:
        """Run ``hook(scheduler)`` at the start of every step from now on (scheduler thread)."""
        handle = StepHookHandle(next(self._hook_ids))
        self._step_hooks[handle.hook_id] = hook
        return handle

    def remove_step_hook(self, handle: StepHookHandle) -> None:
        """Stop running a hook ``add_step_hook`` registered (KeyError: not registered)."""
        del self._step_hooks[handle.hook_id]

    def set_quota_enforcer(self, enforcer: QuotaEnforcer | None) -> None:
        """Tenant quotas (engine/runtime/tenant_cache.py): ``enforcer`` replaces the one in use
        (None: no quotas), as a step hook and as the tree's L3 backup gate."""
        if self._quota_hook is not None:
            self.remove_step_hook(self._quota_hook)
            self._quota_hook = None
        self.quota_enforcer = enforcer
        if self.tree_cache.l3 is not None:
            self.tree_cache.l3.backup.gate = (
                None if enforcer is None else enforcer.backup_gate(self.tree_cache)
            )
        if enforcer is not None:
            self._quota_hook = self.add_step_hook(enforcer)

    # --- inbox -------------------------------------------------------------------------------
    def num_queued(self) -> int:
        """Requests not yet admitted: waiting, or still in the inbox (not wake-ups, aborts or
        admin calls)."""
        # NOTE: an abort still in the inbox frees its place already (the client is gone); for
        # a running request that undercounts by one until the abort is processed
        return max(0, len(self.waiting) + self.inbox.pending_arrivals())

    def request_abort(self, rid: str) -> None:
        """Any thread: abort ``rid`` (waiting or running) at the next loop pass."""
        self.inbox.put_abort(rid)

    def submit(self, req: Req) -> None:
        """Any thread: hand a new request to the scheduler thread."""
        self.inbox.put_request(req)

    def is_idle(self) -> bool:
        return (
            not self.waiting
            and not self.running
            and self.chunked_req is None
            and not self.launched
            and not self.deferred
        )

    def wake(self) -> None:
        """Any thread: make a sleeping loop run a step (coalesced)."""
        self.inbox.wake()

    def process_inbox(self, block: bool, timeout: float = IDLE_WAIT_S) -> None:
        for msg in self.inbox.take(block, timeout):
            if isinstance(msg, Arrival):
                self._on_arrival(msg.req)
            elif isinstance(msg, Abort):
                self.abort(msg.rid)
            elif isinstance(msg, Call):
                self._sync()  # admin calls see every launched step's results
                if msg.future.set_running_or_notify_cancel():
                    try:
                        msg.future.set_result(msg.fn(self))
                    except BaseException as e:  # noqa: BLE001 - delivered to the caller's thread
                        msg.future.set_exception(e)

    def call(self, fn: Callable[[Scheduler], Any]) -> Future:
        """Any thread: run ``fn(scheduler)`` on the scheduler thread between two steps."""
        return self.inbox.put_call(fn)

    # --- main loop ---------------------------------------------------------------------------
    def run_loop(self, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                self.loop_iterations += 1
                try:
                    self.process_inbox(block=False)
                    worked = self.step()
                except Exception:  # never let one bad batch kill the daemon
                    log.exception("scheduler step failed; aborting every request")
                    self._fail_all("internal error in the scheduler step")
                    worked = True
                if not worked and not stop.is_set():
                    # NOTE: nothing could run: sleep until a request, an abort, a copy ack or
                    # the next prefetch deadline instead of polling (the copy threads need the
                    # GIL). Nothing is launched then: every step handles what it launched.
                    self.process_inbox(block=True, timeout=self._sleep_time())
        finally:
            self._wait_forwards()  # no forward may outlive the loop (the pools go next)
            if self.worker is not None:
                self.worker.close()
            # no caller may wait on a loop that is gone: queued and later calls fail now, and
            # event waits end
            self.inbox.close()
            if self.event_log is not None:
                self.event_log.close()

    def _sleep_time(self) -> float:
        deadline = self.cache_manager.deadline()
        if deadline is None:
            return IDLE_WAIT_S
        return min(IDLE_WAIT_S, max(0.001, deadline - time.monotonic()))

    def step(self) -> bool:
        self.cache_manager.check()  # finished host writes / loads / L3 work
        for hook in list(self._step_hooks.values()):  # a hook may add or remove hooks
            hook(self)
        if self.launched and self.launched[-1].is_extend and (self.waiting or self.chunked_req):
            # NOTE: the next prefill goes after this one's tree insert: a chunk continues from
            # it, and waiting requests may share its prompt's prefix (a prefill is long next to
            # building a batch, so little overlap is lost)
            self._sync()
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
            self.check_kv_invariant()
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

    def _sync(self) -> None:
        """Handle every launched batch (waits for their forwards)."""
        self._handle_launched(keep=None)

    def _wait_forwards(self) -> None:
        """Wait until no forward runs (their results stay to be handled): before anything but a
        forward writes device KV slots, which an in-flight forward may still read or write."""
        if self.launched:
            wait([j.future for j in self.launched])

    def _handle(self, job: Launched) -> None:
        self._inflight = job.reqs
        next_ids = job.future.result()
        for req, tok, n in zip(job.reqs, next_ids, job.lens):
            req.kv.num_pending -= 1
            req.kv.kv_len += n
            if req.finished():
                # NOTE: finished or aborted after this batch was built: its KV is whole now,
                # the token is dropped; its release waited for this batch (``_retire``)
                if not req.kv.num_pending and req in self.deferred:
                    self.deferred.remove(req)
                    self.release(req)
                continue
            if req is job.chunked:
                self._cache_unfinished(req)
                continue
            req.output_ids.append(tok)
            self._after_token(req)
            if job.is_extend and not req.finished():
                self._cache_unfinished(req)
        self.running = [r for r in self.running if not r.finished()]
        self._inflight = []

    def _finishing(self, req: Req) -> bool:
        """Its launched tokens end it by length: another decode step would be wasted."""
        if not req.kv.num_pending:
            return False
        return (
            len(req.output_ids) + req.kv.num_pending >= req.max_new_tokens
            or req.seqlen + req.kv.num_pending >= self.max_context_len
        )

    def _on_arrival(self, req: Req) -> None:
        self.waiting.append(req)
        self.cache_manager.arrive(req)

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
        self._inflight = reqs
        try:
            fb = self.builder.prepare_extend(reqs)
        except OutOfKVError as e:
            # The budget was too optimistic: nothing was allocated, so requeue and decode.
            log.warning("prefill batch of %d did not fit the KV pool (%s); requeued", len(reqs), e)
            self._sync()  # launched steps may finish requests and free their KV
            self.cache_manager.wait_pending_loads()  # no forward will wait for them
            self._requeue(reqs)
            self._inflight = []
            return self._on_prefill_oom(reqs, str(e))
        self.oom.fitted()
        chunked = self.chunked_req if any(r is self.chunked_req for r in reqs) else None
        job = self._launch(fb, reqs, [r.kv.extend_len for r in reqs], True, chunked)
        for req in reqs:
            req.kv.extend_len = 0
            if req is not chunked:
                self.running.append(req)  # decodes next step, its first token as a placeholder
        self._inflight = []
        return job

    def _on_prefill_oom(self, reqs: list[Req], why: str) -> Launched | None:
        """Never spin on a batch that cannot fit: decode if anything runs; otherwise let
        in-flight tier copies land (their nodes become evictable), then admit one request at a
        time, and fail a lone request that still cannot fit (``scheduler/oom.py``)."""
        action = self.oom.on_oom(len(reqs), bool(self.running))
        if action is OomAction.DECODE:
            return self.run_decode()
        self.cache_manager.settle()
        if action is OomAction.FAIL:
            req = reqs[0]
            self.waiting.remove(req)
            self.cache_manager.forget(req)
            req.finished_reason = FinishReason(
                "abort", message=f"the KV pool cannot hold this request even when empty ({why})"
            )
            req.emit()
        return None

    def _requeue(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req is self.chunked_req:
                self.chunked_req = None
            if req.kv.req_pool_idx is not None:  # a chunked request: give its KV to the tree
                self.release(req)
                self.counters.finished -= 1
                req.kv.reset()
            elif req.kv.last_node is not None:
                self.tree_cache.dec_lock_ref(req.kv.last_node)
                req.kv.last_node = None
            req.kv.match_result = None  # re-match: the locks (and maybe the tree) changed
        self.waiting[:0] = reqs

    def _cache_unfinished(self, req: Req) -> None:
        req.kv.fill_ids = req.all_ids()[: req.kv.kv_len]
        self.tree_cache.cache_unfinished_req(req)

    def _after_token(self, req: Req) -> None:
        req.check_finished(self.max_context_len)
        req.emit()
        if req.finished():
            self._retire(req)

    def _retire(self, req: Req) -> None:
        """A finished request's KV goes to the tree once no launched forward writes it: now, or
        when its last launched batch is handled (``deferred`` till then)."""
        self.cache_manager.forget(req)
        if req.kv.num_pending:
            self.deferred.append(req)
        else:
            self.release(req)

    def _free_uncommitted(self, req: Req) -> None:
        """Slots allocated for a forward whose KV never landed (it failed): the pages past the
        committed KV's last page (that one goes with the committed tail)."""
        ps, kv = self.page_size, req.kv
        start = -(-kv.kv_len // ps) * ps
        if kv.kv_alloc > start:
            r2t = self.runner.req_to_token_pool.req_to_token
            self.runner.allocator.free(r2t[kv.req_pool_idx, start : kv.kv_alloc].long())
        kv.kv_alloc = kv.kv_len

    def release(self, req: Req) -> None:
        """Gives a finished request's KV to the tree (or frees it), its row back, its lock up."""
        kv = req.kv
        if kv.req_pool_idx is not None:
            self._free_uncommitted(req)
            kv.fill_ids = req.all_ids()[: kv.kv_len]
            self.tree_cache.cache_finished_req(req)  # also frees the row and the lock
            kv.req_pool_idx = None
            self.counters.finished += 1
        elif kv.last_node is not None:  # admitted to a batch that never ran
            self.tree_cache.dec_lock_ref(kv.last_node)
        kv.last_node = None

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
            self.retract_one()

    def retract_one(self) -> None:
        """Returns the request with the fewest outputs (longest prompt on ties) to the waiting
        queue; its KV goes into the tree, so re-running it is mostly a cache hit."""
        if self.launched:
            self._sync()  # its KV must be whole (and finished requests free theirs)
            return
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        if len(self.running) == 1:
            log.warning("KV pool too small for a single request: retracting %s", victim.rid)
        self.running.remove(victim)
        self.release(victim)
        self.counters.finished -= 1
        self.counters.retractions += 1
        victim.kv.reset()
        self.waiting.insert(0, victim)
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.2)

    # --- aborts ------------------------------------------------------------------------------
    def abort(self, rid: str) -> None:
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self.cache_manager.forget(req)
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
        self._retire(req)
        req.emit()

    def _fail_all(self, message: str) -> None:
        # NOTE: the launched forwards end first; their KV counts as never written
        self._wait_forwards()
        self.cache_manager.release_loads()  # no forward will read held loads from host
        pending = [r for j in self.launched for r in j.reqs] + self._inflight
        self.launched.clear()
        self._inflight = []
        for req in pending:
            req.kv.num_pending = 0
        deferred, self.deferred = self.deferred, []
        for req in deferred:
            try:
                self.release(req)
            except Exception:
                log.exception("cleanup of %s failed", req.rid)
        active = list(self.running) + ([self.chunked_req] if self.chunked_req else [])
        active += [r for r in pending if r not in active and not r.finished()]
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
            if req.kv.last_node is not None and req.kv.req_pool_idx is None:
                req.kv.last_node = None  # matched but never locked
            try:
                self.cache_manager.forget(req)
            except Exception:
                log.exception("cancelling the prefetch of %s failed", req.rid)
            req.finished_reason = FinishReason("abort", message=message)
            req.emit()
        self.waiting = []

    # --- invariants (engine/runtime/scheduler/invariants.py) -------------------------------
    def held_slots(self) -> torch.Tensor:
        """Slots active requests hold that the tree does not ([n] int64 on CPU)."""
        active = self.running + ([self.chunked_req] if self.chunked_req else []) + self.deferred
        active += [r for j in self.launched for r in j.reqs]
        return invariants.held_slots(
            self.runner.req_to_token_pool.req_to_token, active, self.tree_cache
        )

    def check_kv_invariant(self) -> None:
        """Every KV page is free, in the tree or held by a request, exactly once."""
        invariants.check_kv_invariant(
            self.runner.allocator, self.tree_cache, self.held_slots(), self.page_size
        )
