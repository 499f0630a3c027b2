"""Cache admin operations over a scheduler's prefix tree (run on the scheduler thread through
`engine.call_in_scheduler(fn)`): side-effect-free match, evict, pin / unpin with TTL, flush,
tree inspection.

Works with any BasePrefixCache: RadixCache (L1 only), ChunkCache (nothing cached, `disable`)
and HiRadixCache (nodes with `host_value`, `evict_host`, L3). Pins live in the scheduler's
PinTable (`scheduler.admin_pins`, made by its constructor); `expire_pins(scheduler, now)` is
meant to run every scheduler step (a step hook).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from hicache.base_prefix_cache import BasePrefixCache
from hicache.l3_tier import StorageBusyError
from hicache.radix_cache import TreeNode
from hicache.tier import MEMORY_TIERS, TIERS


class NotIdleError(RuntimeError):
    """The operation needs an idle scheduler (nothing running or waiting)."""


class TierUnavailableError(RuntimeError):
    """The tier is not configured in this engine."""


class MatchInfo(NamedTuple):
    matched_tokens: int
    per_tier: dict[str, int]  # tier -> matched tokens served from it
    page_size: int


class EvictInfo(NamedTuple):
    evicted_tokens: int
    evicted_nodes: int


class FlushInfo(NamedTuple):
    flushed: list[str]
    freed_tokens: int
    unpinned: int


class NodeInfo(NamedTuple):
    node_id: int
    parent_id: int
    depth: int
    token_length: int
    prefix_length: int
    preview_ids: list[int]
    residency: list[str]
    lock_ref: int
    pinned: bool
    hit_count: int
    last_access_time: float
    num_children: int


@dataclass
class Pin:
    pin_id: str
    node: Any
    tokens: int
    expires_at: float | None  # time.monotonic(); None = until unpinned
    owner: str | None = None  # the tenant that made it; None = the admin / a single user


class PinTable:
    """Admin pins: each holds one inc_lock_ref on a tree node until unpinned or expired."""

    def __init__(self) -> None:
        self.pins: dict[str, Pin] = {}
        self._ids = itertools.count(1)

    def new_id(self) -> str:
        return f"pin-{next(self._ids)}"

    def pinned_tokens(self) -> int:
        return sum(p.tokens for p in self.pins.values())

    def pinned_node_ids(self) -> set[int]:
        return {p.node.id for p in self.pins.values()}


def pin_table(scheduler: Any) -> PinTable:
    return scheduler.admin_pins


def pin_summary(scheduler: Any) -> tuple[int, int]:
    """(number of pins, tokens they pin)."""
    table = pin_table(scheduler)
    return len(table.pins), table.pinned_tokens()


# --- walking the tree without side effects ---------------------------------------------------
def _ns_key(scheduler: Any, key: list[int], namespace: str | None) -> tuple[list[int], int]:
    """The key as the tree stores it for this namespace, and how many tokens the namespace
    prepends. The scheduler's (or the tree's) `namespace_key(key, namespace)` defines it."""
    fn = getattr(scheduler, "namespace_key", None) or scheduler.tree_cache.key_of
    full = list(fn(list(key), namespace))
    return full, len(full) - len(key)




def _node_tier(node: TreeNode) -> str | None:
    if node.value is not None:
        return "l1"
    if node.host_value is not None:
        return "l2"
    return None


def _walk(tree: BasePrefixCache, key: list[int]) -> tuple[list[tuple[TreeNode, int]], int]:
    """The matched path of a tree key (namespace already folded in) as (node, matched tokens of
    it); the last node may match partially. Reads children and keys only: no split, no
    access-time update."""
    page = tree.page_size
    key = key[: len(key) // page * page]
    path: list[tuple[TreeNode, int]] = []
    node, pos = tree.root_node, 0
    while pos < len(key):
        child = node.children.get(tuple(key[pos : pos + page]))
        if child is None or _node_tier(child) is None:
            break
        ckey, n = child.key, min(len(child.key), len(key) - pos)
        i = 0
        while i < n and ckey[i] == key[pos + i]:
            i += 1
        i = i // page * page
        if i == 0:
            break
        path.append((child, i))
        pos += i
        if i < len(ckey):
            break
        node = child
    return path, len(key)


def match_prefix(scheduler: Any, key: list[int], namespace: str | None = None) -> MatchInfo:
    tree = scheduler.tree_cache
    per_tier = dict.fromkeys(TIERS, 0)
    if tree.disable:
        return MatchInfo(0, per_tier, scheduler.page_size)
    full, skip = _ns_key(scheduler, key, namespace)
    path, _ = _walk(tree, full)
    for node, n in path:
        drop = min(skip, n)  # the namespace's own tokens are not part of the prompt
        skip -= drop
        tier = _node_tier(node)
        assert tier is not None, "a matched node holds its KV in L1 or L2"
        per_tier[tier] += n - drop
    # L3 holds whole objects from the root; count what it adds beyond L1 + L2
    matched = per_tier["l1"] + per_tier["l2"]
    per_tier["l3"] = max(0, tree.storage_prefix_len(list(key), namespace) - matched)
    return MatchInfo(sum(per_tier.values()), per_tier, tree.page_size)


def namespace_roots(tree: BasePrefixCache, namespaces: frozenset[str] | None) -> list[TreeNode]:
    """The root's children whose keys are in one of `namespaces` (None: all of them). A
    namespace is folded into every token of a key, so each subtree belongs to one namespace."""
    children = list(tree.root_node.children.values())
    if namespaces is None:
        return children
    return [c for c in children if tree.split_key(tuple(c.key[:1]))[0] in namespaces]


def namespace_nodes(tree: BasePrefixCache, namespaces: frozenset[str] | None) -> list[TreeNode]:
    """Every node of `namespaces` (None: the whole tree, root included)."""
    if namespaces is None:
        return _subtree(tree.root_node)
    return [n for c in namespace_roots(tree, namespaces) for n in _subtree(c)]


def _subtree(node: TreeNode) -> list[TreeNode]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


# --- eviction --------------------------------------------------------------------------------
def _evict_fn(tree: BasePrefixCache, tier: str) -> Callable[[int], int]:
    if tier == "l1":
        return tree.evict
    if tier == "l2" and tree.has_host_tier():
        return tree.evict_host
    raise TierUnavailableError(f"tier {tier} is not enabled in this engine")


def held(node: TreeNode, tier: str) -> bool:
    """Does the node hold its KV in this tier (l1: device, l2: host)?"""
    return (node.value if tier == "l1" else node.host_value) is not None


def _simulate_evict(
    tree: BasePrefixCache, tier: str, num_tokens: int, nodes: list[TreeNode]
) -> tuple[EvictInfo, list[TreeNode]]:
    """What evict(num_tokens) would free among `nodes`, leaves first, in the tree's order; and
    the nodes it would free."""
    cand = {
        n.id: n for n in nodes if n is not tree.root_node and n.lock_ref == 0 and held(n, tier)
    }
    kids = {i: sum(1 for c in n.children.values() if c.id in cand) for i, n in cand.items()}
    prio = tree.eviction_priority
    heap = [(prio(n), n.id, n) for i, n in cand.items() if kids[i] == 0]
    heapq.heapify(heap)
    tokens = 0
    chosen: list[TreeNode] = []
    while heap and tokens < num_tokens:
        _, _, n = heapq.heappop(heap)
        tokens += len(n.key)
        chosen.append(n)
        p = n.parent
        if p is not None and p.id in cand:
            kids[p.id] -= 1
            if kids[p.id] == 0:
                heapq.heappush(heap, (prio(p), p.id, p))
    return EvictInfo(tokens, len(chosen)), chosen


def evict(
    scheduler: Any,
    tier: str = "l1",
    num_tokens: int | None = None,
    prefix: list[int] | None = None,
    namespace: str | None = None,
    dry_run: bool = False,
    namespaces: frozenset[str] | None = None,
    settle_first: bool = True,
) -> EvictInfo:
    """Evicts >= num_tokens (None with no prefix = everything evictable), or every unlocked
    sequence that starts with `prefix`. Locked (running / pinned) nodes are never evicted.
    `namespaces` confines it to those namespaces' nodes (a tenant's). `settle_first`: wait for
    in-flight copies first, so nodes locked only by a backup can go too."""
    tree = scheduler.tree_cache
    if tier == "l3":
        raise TierUnavailableError("eviction from l3 is not supported; use Flush")
    if settle_first:
        settle(tree)
    if tree.disable:
        return EvictInfo(0, 0)
    evict_fn = _evict_fn(tree, tier)
    if prefix is not None:
        path, key_len = _walk(tree, _ns_key(scheduler, prefix, namespace)[0])
        if not path or sum(n for _, n in path) < key_len:
            return EvictInfo(0, 0)  # nothing cached starts with the whole prefix
        nodes = _subtree(path[-1][0])
    else:
        nodes = namespace_nodes(tree, namespaces)
    plan, chosen = _simulate_evict(
        tree, tier, num_tokens if num_tokens is not None else 1 << 62, nodes
    )
    if dry_run or plan.evicted_tokens == 0:
        return plan
    if prefix is None and namespaces is None:
        return EvictInfo(evict_fn(plan.evicted_tokens), plan.evicted_nodes)
    # NOTE: the chosen nodes become the least valuable ones for this one call, so evict() takes
    # them first and stops once their tokens are freed; whichever survive (an L1 eviction
    # demotes to L2) get their own order back.
    saved = [(n, n.last_access_time, n.hit_count) for n in chosen]
    for n in chosen:
        n.last_access_time, n.hit_count = -1, -1
    try:
        freed = evict_fn(plan.evicted_tokens)
    finally:
        for n, t, h in saved:
            n.last_access_time, n.hit_count = t, h
    return EvictInfo(freed, plan.evicted_nodes)


def settle(tree: BasePrefixCache, timeout: float = 30.0) -> None:
    """Lets in-flight tier copies finish and be acknowledged, so nodes locked only by a
    backup become evictable (HiRadixCache); a no-op for L1-only trees."""
    tree.settle(timeout)


# --- pins ------------------------------------------------------------------------------------
def pin(
    scheduler: Any,
    key: list[int],
    namespace: str | None = None,
    ttl_s: float = 0.0,
    now: float | None = None,
    owner: str | None = None,
) -> Pin | None:
    """Locks the cached (L1) prefix of key; None when nothing of it is cached on L1."""
    tree = scheduler.tree_cache
    if tree.disable:
        return None
    full, skip = _ns_key(scheduler, key, namespace)
    path, _ = _walk(tree, full)
    l1 = sum(n for node, n in path if _node_tier(node) == "l1")
    if l1 <= skip:
        return None
    # match_prefix splits the last node so that the lock covers the prefix exactly. NOTE: `full`
    # is the tree's key already (namespace folded in): matched without a namespace.
    res = tree.match_prefix(full[:l1])
    node = res.last_device_node
    tree.inc_lock_ref(node)
    table = pin_table(scheduler)
    now = time.monotonic() if now is None else now
    p = Pin(
        table.new_id(),
        node,
        len(res.device_indices) - skip,
        now + ttl_s if ttl_s > 0 else None,
        owner,
    )
    table.pins[p.pin_id] = p
    return p


def unpin(
    scheduler: Any, pin_id: str | None = None, owner: str | None = None
) -> tuple[int, int]:
    """Releases one pin (or all with pin_id=None); returns (pins released, tokens). With an
    owner (a tenant) only that owner's pins are seen."""
    table = pin_table(scheduler)
    ids = list(table.pins) if pin_id is None else [pin_id] if pin_id in table.pins else []
    if owner is not None:
        ids = [i for i in ids if table.pins[i].owner == owner]
    tokens = 0
    for i in ids:
        p = table.pins.pop(i)
        scheduler.tree_cache.dec_lock_ref(p.node)
        tokens += p.tokens
    return len(ids), tokens


