"""TierEviction: freeing device (L1) and host (L2) slots of HiRadixCache's tree, a part of its
host tier (``cache.host.eviction``).

    l1  ``evict_device_leaf``  per unlocked device leaf (no device child), in the order of
                        ``HiRadixCache.evict``: a node with a host copy is demoted (only
                        ``value`` dropped); one without is first written to host and demoted
                        under ``write_back`` or when it has host-only children (deleting it
                        would drop them too), else deleted with its host-only descendants
    l2  ``evict_host``  unlocked host-only leaves, smallest ``eviction_priority`` first: host
                        slots freed, the node dropped

``HiRadixCache.evict_plan`` frees a plan's nodes (``hicache.tree.eviction_plan``) through the same
per-node code, with the same events and counters; ``flush_host`` empties L2.
NOTE: a pending prefetch anchors on a node (``host_ref``): neither that node nor an ancestor
is deleted, so the path the read will hang from stays in the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hicache.l2.tree import TierTree
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.tree.eviction_plan import evict_in_order
from hicache.tree.node import TreeNode, device_value, host_value, subtree

if TYPE_CHECKING:
    from hicache.l2.tier import HostTier
    from hicache.l3.tier import L3Tier


class TierEviction:
    """Eviction from ``tree``'s device and host tiers; writes a node to host (``host``) where
    deleting it would break a path."""

    def __init__(
        self, tree: TierTree, allocator: TokenToKVPoolAllocator, host: HostTier, l3: L3Tier
    ) -> None:
        self.tree = tree
        self.allocator = allocator
        self.host = host
        self.host_pool = host.pool
        self.l3 = l3
        self.counters = host.counters

    # ---- l1: device ----------------------------------------------------------------------------
    def device_leaves(self) -> list[TreeNode]:
        """Unlocked device leaves (no device-resident child): device eviction candidates."""
        return [n for n in self.tree.all_nodes() if self.is_device_leaf(n)]

    def is_device_leaf(self, n: TreeNode) -> bool:
        return (
            n is not self.tree.root_node
            and n.value is not None
            and n.lock_ref == 0
            and all(c.value is None for c in n.children.values())
        )

    def _host_protected_below(self, node: TreeNode) -> bool:
        """A pending prefetch anchors on ``node`` or a host-only descendant."""
        return any(d.host_ref > 0 for d in subtree(node))

    def evict_device_leaf(self, node: TreeNode) -> int:
        """Free an unlocked device leaf's device slots: demote it when it has (or, under
        write_back or with host children, gets) a host copy, else delete it with its host-only
        descendants; returns the device tokens freed (0: a prefetch anchors below it, kept)."""
        needs_backup = self.host.write_policy == "write_back" or bool(node.children)
        if node.host_value is None and needs_backup and self.host.write_backup(node):
            # synchronous: the device copy must be read before its slots are freed
            self.host.land_writes()
        if node.host_value is not None:
            return self._demote(node)
        if self._host_protected_below(node):
            return 0
        return self._delete_subtree(node)

    def _demote(self, node: TreeNode) -> int:
        num = len(node.key)
        self.allocator.free(device_value(node))
        self.tree.drop_value(node)
        self.tree.evicted_tokens += num
        self.counters["demotions"] += num
        self.tree.emit("demoted", "l2", num, node)
        return num

    def _delete_subtree(self, node: TreeNode) -> int:
        """Delete an unlocked device leaf and its host-only descendants; returns device tokens."""
        for d in subtree(node)[1:]:
            if d.host_value is not None:
                self.host_pool.free(d.host_value)
                self.tree.set_host(d, None)
                self.tree.emit("removed", "l2", len(d.key), d)
        node.children = {}
        return self.tree.evict_leaf(node)

    # ---- l2: host ------------------------------------------------------------------------------
    def evict_host(self, num_tokens: int) -> int:
        """LRU over host-only leaves with no lock: free their host slots and drop them."""
        self.host.check()
        if num_tokens <= 0:
            return 0
        freed = evict_in_order(
            [n for n in self.tree.all_nodes() if self.is_host_leaf(n)],
            self.is_host_leaf,
            self.evict_host_leaf,
            self.tree.eviction_priority,
            num_tokens,
        )
        self.counters["host_evictions"] += freed
        return freed

    def evict_host_leaf(self, node: TreeNode) -> int:
        """Free a host-only leaf's host slots and drop it; returns the tokens freed."""
        self.host_pool.free(host_value(node))
        self.tree.set_host(node, None)
        self.tree.delete_leaf(node)
        self.tree.emit("removed", "l2", len(node.key), node)
        return len(node.key)

    def is_host_leaf(self, n: TreeNode) -> bool:
        return (
            n is not self.tree.root_node
            and n.value is None
            and n.host_value is not None
            and not n.children
            and n.lock_ref == 0
            and n.host_ref == 0
        )

    # ---- flush -------------------------------------------------------------------------------
    def flush_host(self) -> int:
        """Empty L2 of unlocked KV: every host-only leaf, then the host copy of every unlocked
        device node no prefetch anchors on; returns the host tokens freed."""
        freed = self.evict_host(1 << 62)
        for n in self.tree.all_nodes():
            if (
                n.value is not None
                and n.host_value is not None
                and n.lock_ref == 0
                and n.host_ref == 0
            ):
                self.host_pool.free(n.host_value)
                self.tree.set_host(n, None)
                freed += len(n.key)
        return freed
