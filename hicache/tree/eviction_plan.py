"""The eviction order, and eviction plans: which nodes an eviction from one tier frees, in the
tree's own order, worked out without changing the tree (``hicache.tree.ops.plan_eviction``);
the tree's ``evict_plan`` then frees exactly those nodes through its normal per-node eviction.

The order is the one ``evict`` follows (``evict_in_order``, every tree's eviction loop): a heap of the nodes that are leaves *in the tier* (no
child still holds KV there), smallest ``eviction_priority`` first, a parent joining the heap once
its last child holding the tier is gone:

    root -- A(5) -- B(3) -- C(1)      (priority; every node one page)
                        `-- D(2)
    everything: C, D, B, A            one page's worth: C       two pages' worth: C, D

Nodes that are not candidates (locked, or not evictable from the tier) but hold the tier keep
their parent from ever becoming a leaf, as in the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.tree.node import TreeNode


class StalePlanError(RuntimeError):
    """The tree changed since the plan was made; nothing was evicted."""


@dataclass(frozen=True)
class EvictionPlan:
    """What an eviction from ``tier`` frees: ``nodes`` in eviction order (leaves first),
    ``tokens`` the tier's tokens they hold, made at tree ``version``."""

    tier: str
    nodes: tuple[TreeNode, ...]
    tokens: int
    version: int


def eviction_order(
    candidates: Iterable[TreeNode],
    holds: Callable[[TreeNode], bool],
    priority: Callable[[TreeNode], Any],
    num_tokens: int | None,
) -> list[TreeNode]:
    """The candidates an eviction of ``num_tokens`` (None: all) frees, in order: it stops once
    the freed tokens reach ``num_tokens``. ``holds(node)``: the node has KV in the tier."""
    cand = {n.id: n for n in candidates}
    # children still holding the tier: a candidate is a leaf of the tier once none is left
    blocking = {i: sum(1 for c in n.children.values() if holds(c)) for i, n in cand.items()}
    heap = [(priority(n), i, n) for i, n in cand.items() if blocking[i] == 0]
    heapq.heapify(heap)
    order: list[TreeNode] = []
    tokens = 0
    while heap and (num_tokens is None or tokens < num_tokens):
        _, _, node = heapq.heappop(heap)
        order.append(node)
        tokens += len(node.key)
        parent = node.parent
        if parent is not None and parent.id in cand:
            blocking[parent.id] -= 1
            if blocking[parent.id] == 0:
                heapq.heappush(heap, (priority(parent), parent.id, parent))
    return order


def evict_in_order(
    leaves: Iterable[TreeNode],
    is_leaf: Callable[[TreeNode], bool],
    evict_one: Callable[[TreeNode], int],
    priority: Callable[[TreeNode], Any],
    num_tokens: int,
) -> int:
    """Evict ``leaves`` smallest ``priority`` first, a parent joining once it became a leaf,
    until ``num_tokens`` are freed or none is left; returns the tokens freed. ``is_leaf(node)``:
    still evictable now (checked again when popped); ``evict_one(node)``: the tokens it freed
    (0: kept, and its parent does not join)."""
    heap = [(priority(n), n.id, n) for n in leaves]
    heapq.heapify(heap)
    freed = 0
    while freed < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        if not is_leaf(node):
            continue
        parent = node.parent
        n = evict_one(node)
        if not n:
            continue
        freed += n
        if parent is not None and is_leaf(parent):
            heapq.heappush(heap, (priority(parent), parent.id, parent))
    return freed
