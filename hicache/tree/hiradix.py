"""HiRadixCache: the radix tree over three tiers. The tree decides *what* moves; the
HiCacheController moves bytes and acknowledges.

A node's KV lives on device (``value``), on host (``host_value``) or both:

    device + host   backed up: device eviction only drops ``value`` (demote, l1 -> l2)
    device only     not backed up yet: eviction deletes it (write_back: backs it up first)
    host only       evicted: ``host.load_back`` promotes it (l2 -> l1); host eviction deletes it

NOTE invariants: descendants of a host-only node are host-only, so every root path is a device
part followed by a host part; a node with an in-flight write or load is locked (lock_ref > 0);
every device slot is free / in ``node.value`` / held by a request; every host slot is free /
in ``node.host_value`` / pending free behind an in-flight copy (D<->H, L3 backup or prefetch).

The tree owns the nodes, their locks and size counters, match / insert and the L1 eviction
order; its tiers are parts it holds, which callers use directly:

    self.host   ``hicache.l2.tier.HostTier``: the host pool, the writes (l1 -> l2) and loads
                (l2 -> l1) in flight on the controller and their acks (``check``), host reads,
                and eviction from both tiers (``host.eviction``: demote / delete a node, L2)
    self.l3     ``hicache.l3.tier.L3Tier`` (with no backend attached: no L3): a written node's
                objects are backed up from its host slots after the write is acknowledged
                (``l3.backup``); a waiting request's L3 hit is prefetched into host slots
                (``l3.prefetch``) and inserted as a host-only node

The parts reach the tree only through ``TierTree`` (``hicache.l2.tree``) and ``L3Tree``
(``hicache.l3.tree``), which it implements. ``version`` changes whenever the cached tokens or
their tiers change, so callers can keep a match until the tree changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.l2.tier import WRITE_POLICIES, HostTier
from hicache.l3.tier import STORAGE_SETTLE_S, L3Tier
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.observe.events import CacheEventLog
from hicache.tier import TIERS, Tier
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import MatchResult
from hicache.tree.eviction_plan import EvictionPlan, evict_in_order
from hicache.tree.node import TreeNode, device_value
from hicache.tree.radix import RadixCache

__all__ = ["WRITE_POLICIES", "HiRadixCache", "MatchResult"]


class HiRadixCache(RadixCache):
    host: HostTier
    l3: L3Tier

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        host_pool: MHATokenToKVPoolHost,
        controller: HiCacheController,
        write_policy: str = "write_through",
        eviction_policy: str = "lru",
        load_back_threshold: int = 0,
        prefetch_threshold: int | None = None,
        event_log: CacheEventLog | None = None,
        prefetch_policy: str = "timeout",
        prefetch_timeout_base: float = 1.0,
        prefetch_timeout_per_ki_token: float = 0.25,
    ) -> None:
        if write_policy not in WRITE_POLICIES:  # before any part exists: nothing to undo
            raise ValueError(f"unknown write_policy {write_policy!r}")
        self.l3 = L3Tier(
            self,
            host_pool,
            controller,
            prefetch_policy,
            prefetch_timeout_base,
            prefetch_timeout_per_ki_token,
            page_size if prefetch_threshold is None else prefetch_threshold,
        )
        self.host = HostTier(
            self,
            token_to_kv_pool_allocator,
            host_pool,
            controller,
            self.l3,
            write_policy,
            load_back_threshold,
        )
        super().__init__(
            req_to_token_pool,
            token_to_kv_pool_allocator,
            page_size,
            eviction_policy=eviction_policy,
        )
        self.event_log = event_log

    def reset(self) -> None:
        """Drop the tree and every host slot (device slots: clear the allocator alongside)."""
        host = self.host
        self.l3.prefetch.cancel_all()
        host.controller.start_writing()
        host.controller.wait_idle()
        host.check()
        host.controller.wait_storage_idle(STORAGE_SETTLE_S)
        host.check()
        host.pool.clear()
        host.reset()
        super().reset()

    # ---- locks and sizes (only device-resident nodes count) ------------------------------------
    def _add_lock(self, node: TreeNode, step: int) -> int:
        delta = 0
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root_node:
            if cur.lock_ref + step < 0:
                raise AssertionError(f"dec_lock_ref on unlocked {cur!r}")
            if cur.lock_ref == (0 if step > 0 else 1) and cur.value is not None:
                delta -= step * len(cur.key)
            cur.lock_ref += step
            cur = cur.parent
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    def set_value(self, node: TreeNode, value: torch.Tensor) -> None:
        self.bump_version()
        node.value = value
        if node.lock_ref > 0:
            self._protected_size += len(value)
        else:
            self._evictable_size += len(value)

    def drop_value(self, node: TreeNode) -> None:
        self.bump_version()
        if node.lock_ref > 0:
            self._protected_size -= len(node.key)
        else:
            self._evictable_size -= len(node.key)
        node.value = None

    def set_host(self, node: TreeNode, host_value: torch.Tensor | None) -> None:
        self.bump_version()
        node.host_value = host_value

    # ---- match / insert ----------------------------------------------------------------------
    def match_prefix(
        self, key: list[int] | tuple[int, ...], namespace: str | None = None, touch: bool = True
    ) -> MatchResult:
        """L1 + L2 match (no L3 I/O: the L3 prefetch is ``l3.prefetch``). ``touch`` counts a hit
        and, for ``write_through_selective``, backs up nodes that reached two hits."""
        self.host.check()
        key = self.keys.tree_key(key, namespace)
        tiers = dict.fromkeys(TIERS, 0)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root_node, self.root_node, 0, tiers)
        _, last_node, matched = self._match_helper(key, hit=True if touch else None)
        path = self.path_of(last_node)
        device = [n for n in path if n.value is not None]
        if touch:
            self.host.backup_hot(device)
        host_len = sum(len(n.key) for n in path[len(device) :])
        tiers[Tier.L1], tiers[Tier.L2] = matched - host_len, host_len
        device_indices, last_device = self.device_prefix(device)
        return MatchResult(device_indices, last_device, last_node, host_len, tiers)

    def record_hit(self, node: TreeNode) -> None:
        """One admission used the prefix ending at ``node`` (see RadixCache.record_hit)."""
        super().record_hit(node)
        path = self.path_of(node)
        self.host.backup_hot([n for n in path if n.value is not None])

    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor) -> int:
        """As RadixCache.insert; host-only nodes on the path take the caller's slots (revive),
        so the returned prefix (what the caller must free) is the device part only."""
        key = self.keys.align(key)
        if self.disable or not key:
            return 0
        node, pos, device_prefix = self.root_node, 0, 0
        while pos < len(key):
            child = node.children.get(self.keys.page_key(key[pos:]))
            if child is None:
                break
            self._touch(child, hit=False)
            plen = self.keys.match_len(child.key, key[pos:])
            if plen < len(child.key):
                child = self._split_node(child, plen)
            if child.value is None:
                self.set_value(child, value[pos : pos + plen].to(torch.int64).clone())
                self.emit("stored", "l1", plen, child)
            else:
                device_prefix = pos + plen
            node, pos = child, pos + plen
        if pos < len(key):
            leaf = self._add_leaf(node, key[pos:], value[pos : len(key)].to(torch.int64))
            if self.host.write_policy == "write_through":
                self.host.write_backup(leaf)
        self.host.controller.start_writing()
        return device_prefix

    # ---- eviction (per node: ``host.eviction``) ------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` device slots if possible, least valuable unlocked device leaf
        first: backed-up leaves are demoted to host, the rest deleted (write_back, or leaves
        with host children: backed up first)."""
        host = self.host
        host.check()
        if self.disable or num_tokens <= 0:
            return 0
        ev = host.eviction
        num_evicted = evict_in_order(
            ev.device_leaves(),
            ev.is_device_leaf,
            ev.evict_device_leaf,  # 0: deleting it would drop a waiting prefetch's anchor
            self.eviction_priority,
            num_tokens,
        )
        host.counters["evictions"] += num_evicted
        if num_evicted < num_tokens and host.writes_in_flight():
            # NOTE: in-flight writes lock their nodes; let them land, then try again.
            host.land_writes()
            num_evicted += self.evict(num_tokens - num_evicted)
        return num_evicted

    def holds(self, node: TreeNode, tier: str) -> bool:
        if tier == Tier.L2:
            return node.host_value is not None
        return super().holds(node, tier)

    def eviction_candidates(self, tier: str, nodes: Sequence[TreeNode]) -> list[TreeNode]:
        """l1: unlocked device nodes, but not one without a host copy that anchors a pending
        prefetch on or below it (``evict`` keeps it unless a backup happens to fit then, which
        a plan cannot know); l2: unlocked host-only nodes no prefetch anchors on."""
        root = self.root_node
        if tier == Tier.L2:
            return [
                n
                for n in nodes
                if n.value is None
                and n.host_value is not None
                and n.lock_ref == 0
                and n.host_ref == 0
                and n is not root
            ]
        if tier != Tier.L1:
            return []
        out = [n for n in nodes if n is not root and n.value is not None and n.lock_ref == 0]
        if any(n.host_value is None for n in out):
            anchored = self._anchored_paths()
            out = [n for n in out if n.host_value is not None or n.id not in anchored]
        return out

    def _anchored_paths(self) -> set[int]:
        """Ids of the nodes with a pending prefetch's anchor (``host_ref``) on or below them."""
        out: set[int] = set()
        for node in self.all_nodes():
            cur: TreeNode | None = node if node.host_ref > 0 else None
            while cur is not None and cur.id not in out:
                out.add(cur.id)
                cur = cur.parent
        return out

    def evict_plan(self, plan: EvictionPlan) -> int:
        """Frees the plan's nodes as ``evict`` (demote or delete: ``evict_device_leaf``) or
        L2 eviction (``evict_host_leaf``) does, with the same events and counters."""
        self._check_plan(plan)
        ev = self.host.eviction
        leaf, evict_one, counter = (
            (ev.is_device_leaf, ev.evict_device_leaf, "evictions")
            if plan.tier == Tier.L1
            else (ev.is_host_leaf, ev.evict_host_leaf, "host_evictions")
        )
        freed = 0
        for node in plan.nodes:
            # NOTE: only a prefetch landing while a backup makes room in L2 (``write_backup``
            # runs ``evict_host``, which takes acks) can change a planned node meanwhile: one
            # that is no longer a leaf of the tier is left, and the plan frees less
            if leaf(node):
                freed += evict_one(node)
        self.host.counters[counter] += freed
        return freed

    # ---- integrity ---------------------------------------------------------------------------
    def check_integrity(self) -> None:
        super().check_integrity()
        for node in self.all_nodes():
            if node is self.root_node:
                continue
            if node.value is None and node.host_value is None:
                raise AssertionError(f"{node!r} has KV in no tier")
            if node.host_value is not None and len(node.host_value) != len(node.key):
                raise AssertionError(f"{node!r} host_value length != key length")
            if node.value is None and any(c.value is not None for c in node.children.values()):
                raise AssertionError(f"{node!r} host-only with a device child")
        host = self.all_host_slots()
        if host.numel() != torch.unique(host).numel():
            raise AssertionError("a host slot is held by two tree nodes")

    def all_host_slots(self) -> torch.Tensor:
        values = [n.host_value for n in self.all_nodes() if n.host_value is not None]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    # ---- L3Tree, TierTree: the tree operations its parts call (``hicache.l3.tree``, ``l2.tree``)
    def match_node(self, key: tuple[int, ...]) -> tuple[TreeNode, int]:
        _, node, matched = self._match_helper(key, hit=None)
        return node, matched

    def hang_host_node(
        self, parent: TreeNode, key: tuple[int, ...], host_indices: torch.Tensor
    ) -> TreeNode:
        node = TreeNode(key)
        node.parent = parent
        node.in_storage = True
        parent.children[self.keys.page_key(key)] = node
        self.set_host(node, host_indices)
        self.emit("stored", "l2", len(key), node)
        return node

    def device_prefix(self, device: list[TreeNode]) -> tuple[torch.Tensor, TreeNode]:
        values = [device_value(n) for n in device]
        return (
            torch.cat(values) if values else self._empty(),
            device[-1] if device else self.root_node,
        )
