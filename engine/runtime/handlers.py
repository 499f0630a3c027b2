"""The engine side of every operation (engine/operations.py): one handler per type, found by
the operation's type (``answer``). The in-process Engine and the split daemon's scheduler
process both answer through here, so an operation behaves the same in both.

A handler takes the scheduler and the operation. It runs on the scheduler thread between two
steps (the default: every cache mutation happens there), or, declared with
``caller_thread=True``, on the thread that asked: reads that need no step boundary (the model's
facts, the event log, whose waits must not hold the scheduler) and L3 attach / detach, which
build or wait off the scheduler thread and hand it only the swap.

To add an operation: its dataclass in engine/operations.py, its handler here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from engine import operations as ops
from engine.admin_records import EvictInfo, FlushInfo, MatchInfo, NodeInfo, Pin, TenantView
from engine.config import ServerArgs
from engine.runtime import cache_admin, tenant_cache
from engine.runtime.kv_block_view import kv_block_changes
from engine.runtime.scheduler import Scheduler
from engine.runtime.scheduler.stats import cache_stats
from hicache.observe.blocks import BlockChanges
from hicache.observe.events import CacheEvent, CacheEventLog
from hicache.observe.stats import CacheStats

R = TypeVar("R")
O = TypeVar("O", bound=ops.Operation[Any])
Fn = Callable[[Scheduler, O], Any]


@dataclass(frozen=True)
class Handler:
    fn: Callable[[Scheduler, Any], Any]
    caller_thread: bool  # False: on the scheduler thread, between two steps


HANDLERS: dict[type[ops.Operation[Any]], Handler] = {}


def handles(op_type: type[O], caller_thread: bool = False) -> Callable[[Fn[O]], Fn[O]]:
    """Registers the decorated function as the one handler of ``op_type``."""

    def register(fn: Fn[O]) -> Fn[O]:
        assert op_type not in HANDLERS, f"{op_type.__name__} already has a handler"
        HANDLERS[op_type] = Handler(fn, caller_thread)
        return fn

    return register


def handler(op: ops.Operation[Any]) -> Handler:
    """``op``'s handler (TypeError: not a declared operation; nothing runs)."""
    found = HANDLERS.get(type(op))
    if found is None:
        raise TypeError(f"{type(op).__name__} is not an engine operation (engine/operations.py)")
    return found


def answer(scheduler: Scheduler, op: ops.Operation[R]) -> R:
    """``op`` answered by its handler, from any thread but the scheduler loop's."""
    h = handler(op)
    if h.caller_thread:
        return cast(R, h.fn(scheduler, op))
    return cast(R, in_loop(scheduler, lambda s: h.fn(s, op), op.answer_within()))


def in_loop(scheduler: Scheduler, fn: Callable[[Scheduler], R], timeout: float | None) -> R:
    """From any thread but the loop's: ``fn(scheduler)`` on the loop, between two steps."""
    return cast(R, scheduler.inbox.put_call(fn).result(timeout))


# --- the cache: figures and events -----------------------------------------------------------
@handles(ops.GetCacheStats)
def get_cache_stats(s: Scheduler, op: ops.GetCacheStats) -> CacheStats:
    return cache_stats(s)


@handles(ops.KvBlockChanges)
def block_changes(s: Scheduler, op: ops.KvBlockChanges) -> BlockChanges:
    return kv_block_changes(s, op.block_size, op.salt_key, op.reset)


def event_log(s: Scheduler) -> CacheEventLog:
    """Any thread but the loop's: the event log, attached on the loop the first time."""
    log = s.event_log
    if log is not None:
        return log
    return in_loop(s, cache_admin.event_log, ops.CALL_TIMEOUT_S)


@handles(ops.EventsLastSeq, caller_thread=True)
def events_last_seq(s: Scheduler, op: ops.EventsLastSeq) -> int:
    return event_log(s).last_seq


@handles(ops.EventsFirstSeq, caller_thread=True)
def events_first_seq(s: Scheduler, op: ops.EventsFirstSeq) -> int:
    return event_log(s).first_seq


@handles(ops.EventsSince, caller_thread=True)
def events_since(s: Scheduler, op: ops.EventsSince) -> list[CacheEvent]:
    return event_log(s).since(op.seq, op.limit)


@handles(ops.EventsMissed, caller_thread=True)
def events_missed(s: Scheduler, op: ops.EventsMissed) -> int:
    return event_log(s).missed(op.seq)


