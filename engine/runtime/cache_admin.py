"""Cache admin operations, run on the scheduler thread (the Engine's admin methods, and the
scheduler process' loop, call them there): each translates an admin request (tiers, namespaces,
dry run, a tenant's scope) into the tree operations (``hicache.tree.ops``: ``walk`` /
``plan_eviction`` + the tree's ``evict_plan`` / ``lock_prefix`` / ``flush_tier``) and the tiers'
parts (``tree.host``, ``tree.l3``): a side-effect-free match, eviction by count / prefix /
namespace (a dry run is the same plan unexecuted), pins with a TTL, flush, tree inspection, the
cache's event log, L3 attached and detached at run time.

The records they return and the errors they raise are the engine boundary's
(engine/admin_records.py, engine/errors.py, hicache/errors.py): they reach the API server as
they are (EngineFront, engine/front.py).

Works with any BasePrefixCache: RadixCache (L1 only), ChunkCache (nothing cached: no radix tree,
``ops.radix_tree``) and HiRadixCache (L2, L3). Pins are kept in the scheduler's PinTable (``admin_pins``); the
scheduler expires them every step (``expire_pins``, a step hook its constructor registers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from engine.admin_records import EvictInfo, FlushInfo, MatchInfo, NodeInfo, Pin
from engine.config import ServerArgs
from engine.errors import NotIdleError, TierUnavailableError
from engine.runtime import hicache_setup
from engine.runtime.pins import PinTable
from hicache.errors import StorageBusyError
from hicache.observe.events import CacheEventLog
from hicache.tier import MEMORY_TIERS, TIERS
from hicache.tree.base import BasePrefixCache
from hicache.tree.node import TreeNode
from hicache.tree.ops import (
    flush_tier,
    lock_prefix,
    namespace_nodes,
    namespace_roots,
    plan_eviction,
    radix_tree,
    subtree,
    walk,
)
from hicache.tree.radix import RadixCache

if TYPE_CHECKING:
    from engine.runtime.scheduler import Scheduler
    from hicache.l3.tier import L3Tier
    from hicache.storage.base import StorageBackend


class AdminScheduler(Protocol):
    """What admin operations use of a scheduler (engine/runtime/scheduler's Scheduler)."""

    tree_cache: BasePrefixCache
    page_size: int
    admin_pins: PinTable
    event_log: CacheEventLog | None

    def is_idle(self) -> bool: ...


def pin_table(scheduler: AdminScheduler) -> PinTable:
    return scheduler.admin_pins


def pin_summary(scheduler: AdminScheduler) -> tuple[int, int]:
    """(number of pins, tokens they pin)."""
    table = pin_table(scheduler)
    return len(table.pins), table.pinned_tokens()


# --- keys and matches ------------------------------------------------------------------------
def _tree_key(tree: RadixCache, key: list[int], namespace: str | None) -> tuple[list[int], int]:
    """The key as the tree stores it for this namespace (``keys.key_of``), and how many tokens
    of it are the namespace's own (a tree that prepends them; none when it folds them in)."""
    full = list(tree.keys.key_of(list(key), namespace))
    return full, len(full) - len(key)


def match_prefix(
    scheduler: AdminScheduler, key: list[int], namespace: str | None = None
) -> MatchInfo:
    """What of ``key`` is cached, per tier, without changing the tree (``walk``)."""
    tree = radix_tree(scheduler.tree_cache)
    per_tier = dict.fromkeys(TIERS, 0)
    if tree is None:
        return MatchInfo(0, per_tier, scheduler.page_size)
    full, skip = _tree_key(tree, key, namespace)
    for step in walk(tree, full):
        drop = min(skip, step.tokens)  # the namespace's own tokens are not part of the prompt
        skip -= drop
        per_tier[step.tier] += step.tokens - drop
    # L3 holds whole objects from the root; count what it adds beyond L1 + L2
    matched = per_tier["l1"] + per_tier["l2"]
    in_l3 = tree.l3.storage_prefix_len(list(key), namespace) if tree.l3 is not None else 0
    per_tier["l3"] = max(0, in_l3 - matched)
    return MatchInfo(sum(per_tier.values()), per_tier, tree.page_size)


# --- eviction --------------------------------------------------------------------------------
def evict(
    scheduler: AdminScheduler,
    tier: str = "l1",
    num_tokens: int | None = None,
    prefix: list[int] | None = None,
    namespace: str | None = None,
    dry_run: bool = False,
    namespaces: frozenset[str] | None = None,
    settle_first: bool = True,
) -> EvictInfo:
    """Evicts >= num_tokens (None = everything evictable), least valuable first, among every
    sequence that starts with `prefix` (in `namespace`), or the nodes of `namespaces` (a
    tenant's), or the whole tree. Locked (running / pinned) nodes are never evicted. The
    tree plans it (``plan_eviction``); a dry run returns the plan, a real one evicts exactly
    its nodes (``evict_plan``). `settle_first`: wait for in-flight copies first, so nodes
    locked only by a backup can go too."""
    if tier == "l3":
        raise TierUnavailableError("eviction from l3 is not supported; use Flush")
    if settle_first:
        settle(scheduler.tree_cache)
    tree = radix_tree(scheduler.tree_cache)
    if tree is None:
        return EvictInfo(0, 0)
    if not tier_enabled(tree, tier):
        raise TierUnavailableError(f"tier {tier} is not enabled in this engine")
    within: list[TreeNode] | None = None
    if prefix is not None:
        full, _ = _tree_key(tree, prefix, namespace)
        path = walk(tree, full)
        if not path or sum(s.tokens for s in path) < len(full) // tree.page_size * tree.page_size:
            return EvictInfo(0, 0)  # nothing cached starts with the whole prefix
        within = subtree(path[-1].node)
    elif namespaces is not None:
        within = namespace_nodes(tree, namespaces)
    plan = plan_eviction(tree, tier, num_tokens, within)
    if dry_run:
        return EvictInfo(plan.tokens, len(plan.nodes))
    return EvictInfo(tree.evict_plan(plan), len(plan.nodes))


def settle(cache: BasePrefixCache, timeout: float = 30.0) -> None:
    """Lets in-flight tier copies finish and be acknowledged, so nodes locked only by a
    backup become evictable; nothing to wait for without a host tier."""
    if cache.host is not None:
        cache.host.settle(timeout)


# --- pins ------------------------------------------------------------------------------------
def pin(
    scheduler: AdminScheduler,
    key: list[int],
    namespace: str | None = None,
    ttl_s: float = 0.0,
    now: float | None = None,
    owner: str | None = None,
) -> Pin | None:
    """Locks the cached (L1) prefix of key; None when nothing of it is cached on L1."""
    tree = radix_tree(scheduler.tree_cache)
    if tree is None:
        return None
    full, skip = _tree_key(tree, key, namespace)
    lock = lock_prefix(tree, full, min_tokens=skip + 1)
    if lock is None:
        return None
    now = time.monotonic() if now is None else now
    return scheduler.admin_pins.add(
        lock, lock.tokens - skip, now + ttl_s if ttl_s > 0 else None, owner
    )


def unpin(
    scheduler: AdminScheduler, pin_id: str | None = None, owner: str | None = None
) -> tuple[int, int]:
    """Releases one pin (or all with pin_id=None); returns (pins released, tokens). With an
    owner (a tenant) only that owner's pins are seen."""
    table = pin_table(scheduler)
    return table.release(scheduler.tree_cache, table.select(pin_id, owner))


def expire_pins(scheduler: AdminScheduler, now: float | None = None) -> int:
    """Releases the pins whose TTL has passed; returns how many (a scheduler step hook)."""
    table = pin_table(scheduler)
    if not table.pins:
        return 0
    expired = table.expired(time.monotonic() if now is None else now)
    return table.release(scheduler.tree_cache, expired)[0]


# --- flush -----------------------------------------------------------------------------------
def tier_enabled(cache: BasePrefixCache, tier: str) -> bool:
    if tier == "l1":
        return True
    if tier == "l2":
        return cache.host is not None
    return cache.l3 is not None and cache.l3.has_storage()


def check_storage_idle(cache: BasePrefixCache, tiers: list[str]) -> None:
    """Raises StorageBusyError, before anything changes, when a flush of L3 would have to wait
    for L3 work in flight (a stalled store must not hold the scheduler thread; the caller
    retries until its own deadline)."""
    if "l3" in tiers and cache.l3 is not None and cache.l3.storage_busy():
        raise StorageBusyError("L3 backups / prefetches are in flight; nothing was flushed")


def flush_tiers(tree: BasePrefixCache, tiers: list[str] | None) -> list[str]:
    """The tiers a flush empties (None = every enabled one); TierUnavailableError for one that
    is not enabled."""
    wanted = [t for t in TIERS if tier_enabled(tree, t)] if not tiers else list(tiers)
    for t in wanted:
        if not tier_enabled(tree, t):
            raise TierUnavailableError(f"tier {t} is not enabled in this engine")
    return wanted


def flush(scheduler: AdminScheduler, tiers: list[str] | None = None) -> FlushInfo:
    """Empties the chosen tiers (None = every enabled tier). Needs an idle scheduler; otherwise
    raises NotIdleError before changing anything. Pins are released first."""
    if not scheduler.is_idle():
        raise NotIdleError("requests are running or waiting")
    wanted = flush_tiers(scheduler.tree_cache, tiers)
    tree = radix_tree(scheduler.tree_cache)
    if tree is None:
        return FlushInfo(wanted, 0, 0)
    check_storage_idle(tree, wanted)
    unpinned, _ = unpin(scheduler)
    freed = 0
    for t in wanted:
        freed += flush_tier(tree, t)
        log = scheduler.event_log
        if log is not None:
            log.emit("cleared", t, 0)
    return FlushInfo(wanted, freed, unpinned)


# --- inspection ------------------------------------------------------------------------------
def inspect_tree(
    scheduler: AdminScheduler,
    offset: int = 0,
    limit: int = 100,
    preview_tokens: int = 16,
    namespaces: frozenset[str] | None = None,
) -> tuple[list[NodeInfo], int]:
    """One page of the tree in depth-first order (parents first); returns (nodes, total).
    `namespaces` shows only those namespaces' nodes (a tenant's view)."""
    tree = radix_tree(scheduler.tree_cache)
    if tree is None:
        return [], 0
    pinned = pin_table(scheduler).pinned_node_ids()
    # NOTE: a namespaced key folds the namespace into every token id; the preview shows tokens.
    order: list[tuple[TreeNode, int, int]] = []  # (node, depth, prefix_len)
    stack = [(c, 1, 0) for c in reversed(namespace_roots(tree, namespaces))]
    while stack:
        node, depth, start = stack.pop()
        order.append((node, depth, start + len(node.key)))
        stack.extend(
            (c, depth + 1, start + len(node.key)) for c in reversed(list(node.children.values()))
        )
    out = []
    for node, depth, plen in order[offset : offset + limit]:
        residency = [t for t in MEMORY_TIERS if tree.holds(node, t)]
        if tree.l3 is not None and tree.l3.node_in_storage(node):
            residency.append("l3")
        parent = node.parent
        out.append(
            NodeInfo(
                node.id,
                parent.id if parent is not None else 0,
                depth,
                len(node.key),
                plen,
                tree.keys.split_key(tuple(node.key[:preview_tokens]))[1],
                residency,
                node.lock_ref,
                node.id in pinned,
                node.hit_count,
                float(node.last_access_time),
                len(node.children),
            )
        )
    return out, len(order)


# --- events ----------------------------------------------------------------------
def event_log(scheduler: AdminScheduler) -> CacheEventLog:
    """The cache's event log; one is attached (to the scheduler and its tree) when the tree
    brought none, so that Flush's ``cleared`` events are still observable."""
    if scheduler.event_log is None:
        scheduler.event_log = CacheEventLog()
        if scheduler.tree_cache.event_log is None:
            scheduler.tree_cache.event_log = scheduler.event_log
    return scheduler.event_log


# --- L3 at run time --------------------------------------------------------------------------
def storage_info(scheduler: AdminScheduler) -> dict[str, Any]:
    """The attached L3 backend: {"attached": False}, or its ``describe()`` plus "attached",
    "object_tokens", "pending" (backups + prefetches in flight)."""
    l3 = scheduler.tree_cache.l3
    return l3.storage_info() if l3 is not None else {"attached": False}


def build_and_attach_storage(
    args: ServerArgs,
    cache: BasePrefixCache,
    in_scheduler: Callable[[Callable[[Scheduler], dict[str, Any]]], dict[str, Any]],
    backend: str,
    url: str | None,
    directory: str | None,
) -> dict[str, Any]:
    """Any thread but the scheduler's: build the backend ``backend`` / ``url`` / ``directory``
    name for ``cache`` (a directory scan may take a while), then attach it on the scheduler
    thread (``in_scheduler(fn)``: ``fn(scheduler)`` there, between two steps). Returns
    ``storage_info``; the backend is closed when it cannot be attached."""
    storage = hicache_setup.build_storage_for(args, cache, backend, url, directory)
    try:
        return in_scheduler(lambda s: attach_storage(s, storage, backend, url, directory))
    except BaseException:
        hicache_setup.close_storage(storage)
        raise


def attach_storage(
    scheduler: Scheduler,
    storage: StorageBackend,
    backend: str,
    url: str | None,
    directory: str | None,
) -> dict[str, Any]:
    """Use ``storage`` (built off this thread: ``build_and_attach_storage``, which closes it
    when this raises) as L3 from now on (none may be attached); the options record it.
    Returns ``storage_info``."""
    a = scheduler.args
    object_size = a.hicache_storage_page_size
    assert object_size is not None, "ServerArgs derives it from page_size when not given"
    _l3_of(scheduler.tree_cache).attach_storage(storage, object_size)
    a.hicache_storage_backend = backend
    a.hicache_storage_url = url if backend == "redis" else None
    a.hicache_storage_dir = directory if backend == "file" else a.hicache_storage_dir
    return storage_info(scheduler)


def detach_storage(scheduler: Scheduler, timeout: float) -> dict[str, Any]:
    """Stop using L3 (pending backups and prefetches finish first, at most ``timeout``: see
    ``L3Tier.detach_storage``) and close the backend. Returns ``storage_info`` before."""
    l3 = _l3_of(scheduler.tree_cache)
    before = l3.storage_info()
    hicache_setup.close_storage(l3.detach_storage(timeout))
    scheduler.args.hicache_storage_backend = None
    return before


def _l3_of(cache: BasePrefixCache) -> L3Tier:
    if cache.l3 is None:
        raise TierUnavailableError("L3 needs the hierarchical cache (enable_hierarchical_cache)")
    return cache.l3
