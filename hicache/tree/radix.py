"""RadixCache: a page-aligned radix tree from token ids to L1 KV slot indices.

The tree holds slot indices, never KV bytes. Every key and value length is a multiple of
page_size; children are keyed by the first page of their key. A node with ``lock_ref > 0`` is used
by a running request (protected); unlocked leaves are evicted by LRU or LFU.

Beyond the core (``BasePrefixCache``) a tree has what its tiers' parts and the tree operations
(``hicache.tree.ops``) use: its keys (``keys``: pages, namespaces), which tier holds a node
(``holds``), a tier's eviction candidates and the eviction of exactly a plan, and the node
changes every tier change goes through (``path_of``, ``evict_leaf``, ``delete_leaf``, ``emit``).
NOTE: ``node.value`` may be None in a subclass (HiRadixCache: evicted to host); _split_node,
_collect_leaves, evict_leaf, delete_leaf and _touch are the override points.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.tier import Tier
from hicache.tree.base import BasePrefixCache, MatchResult
from hicache.tree.eviction_plan import EvictionPlan, StalePlanError, evict_in_order
from hicache.tree.keys import TreeKeys
from hicache.tree.node import TreeNode, access_time, device_value, subtree
from hicache.tree.request import CacheRequest, finished_kv_len, locked_node, row_of

__all__ = ["MatchResult", "RadixCache"]


class RadixCache(BasePrefixCache):
    """Prefix cache over ``token_to_kv_pool_allocator`` slots."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        disable: bool = False,
        eviction_policy: str = "lru",
    ) -> None:
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction_policy {eviction_policy!r}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.eviction_policy = eviction_policy
        self.device = token_to_kv_pool_allocator.device
        self.event_log = None
        self.evicted_tokens = 0  # cumulative L1 tokens freed by evict()
        self.version = 0
        self.keys = TreeKeys(page_size)  # NOTE: reset() keeps it: namespace ids never change
        self.reset()

    # ---- public API -------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the whole tree. NOTE: slots are not freed; clear the allocator alongside."""
        self.bump_version()
        self.root_node = TreeNode()
        self.root_node.value = self._empty()
        self.root_node.lock_ref = 1  # the root is never evicted
        self._evictable_size = 0
        self._protected_size = 0

    def emit(self, kind: str, tier: str, num_tokens: int, node: TreeNode | None = None) -> None:
        """Report a cache event (stored, removed, promoted, demoted) to the event log."""
        if self.event_log is not None and num_tokens:
            ns = self.keys.split_key(node.key)[0] if node is not None else None
            self.event_log.emit(kind, tier, num_tokens, node.id if node else None, ns)

    def match_prefix(
        self, key: list[int] | tuple[int, ...], namespace: str | None = None, touch: bool = True
    ) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; splits the node the match ends inside.
        ``touch``: count a hit on the matched nodes (access time, hit count). The scheduler
        matches waiting requests with ``touch=False`` and counts the hit once, at admission
        (``record_hit``), so re-matching never skews LRU / LFU."""
        key = self.keys.tree_key(key, namespace)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root_node, self.root_node)
        values, node, _ = self._match_helper(key, hit=True if touch else None)
        device_indices = torch.cat(values) if values else self._empty()
        return MatchResult(device_indices, node, node)

    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor) -> int:
        """Insert ``key`` -> ``value`` (page-aligned part); returns the prefix length already
        present, whose slots in ``value`` the caller still owns (duplicates to free)."""
        key = self.keys.align(key)
        if self.disable or not key:
            return 0
        _, node, prefix_len = self._match_helper(key, hit=False)
        if prefix_len < len(key):
            self._add_leaf(node, key[prefix_len:], value[prefix_len : len(key)].to(torch.int64))
        return prefix_len

    def cache_finished_req(self, req: CacheRequest) -> None:
        """Insert a finished request's KV, free what the tree does not keep, release its lock
        and its req_to_token row.

            positions: 0 ........ len(prefix) ......... new_prefix_len ... aligned_len ... kv_len
            slots:     |tree (locked)|  duplicates: free  | inserted: tree keeps  | tail: free |
        """
        kv_len = finished_kv_len(req)
        row, rows = row_of(req), self._rows()
        kv_indices = rows.req_to_token[row, :kv_len].long()  # [kv_len] on device
        if self.disable:
            self.token_to_kv_pool_allocator.free(kv_indices)
            rows.free(row)
            return
        token_ids = self.keys.key_of(
            (list(req.origin_input_ids) + list(req.output_ids))[:kv_len], req.cache_namespace
        )
        aligned_len = kv_len // self.page_size * self.page_size
        allocator = self.token_to_kv_pool_allocator
        allocator.free_group_begin()
        allocator.free(kv_indices[aligned_len:])  # the partial last page
        new_prefix_len = self.insert(token_ids[:aligned_len], kv_indices[:aligned_len].clone())
        self._free_duplicates(kv_indices, len(req.kv.prefix_indices), new_prefix_len)
        allocator.free_group_end()
        rows.free(row)
        self.dec_lock_ref(locked_node(req))

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """Insert the KV of ``req.kv.fill_ids`` so far and re-point the request at the tree's
        slots.

            positions: 0 ...... len(prefix) ...... new_prefix_len .... aligned_len ...... kv_len
            slots:     |tree (locked)| duplicates: free, |  inserted: tree   | tail: kept by req |
                                     | row <- tree slots |                   |                   |
        ``req.kv.prefix_indices`` becomes tree slots + the kept tail; the lock moves to the new
        node.
        """
        kv = req.kv
        token_ids = self.keys.key_of(kv.fill_ids, req.cache_namespace)
        kv_len, row, rows = len(token_ids), row_of(req), self._rows()
        kv_indices = rows.req_to_token[row, :kv_len].long()  # [kv_len] on device
        if self.disable:
            kv.prefix_indices = kv_indices
            return
        aligned_len = kv_len // self.page_size * self.page_size
        old_prefix_len = len(kv.prefix_indices)
        new_prefix_len = self.insert(token_ids[:aligned_len], kv_indices[:aligned_len].clone())
        self._free_duplicates(kv_indices, old_prefix_len, new_prefix_len)
        rematch = self.match_prefix(token_ids[:aligned_len], touch=False)
        new_indices, new_last_node = rematch.device_indices, rematch.last_device_node
        if len(new_indices) != aligned_len:
            raise AssertionError(f"re-match found {len(new_indices)} of {aligned_len} tokens")
        start = min(old_prefix_len, aligned_len) // self.page_size * self.page_size
        rows.write((row, slice(start, aligned_len)), new_indices[start:])
        self.inc_lock_ref(new_last_node)
        self.dec_lock_ref(locked_node(req))
        kv.prefix_indices = torch.cat((new_indices, kv_indices[aligned_len:]))
        kv.last_node = new_last_node

    def record_hit(self, node: TreeNode) -> None:
        """One admission used the prefix ending at ``node``: touch every node of its path."""
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root_node:
            self._touch(cur, hit=True)
            cur = cur.parent

    def bump_version(self) -> None:
        """The set of cached tokens or their tiers changed: cached matches are stale."""
        self.version += 1

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors; returns the change of evictable_size (<= 0)."""
        return self._add_lock(node, 1)

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock ``node`` and its ancestors; returns the change of evictable_size (>= 0)."""
        return self._add_lock(node, -1)

    def _add_lock(self, node: TreeNode, step: int) -> int:
        delta = 0
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root_node:
            if cur.lock_ref + step < 0:
                raise AssertionError(f"dec_lock_ref on unlocked {cur!r}")
            if cur.lock_ref == (0 if step > 0 else 1):  # evictable <-> protected
                delta -= step * len(cur.key)
            cur.lock_ref += step
            cur = cur.parent
        self._evictable_size += delta
        self._protected_size -= delta
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least valuable first, until >= ``num_tokens`` are freed or
        nothing is evictable; returns the number of tokens freed."""
        if self.disable or num_tokens <= 0:
            return 0
        self.token_to_kv_pool_allocator.free_group_begin()
        num_evicted = evict_in_order(
            self._collect_leaves(),
            self._is_leaf,
            self.evict_leaf,
            self.eviction_priority,
            num_tokens,
        )
        self.token_to_kv_pool_allocator.free_group_end()
        return num_evicted

    # ---- what the tree operations read (hicache.tree.ops) ----------------------------------------
    def holds(self, node: TreeNode, tier: str) -> bool:
        """Does ``node`` hold its KV in memory tier ``tier`` ("l1" device, "l2" host)?"""
        return tier == Tier.L1 and node.value is not None

    def eviction_candidates(self, tier: str, nodes: Sequence[TreeNode]) -> list[TreeNode]:
        """Those of ``nodes`` that eviction may take from ``tier`` once they are leaves of it
        (unlocked, holding the tier)."""
        if tier != Tier.L1:
            return []
        return [
            n for n in nodes if n is not self.root_node and n.value is not None and n.lock_ref == 0
        ]

    def evict_plan(self, plan: EvictionPlan) -> int:
        """Evict exactly ``plan``'s nodes (``hicache.tree.ops.plan_eviction``), in its order, as
        ``evict`` frees a leaf (``evict_leaf``); returns the tokens freed (``plan.tokens``).
        StalePlanError, before anything changes, when the tree changed since the plan."""
        self._check_plan(plan)
        if plan.tier != Tier.L1:
            return 0
        freed = 0
        self.token_to_kv_pool_allocator.free_group_begin()
        try:
            for node in plan.nodes:
                if node.children or node.lock_ref:
                    raise AssertionError(f"planned {node!r} is not an unlocked leaf")
                freed += self.evict_leaf(node)
        finally:
            self.token_to_kv_pool_allocator.free_group_end()
        return freed

    def _check_plan(self, plan: EvictionPlan) -> None:
        if plan.version != self.version:
            raise StalePlanError(
                f"the tree changed since the plan (version {plan.version} "
                f"!= {self.version}); nothing was evicted"
            )

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens whose KV the tree holds on device."""
        return sum(len(n.value) for n in self.all_nodes() if n.value is not None)

    def all_device_slots(self) -> torch.Tensor:
        """Every device slot the tree holds ([total_size] int64 on device)."""
        values = [n.value for n in self.all_nodes() if n.value is not None]
        return torch.cat(values) if values else self._empty()

    def pretty_print(self) -> None:
        stack = [(self.root_node, 0)]
        while stack:
            node, depth = stack.pop()
            head = list(node.key[:8]) if node is not self.root_node else "root"
            print(f"{'  ' * depth}{head} len={len(node.key)} lock={node.lock_ref}")
            stack.extend((c, depth + 1) for c in node.children.values())
        print(
            f"total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size}"
        )

    def check_integrity(self) -> None:
        """Raise AssertionError unless keys, values, locks and size counters are consistent."""
        evictable = protected = 0
        for node in self.all_nodes():
            if node is self.root_node:
                continue
            parent = node.parent
            if parent is None or parent.children.get(self.keys.page_key(node.key)) is not node:
                raise AssertionError(f"{node!r} not under its parent's page key")
            if not node.key or len(node.key) % self.page_size:
                raise AssertionError(f"{node!r} key length not a positive page multiple")
            if node.value is not None and len(node.value) != len(node.key):
                raise AssertionError(f"{node!r} value length != key length")
            if node.lock_ref < 0 or (
                parent is not self.root_node and parent.lock_ref < node.lock_ref
            ):
                raise AssertionError(f"{node!r} lock_ref inconsistent with its parent")
            if node.value is not None:
                if node.lock_ref == 0:
                    evictable += len(node.value)
                else:
                    protected += len(node.value)
        if (evictable, protected) != (self._evictable_size, self._protected_size):
            raise AssertionError(
                f"sizes {(self._evictable_size, self._protected_size)} "
                f"!= recomputed {(evictable, protected)}"
            )
        slots = self.all_device_slots()
        if slots.numel() != torch.unique(slots).numel():
            raise AssertionError("a slot is held by two tree nodes")
        if evictable + protected != self.total_size():
            raise AssertionError("evictable + protected != total_size")

    # ---- helpers (override points for HiRadixCache) ---------------------------------------------
    def _rows(self) -> ReqToTokenPool:
        """The req_to_token pool; NOTE: a cache built without one (tests, admin) caches no
        requests."""
        if self.req_to_token_pool is None:
            raise RuntimeError("this cache has no req_to_token pool")
        return self.req_to_token_pool

    @staticmethod
    def _parent(node: TreeNode) -> TreeNode:
        """The parent of a node in the tree (every node but the root has one)."""
        if node.parent is None:
            raise AssertionError(f"{node!r} has no parent")
        return node.parent

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def _touch(self, node: TreeNode, hit: bool = True) -> None:
        node.last_access_time = access_time()
        if hit:
            node.hit_count += 1

    def eviction_priority(self, node: TreeNode) -> tuple[int, ...]:
        """LRU: oldest access first; LFU: fewest hits first, then oldest."""
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time)
        return (node.last_access_time,)

    def _match_helper(
        self, key: tuple[int, ...], hit: bool | None = True
    ) -> tuple[list[torch.Tensor], TreeNode, int]:
        """Walk ``key`` down from the root, splitting the node the match ends inside; returns
        the matched nodes' values, the deepest matched node and the matched length.
        ``hit``: True touches and counts a hit, False only refreshes the access time, None
        leaves the nodes as they are."""
        values: list[torch.Tensor] = []
        node, matched = self.root_node, 0
        while matched < len(key):
            child = node.children.get(self.keys.page_key(key[matched:]))
            if child is None:
                break
            if hit is not None:
                self._touch(child, hit)
            prefix_len = self.keys.match_len(child.key, key[matched:])
            node = child if prefix_len == len(child.key) else self._split_node(child, prefix_len)
            if node.value is not None:  # NOTE: None only on HiRadixCache's host-only nodes
                values.append(node.value)
            matched += prefix_len
            if node is not child:
                break
        return values, node, matched

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """child[key] -> new_node[key[:split_len]] -> child[key[split_len:]]; returns new_node."""
        new_node = TreeNode(child.key[:split_len])
        new_node.value = None if child.value is None else child.value[:split_len]
        if child.host_value is not None:
            new_node.host_value = child.host_value[:split_len]
            child.host_value = child.host_value[split_len:]
            new_node.host_pending = child.host_pending
        new_node.parent, new_node.lock_ref = child.parent, child.lock_ref
        new_node.last_access_time, new_node.hit_count = child.last_access_time, child.hit_count
        new_node.in_storage = child.in_storage  # objects ending in either part were stored
        child.key = child.key[split_len:]
        child.value = None if child.value is None else child.value[split_len:]
        new_node.children = {self.keys.page_key(child.key): child}
        child.parent = new_node
        self._parent(new_node).children[self.keys.page_key(new_node.key)] = new_node
        return new_node

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], value: torch.Tensor) -> TreeNode:
        self.bump_version()
        node = TreeNode(key, value)
        node.hit_count = 1  # the request that computed it used it once
        node.parent = parent
        parent.children[self.keys.page_key(key)] = node
        self._evictable_size += len(key)
        self.emit("stored", "l1", len(key), node)
        return node

    def _collect_leaves(self) -> list[TreeNode]:
        """Unlocked device leaves: the eviction candidates."""
        return [n for n in self.all_nodes() if self._is_leaf(n)]

    def _is_leaf(self, n: TreeNode) -> bool:
        return not n.children and n.lock_ref == 0 and n is not self.root_node

    def evict_leaf(self, node: TreeNode) -> int:
        """Free a leaf's slots and drop it; returns the tokens freed."""
        value = device_value(node)
        self.token_to_kv_pool_allocator.free(value)
        num_tokens = len(value)
        self.delete_leaf(node)
        self.evicted_tokens += num_tokens
        self.emit("removed", "l1", num_tokens, node)
        return num_tokens

    def delete_leaf(self, node: TreeNode) -> None:
        """Drop a leaf from the tree (its slots: freed by the caller)."""
        self.bump_version()
        del self._parent(node).children[self.keys.page_key(node.key)]
        if node.value is not None:
            self._evictable_size -= len(node.key)

    def path_of(self, node: TreeNode) -> list[TreeNode]:
        """Root-exclusive path root -> ``node``, cut where a node is no longer in the tree (so
        ``path[-1] is node`` iff ``node`` is in the tree)."""
        path: list[TreeNode] = []
        cur: TreeNode | None = node
        while cur is not self.root_node and cur is not None:
            path.append(cur)
            cur = cur.parent
        path.reverse()
        at, out = self.root_node, []
        for n in path:
            if at.children.get(self.keys.page_key(n.key)) is not n:
                break
            out.append(n)
            at = n
        return out

    def all_nodes(self) -> list[TreeNode]:
        """Every node of the tree, the root included, parents first."""
        return subtree(self.root_node)

    def _free_duplicates(self, kv_indices: torch.Tensor, prefix_len: int, new_len: int) -> None:
        """Free the request's own slots of ``[prefix_len, new_len)``: the tree already has them.
        NOTE: a partial page the request kept at ``prefix_len`` is a duplicate too, so the free
        starts at the page holding ``prefix_len``."""
        if new_len > prefix_len:
            start = prefix_len // self.page_size * self.page_size
            self.token_to_kv_pool_allocator.free(kv_indices[start:new_len])