@handles(ops.EventsWaitFor, caller_thread=True)
def events_wait_for(s: Scheduler, op: ops.EventsWaitFor) -> bool:
    return event_log(s).wait_for(op.seq, op.timeout)


# --- the cache: admin operations -------------------------------------------------------------
@handles(ops.MatchPrefix)
def match_prefix(s: Scheduler, op: ops.MatchPrefix) -> MatchInfo:
    return cache_admin.match_prefix(s, op.key, op.namespace)


@handles(ops.Evict)
def evict(s: Scheduler, op: ops.Evict) -> EvictInfo:
    return cache_admin.evict(
        s,
        op.tier,
        num_tokens=op.num_tokens,
        prefix=op.prefix,
        namespace=op.namespace,
        dry_run=op.dry_run,
        namespaces=op.namespaces,
    )


@handles(ops.PinPrefix)
def pin(s: Scheduler, op: ops.PinPrefix) -> Pin | None:
    return cache_admin.pin(s, op.key, op.namespace, op.ttl_s, owner=op.owner)


@handles(ops.Unpin)
def unpin(s: Scheduler, op: ops.Unpin) -> tuple[int, int]:
    return cache_admin.unpin(s, op.pin_id, op.owner)


@handles(ops.PinSummary)
def pin_summary(s: Scheduler, op: ops.PinSummary) -> tuple[int, int]:
    return cache_admin.pin_summary(s)


@handles(ops.Flush)
def flush(s: Scheduler, op: ops.Flush) -> FlushInfo:
    return cache_admin.flush(s, op.tiers)


@handles(ops.FlushNamespaces)
def flush_namespaces(s: Scheduler, op: ops.FlushNamespaces) -> FlushInfo:
    return tenant_cache.flush(s, op.namespaces, op.tiers, op.owner)


@handles(ops.InspectTree)
def inspect_tree(s: Scheduler, op: ops.InspectTree) -> tuple[list[NodeInfo], int]:
    return cache_admin.inspect_tree(s, op.offset, op.limit, op.preview_tokens, op.namespaces)


# --- tenants ---------------------------------------------------------------------------------
@handles(ops.ApplyQuotas)
def apply_quotas(s: Scheduler, op: ops.ApplyQuotas) -> None:
    tenant_cache.apply_quotas(s, op.quotas)


@handles(ops.GetTenantView)
def tenant_view(s: Scheduler, op: ops.GetTenantView) -> TenantView:
    return tenant_cache.tenant_view(s, op.tenant, op.namespaces)


@handles(ops.GetTenantFigures)
def tenant_figures(s: Scheduler, op: ops.GetTenantFigures) -> dict[str, dict[str, dict[str, int]]]:
    return tenant_cache.tenant_figures(s, op.quotas)


# --- L3 at run time --------------------------------------------------------------------------
@handles(ops.GetStorageInfo)
def storage_info(s: Scheduler, op: ops.GetStorageInfo) -> dict[str, Any]:
    return cache_admin.storage_info(s)


@handles(ops.AttachStorage, caller_thread=True)
def attach_storage(s: Scheduler, op: ops.AttachStorage) -> dict[str, Any]:
    """The backend is built here (a directory scan may take a while), attached on the loop
    between steps; the engine's options then name it."""
    return cache_admin.build_and_attach_storage(
        s.args,
        s.tree_cache,
        lambda fn: in_loop(s, fn, ops.STATS_TIMEOUT_S),
        op.backend,
        op.url,
        op.directory,
    )


@handles(ops.DetachStorage, caller_thread=True)
def detach_storage(s: Scheduler, op: ops.DetachStorage) -> dict[str, Any]:
    """Pending backups and prefetches finish first (L3Tier.detach_storage); answers what was
    attached."""
    return in_loop(s, lambda s: cache_admin.detach_storage(s, op.timeout), op.answer_within())


# --- the engine itself -----------------------------------------------------------------------
@handles(ops.GetModelInfo, caller_thread=True)
def model_info(s: Scheduler, op: ops.GetModelInfo) -> dict[str, Any]:
    return s.runner.model_info()


@handles(ops.GetServerArgs, caller_thread=True)
def server_args(s: Scheduler, op: ops.GetServerArgs) -> ServerArgs:
    return s.args


@handles(ops.InScheduler)
def in_scheduler(s: Scheduler, op: ops.InScheduler) -> Any:
    return op.fn(s)
