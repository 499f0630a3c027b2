"""The operations admin and tenant quotas do to a radix tree (RadixCache, HiRadixCache), over
the tree's own methods (``holds``, ``eviction_candidates``, ``evict_plan``, locks), so
that nothing outside the tree re-derives its order or steers it:

    walk         ``walk(tree, key)``: the cached path of a key, per node its fastest tier
    scope        ``subtree(node)``, ``namespace_roots`` / ``namespace_nodes`` (a tenant's)
    plan, evict  ``plan_eviction``: what evicting from a tier frees, in the tree's order, changing
                 nothing; the tree's ``evict_plan`` then frees exactly that plan
    lock         ``lock_prefix`` / ``unlock_prefix``: the device part of a key's prefix (pins)
    flush        ``flush_tier``: empty one tier of unlocked KV

NOTE: read-only walks and plans never split a node or touch access times / hit counts, so
looking at the cache never changes what it evicts next. A namespace is folded into every token
of a key (``TreeKeys.key_of``), so each child of the root has one namespace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from hicache.tier import MEMORY_TIERS, Tier
from hicache.tree.eviction_plan import EvictionPlan, eviction_order
from hicache.tree.node import TreeNode, subtree
from hicache.tree.radix import RadixCache

if TYPE_CHECKING:
    from hicache.tree.base import BasePrefixCache

__all__ = [
    "PathStep",
    "PrefixLock",
    "flush_tier",
    "lock_prefix",
    "namespace_nodes",
    "namespace_roots",
    "plan_eviction",
    "radix_tree",
    "subtree",
    "unlock_prefix",
    "walk",
]


class PathStep(NamedTuple):
    """One node of a walked path (``walk``)."""

    node: TreeNode
    tokens: int  # tokens of node.key the key matches (page-aligned; only the last step < all)
    tier: str  # the fastest memory tier holding the node's KV: "l1" or "l2"


@dataclass(frozen=True)
class PrefixLock:
    """A lock on the device-cached prefix of a key (``lock_prefix``)."""

    node: TreeNode  # locked with its ancestors until ``unlock_prefix``
    tokens: int  # tree-key tokens the lock keeps on device


def radix_tree(cache: BasePrefixCache) -> RadixCache | None:
    """The radix tree the tree operations work on; None for a cache that shares nothing
    (ChunkCache, a disabled tree): nothing of it is cached, evictable or lockable."""
    return cache if isinstance(cache, RadixCache) and not cache.disable else None


def walk(tree: RadixCache, key: Sequence[int]) -> list[PathStep]:
    """The cached path of a tree key (``tree.keys.key_of``: the namespace folded in),
    page-aligned; it ends at the first node with its KV in no memory tier."""
    keys = tree.keys
    aligned = keys.align(tuple(key))
    path: list[PathStep] = []
    node, pos = tree.root_node, 0
    while pos < len(aligned):
        child = node.children.get(keys.page_key(aligned[pos:]))
        if child is None:
            break
        tier = next((t for t in MEMORY_TIERS if tree.holds(child, t)), None)
        if tier is None:
            break
        matched = keys.match_len(child.key, aligned[pos:])  # >= a page: the child's key
        path.append(PathStep(child, matched, tier))
        pos += matched
        if matched < len(child.key):
            break
        node = child
    return path


def namespace_roots(tree: RadixCache, namespaces: frozenset[str] | None) -> list[TreeNode]:
    """The root's children whose keys are in one of ``namespaces`` (None: all of them)."""
    children = list(tree.root_node.children.values())
    if namespaces is None:
        return children
    return [c for c in children if tree.keys.split_key(tuple(c.key[:1]))[0] in namespaces]


def namespace_nodes(tree: RadixCache, namespaces: frozenset[str] | None) -> list[TreeNode]:
    """Every node of ``namespaces`` (None: the whole tree, the root included)."""
    if namespaces is None:
        return subtree(tree.root_node)
    return [n for c in namespace_roots(tree, namespaces) for n in subtree(c)]


def plan_eviction(
    tree: RadixCache,
    tier: str,
    num_tokens: int | None = None,
    within: Sequence[TreeNode] | None = None,
) -> EvictionPlan:
    """What evicting ``num_tokens`` (None: everything evictable) from ``tier`` would free,
    among ``within`` (None: the whole tree), in the tree's order; changes nothing."""
    nodes = subtree(tree.root_node) if within is None else within
    order = eviction_order(
        tree.eviction_candidates(tier, nodes),
        lambda n: tree.holds(n, tier),
        tree.eviction_priority,
        num_tokens,
    )
    return EvictionPlan(tier, tuple(order), sum(len(n.key) for n in order), tree.version)


def lock_prefix(tree: RadixCache, key: Sequence[int], min_tokens: int = 1) -> PrefixLock | None:
    """Lock the device-cached prefix of a tree key, split so that the lock covers exactly it;
    None (nothing locked) when fewer than ``min_tokens`` of it are on device. Matching it
    counts as a use (a hit), as a request's would."""
    device = sum(s.tokens for s in walk(tree, key) if s.tier == Tier.L1)
    if device < max(min_tokens, 1):
        return None
    res = tree.match_prefix(tuple(key[:device]))  # splits the node the prefix ends in
    if len(res.device_indices) < max(min_tokens, 1):
        return None
    tree.inc_lock_ref(res.last_device_node)
    return PrefixLock(res.last_device_node, len(res.device_indices))


def unlock_prefix(tree: BasePrefixCache, lock: PrefixLock) -> None:
    """Release ``lock_prefix``'s lock."""
    tree.dec_lock_ref(lock.node)


def flush_tier(tree: RadixCache, tier: str) -> int:
    """Empty one tier of unlocked KV ("l1": evict every unlocked device leaf, demoting what
    has a host copy; "l2": every unlocked host copy; "l3": clear the store) after the queued
    copies landed; returns the tokens freed (0 for L3: objects are not counted). ValueError
    for a tier the tree does not have."""
    host, l3 = tree.host, tree.l3
    if host is not None:
        host.land_writes()
        host.check()
    if tier == Tier.L1:
        return tree.evict(1 << 62)
    if tier == Tier.L2 and host is not None:
        return host.eviction.flush_host()
    if tier == Tier.L3 and l3 is not None and l3.has_storage():
        return l3.clear_storage()
    raise ValueError(f"tier {tier!r} is not enabled")
