"""How a request leaves the scheduler's lists, and what each way gives back. Every function
runs on the scheduler thread, on its ``Scheduler``:

    finished   ``after_token`` sees it, ``retire``: its L3 read is forgotten; its KV goes to the
               tree (``release``) once no launched forward writes it (``scheduler.deferred``
               till then); a prefill's KV goes to the tree at once (``cache_unfinished``)
    retracted  ``retract_one``: the decode batch has no room: the request with the fewest
               outputs gives its KV to the tree and waits again (mostly a cache hit then)
    requeued   ``requeue``: a prefill batch that did not fit goes back to the queue, its
               locks released, its match to redo
    aborted    ``abort``: by the client, waiting (its L3 read stops) or active (retired)
    failed     ``fail_all``: a step raised: every request ends with the error, the launched
               forwards' KV counts as never written

``release`` frees the slots of a failed forward (past the committed KV), hands the committed
KV to the tree (``cache_finished_req``: the row and the lock go too) and counts the request.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.runtime.request import FinishReason, Req

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def release(s: Scheduler, req: Req) -> None:
    """Gives a finished request's KV to the tree (or frees it), its row back, its lock up."""
    kv = req.kv
    if kv.req_pool_idx is not None:
        _free_uncommitted(s, req)
        kv.fill_ids = req.all_ids()[: kv.kv_len]
        s.tree_cache.cache_finished_req(req)  # also frees the row and the lock
        kv.req_pool_idx = None
        s.counters.finished += 1
    elif kv.last_node is not None:  # admitted to a batch that never ran
        s.tree_cache.dec_lock_ref(kv.last_node)
    kv.last_node = None


def _free_uncommitted(s: Scheduler, req: Req) -> None:
    """Slots allocated for a forward whose KV never landed (it failed): the pages past the
    committed KV's last page (that one goes with the committed tail)."""
    ps, kv = s.page_size, req.kv
    start = -(-kv.kv_len // ps) * ps
    if kv.kv_alloc > start:
        r2t = s.runner.req_to_token_pool.req_to_token
        s.runner.allocator.free(r2t[kv.req_pool_idx, start : kv.kv_alloc].long())
    kv.kv_alloc = kv.kv_len


def cache_unfinished(s: Scheduler, req: Req) -> None:
    """A prefill (or a chunk) ran: the KV it computed goes to the tree, the request keeps its
    lock on it and goes on."""
    req.kv.fill_ids = req.all_ids()[: req.kv.kv_len]
    s.tree_cache.cache_unfinished_req(req)


def after_token(s: Scheduler, req: Req) -> None:
    """A token was sampled for ``req``: its chunk goes out; finished, it retires."""
    req.check_finished(s.max_context_len)
    req.emit()
    if req.finished():
        retire(s, req)


def retire(s: Scheduler, req: Req) -> None:
    """A finished request's KV goes to the tree once no launched forward writes it: now, or
    when its last launched batch is handled (``deferred`` till then)."""
    s.cache_manager.forget(req)
    if req.kv.num_pending:
        s.deferred.append(req)
    else:
        release(s, req)


def requeue(s: Scheduler, reqs: list[Req]) -> None:
    """A prefill batch that did not fit goes back to the front of the queue."""
    for req in reqs:
        if req is s.chunked_req:
            s.chunked_req = None
        if req.kv.req_pool_idx is not None:  # a chunked request: give its KV to the tree
            release(s, req)
            s.counters.finished -= 1
            req.kv.reset()
        elif req.kv.last_node is not None:
            s.tree_cache.dec_lock_ref(req.kv.last_node)
            req.kv.last_node = None
        req.kv.match_result = None  # re-match: the locks (and maybe the tree) changed
    s.waiting[:0] = reqs


def retract_one(s: Scheduler) -> None:
    """Returns the request with the fewest outputs (longest prompt on ties) to the waiting
    queue; its KV goes into the tree, so re-running it is mostly a cache hit."""
    if s.launched:
        s.sync()  # its KV must be whole (and finished requests free theirs)
        return
    victim = min(s.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
    if len(s.running) == 1:
        log.warning("KV pool too small for a single request: retracting %s", victim.rid)
    s.running.remove(victim)
    release(s, victim)
    s.counters.finished -= 1
    s.counters.retractions += 1
    victim.kv.reset()
    s.waiting.insert(0, victim)
    s.new_token_ratio = min(1.0, s.new_token_ratio + 0.2)


def abort(s: Scheduler, rid: str) -> None:
    """The client went away: ``rid`` ends, waiting or active (unknown: nothing to do)."""
    for req in s.waiting:
        if req.rid == rid:
            s.waiting.remove(req)
            s.cache_manager.forget(req)
            req.finished_reason = FinishReason("abort", message="aborted by the client")
            req.emit()
            return
    for req in s.running + ([s.chunked_req] if s.chunked_req else []):
        if req.rid == rid:
            _abort_active(s, req, "aborted by the client")
            return


def _abort_active(s: Scheduler, req: Req, message: str) -> None:
    req.finished_reason = FinishReason("abort", message=message)
    if req is s.chunked_req:
        s.chunked_req = None
    if req in s.running:
        s.running.remove(req)
    retire(s, req)
    req.emit()


def fail_all(s: Scheduler, message: str) -> None:
    """A step raised: every request, launched, active or waiting, ends with ``message``."""
    # NOTE: the launched forwards end first; their KV counts as never written
    s.wait_forwards()
    s.cache_manager.release_loads()  # no forward will read held loads from host
    pending = [r for j in s.launched for r in j.reqs] + s.inflight
    s.launched.clear()
    s.inflight = []
    for req in pending:
        req.kv.num_pending = 0
    deferred, s.deferred = s.deferred, []
    for req in deferred:
        try:
            release(s, req)
        except Exception:
            log.exception("cleanup of %s failed", req.rid)
    active = list(s.running) + ([s.chunked_req] if s.chunked_req else [])
    active += [r for r in pending if r not in active and not r.finished()]
    for req in active:
        try:
            _abort_active(s, req, message)
        except Exception:
            log.exception("cleanup of %s failed", req.rid)
    s.running = []
    s.chunked_req = None
    # Waiting requests are failed too: a step that fails before running a batch would
    # otherwise fail again on the same queue forever.
    for req in s.waiting:
        if req.kv.last_node is not None and req.kv.req_pool_idx is None:
            req.kv.last_node = None  # matched but never locked
        try:
            s.cache_manager.forget(req)
        except Exception:
            log.exception("cancelling the prefetch of %s failed", req.rid)
        req.finished_reason = FinishReason("abort", message=message)
        req.emit()
    s.waiting = []
