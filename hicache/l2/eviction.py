"""TierEviction: freeing device (L1) and host (L2) slots of HiRadixCache's tree, part of it.

    l1  ``evict``       unlocked device leaves (no device child), smallest
                        ``eviction_priority`` first: a node with a host copy is demoted (only
                        ``value`` dropped); one without is first written to host and demoted
                        under ``write_back`` or when it has host-only children (deleting it
                        would drop them too), else deleted with its host-only descendants
    l2  ``evict_host``  unlocked host-only leaves: host slots freed, the node dropped

``evict_plan`` frees a plan's nodes (``hicache.tree.eviction_plan``) through the same per-node code,
with the same events and counters; ``flush_tier`` empties a tier.
NOTE: a pending prefetch anchors on a node (``host_ref``): neither that node nor an ancestor
is deleted, so the path the read will hang from stays in the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from hicache.l2.copies import HostCopies
from hicache.l2.tree import TierTree
from hicache.l3.tier import L3Tier
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.tier import TIERS
from hicache.transfer.controller import HiCacheController
from hicache.tree.eviction_plan import EvictionPlan
from hicache.tree.node import TreeNode, device_value, host_value


class TierEviction:
    """Eviction from ``tree``'s device and host tiers; writes a node to host (``copies``)
    where deleting it would break a path."""

    def __init__(
        self,
        tree: TierTree,
        allocator: TokenToKVPoolAllocator,
        host_pool: MHATokenToKVPoolHost,
        controller: HiCacheController,
        copies: HostCopies,
        l3: L3Tier,
        counters: dict[str, int],
        write_policy: str,
    ) -> None:
        self.tree = tree
        self.allocator = allocator
        self.host_pool = host_pool
        self.controller = controller
        self.copies = copies
        self.l3 = l3
        self.counters = counters
        self.write_policy = write_policy

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
        return any(d.host_ref > 0 for d in self.tree.subtree(node))

    def evict(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` device slots if possible: backed-up leaves are demoted to host,
        the rest deleted (write_back, or leaves with host children: backed up first)."""
        self.tree.check()
        if self.tree.disable or num_tokens <= 0:
            return 0
        heap = [(self.tree.eviction_priority(n), n.id, n) for n in self.device_leaves()]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self.is_device_leaf(node):
                continue
            parent = node.parent
            freed = self.evict_device_leaf(node)
            if not freed:
                continue  # deleting would drop a waiting request's prefetch anchor
            num_evicted += freed
            if parent is not None and self.is_device_leaf(parent):
                heapq.heappush(heap, (self.tree.eviction_priority(parent), parent.id, parent))
        self.counters["evictions"] += num_evicted
        if num_evicted < num_tokens and self.copies.writes_in_flight():
            # NOTE: in-flight writes lock their nodes; let them land, then try again.
            self.copies.land_writes()
            num_evicted += self.evict(num_tokens - num_evicted)
        return num_evicted

    def evict_device_leaf(self, node: TreeNode) -> int:
        """Free an unlocked device leaf's device slots: demote it when it has (or, under
        write_back or with host children, gets) a host copy, else delete it with its host-only
        descendants; returns the device tokens freed (0: a prefetch anchors below it, kept)."""
        needs_backup = self.write_policy == "write_back" or bool(node.children)
        if node.host_value is None and needs_backup and self.copies.write_backup(node):
            # synchronous: the device copy must be read before its slots are freed
            self.copies.land_writes()
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
        for d in self.tree.subtree(node)[1:]:
            if d.host_value is not None:
                self.host_pool.free(d.host_value)
                self.tree.set_host(d, None)
                self.tree.emit("removed", "l2", len(d.key), d)
        node.children = {}
        return self.tree.evict_leaf(node)

    # ---- l2: host ------------------------------------------------------------------------------
    def evict_host(self, num_tokens: int) -> int:
        """LRU over host-only leaves with no lock: free their host slots and drop them."""
        self.tree.check()
        if num_tokens <= 0:
            return 0
        heap = [
            (self.tree.eviction_priority(n), n.id, n)
            for n in self.tree.all_nodes()
            if self.is_host_leaf(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self.is_host_leaf(node):
                continue
            parent = node.parent
            freed += self.evict_host_leaf(node)
            if parent is not None and self.is_host_leaf(parent):
                heapq.heappush(heap, (self.tree.eviction_priority(parent), parent.id, parent))
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

    # ---- plans (see BasePrefixCache.plan_eviction / evict_plan) --------------------------------
    def candidates(self, tier: str, nodes: Sequence[TreeNode]) -> list[TreeNode]:
        """l1: unlocked device nodes, but not one without a host copy that anchors a pending
        prefetch on or below it (``evict`` keeps it unless a backup happens to fit then, which
        a plan cannot know); l2: unlocked host-only nodes no prefetch anchors on."""
        root = self.tree.root_node
        if tier == "l2":
            return [
                n
                for n in nodes
                if n.value is None
                and n.host_value is not None
                and n.lock_ref == 0
                and n.host_ref == 0
                and n is not root
            ]
        if tier != "l1":
            return []
        out = [n for n in nodes if n is not root and n.value is not None and n.lock_ref == 0]
        if any(n.host_value is None for n in out):
            anchored = self._anchored_paths()
            out = [n for n in out if n.host_value is not None or n.id not in anchored]
        return out

    def _anchored_paths(self) -> set[int]:
        """Ids of the nodes with a pending prefetch's anchor (``host_ref``) on or below them."""
        out: set[int] = set()
        for node in self.tree.all_nodes():
            cur: TreeNode | None = node if node.host_ref > 0 else None
            while cur is not None and cur.id not in out:
                out.add(cur.id)
                cur = cur.parent
        return out

    def evict_plan(self, plan: EvictionPlan) -> int:
        """Frees the plan's nodes (checked by the tree) as ``evict`` (demote or delete:
        ``evict_device_leaf``) or ``evict_host`` (``evict_host_leaf``) does, with the same
        events and counters."""
        leaf, evict_one, counter = (
            (self.is_device_leaf, self.evict_device_leaf, "evictions")
            if plan.tier == "l1"
            else (self.is_host_leaf, self.evict_host_leaf, "host_evictions")
        )
        freed = 0
        for node in plan.nodes:
            # NOTE: only a prefetch landing while a backup makes room in L2 (``write_backup``
            # runs ``evict_host``, which takes acks) can change a planned node meanwhile: one
            # that is no longer a leaf of the tier is left, and the plan frees less
            if leaf(node):
                freed += evict_one(node)
        self.counters[counter] += freed
        return freed

    # ---- admin ---------------------------------------------------------------------------------
    def flush_tier(self, tier: str) -> int:
        """Empty one tier ("l1" demotes/deletes every unlocked device leaf, "l2" drops every
        unlocked host copy, "l3" clears storage); returns the tokens freed."""
        self.controller.start_writing()
        self.controller.wait_idle()
        self.tree.check()
        if tier == "l1":
            return self.evict(1 << 62)
        if tier == "l2":
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
        if tier == "l3" and self.l3.has_storage():
            return self.l3.clear_storage()
        raise ValueError(f"tier {tier!r} is not enabled")

    def clear(self, tiers: Sequence[str] = TIERS) -> int:
        """Flush each of ``tiers`` (L3 only when attached); returns the tokens freed."""
        return sum(self.flush_tier(t) for t in tiers if t != "l3" or self.l3.has_storage())