def expire_pins(scheduler: Any, now: float | None = None) -> int:
    """Releases the pins whose TTL has passed; returns how many."""
    table = pin_table(scheduler)
    if not table.pins:
        return 0
    now = time.monotonic() if now is None else now
    expired = [i for i, p in table.pins.items() if p.expires_at is not None and p.expires_at <= now]
    for i in expired:
        unpin(scheduler, i)
    return len(expired)


# --- flush -----------------------------------------------------------------------------------
def tier_enabled(tree: BasePrefixCache, tier: str) -> bool:
    if tier == "l1":
        return True
    if tier == "l2":
        return tree.has_host_tier()
    return tree.has_storage()


def check_storage_idle(tree: BasePrefixCache, tiers: list[str]) -> None:
    """Raises StorageBusyError, before anything changes, when a flush of L3 would have to wait
    for L3 work in flight (a stalled store must not hold the scheduler thread; the caller
    retries until its own deadline)."""
    if "l3" in tiers and tree.storage_busy():
        raise StorageBusyError("L3 backups / prefetches are in flight; nothing was flushed")


def flush_tiers(tree: BasePrefixCache, tiers: list[str] | None) -> list[str]:
    """The tiers a flush empties (None = every enabled one); TierUnavailableError for one that
    is not enabled."""
    wanted = [t for t in TIERS if tier_enabled(tree, t)] if not tiers else list(tiers)
    for t in wanted:
        if not tier_enabled(tree, t):
            raise TierUnavailableError(f"tier {t} is not enabled in this engine")
    return wanted


def flush(scheduler: Any, tiers: list[str] | None = None) -> FlushInfo:
    """Empties the chosen tiers (None = every enabled tier). Needs an idle scheduler; otherwise
    raises NotIdleError before changing anything. Pins are released first."""
    if not scheduler.is_idle():
        raise NotIdleError("requests are running or waiting")
    tree = scheduler.tree_cache
    wanted = flush_tiers(tree, tiers)
    if tree.disable:
        return FlushInfo(wanted, 0, 0)
    check_storage_idle(tree, wanted)
    unpinned, _ = unpin(scheduler)
    freed = 0
    for t in wanted:
        freed += tree.flush_tier(t)
        log = scheduler.event_log
        if log is not None:
            log.emit("cleared", t, 0)
    return FlushInfo(wanted, freed, unpinned)


# --- inspection ------------------------------------------------------------------------------
def inspect_tree(
    scheduler: Any,
    offset: int = 0,
    limit: int = 100,
    preview_tokens: int = 16,
    namespaces: frozenset[str] | None = None,
) -> tuple[list[NodeInfo], int]:
    """One page of the tree in depth-first order (parents first); returns (nodes, total).
    `namespaces` shows only those namespaces' nodes (a tenant's view)."""
    tree = scheduler.tree_cache
    if tree.disable:
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
        residency = [t for t in MEMORY_TIERS if held(node, t)]
        if tree.node_in_storage(node):
            residency.append("l3")
        parent = node.parent
        out.append(
            NodeInfo(
                node.id,
                parent.id if parent is not None else 0,
                depth,
                len(node.key),
                plen,
                tree.split_key(tuple(node.key[:preview_tokens]))[1],
                residency,
                node.lock_ref,
                node.id in pinned,
                node.hit_count,
                float(node.last_access_time),
                len(node.children),
            )
        )
    return out, len(order)
