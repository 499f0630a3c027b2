"""HiRadixCache: the radix tree over three tiers. The tree decides *what* moves; the
HiCacheController moves bytes and acknowledges.

A node's KV lives on device (``value``), on host (``host_value``) or both:

    device + host   backed up: device eviction only drops ``value`` (demote, l1 -> l2)
    device only     not backed up yet: eviction deletes it (write_back: backs it up first)
    host only       evicted: ``init_load_back`` promotes it (l2 -> l1); host eviction deletes it

NOTE invariants: descendants of a host-only node are host-only, so every root path is a device
part followed by a host part; a node with an in-flight write or load is locked (lock_ref > 0);
every device slot is free / in ``node.value`` / held by a request; every host slot is free /
in ``node.host_value`` / pending free behind an in-flight copy (D<->H, L3 backup or prefetch).

The tree owns the nodes and their size counters; its parts own the rest, and the
BasePrefixCache methods forward to them:

    self.copies    ``hicache.l2.copies.HostCopies``: the writes (l1 -> l2) and loads
                   (l2 -> l1) in flight on the controller, and their acks
    self.eviction  ``hicache.l2.eviction.TierEviction``: eviction from l1 (demote / delete)
                   and l2, eviction plans, flushes
    self.l3        ``hicache.l3.tier.L3Tier`` (with no backend attached: no L3): a written
                   node's objects are backed up from its host slots after the write is
                   acknowledged; a waiting request's L3 hit is prefetched into host slots on the
                   controller's threads and inserted as a host-only node; the L3 admission of
                   waiting requests is its decision

The parts reach the tree only through ``TierTree`` (``hicache.l2.tree``) and ``L3Tree``
(``hicache.l3.tree``), implemented below. ``version`` changes whenever the cached tokens or
their tiers change, so callers can keep a match until the tree changed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from hicache.l2.copies import HostCopies
from hicache.l2.eviction import TierEviction
from hicache.l3.index import L3Index
from hicache.l3.tier import STORAGE_SETTLE_S, L3Tier
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.observe.events import CacheEventLog
from hicache.observe.stats import L2Stats, Moves, TierSet
from hicache.storage.base import StorageBackend
from hicache.tier import TIERS, Tier
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import HostReads, MatchResult
from hicache.tree.eviction_plan import EvictionPlan
from hicache.tree.node import TreeNode, device_value
from hicache.tree.radix import RadixCache
from hicache.tree.request import CacheRequest

__all__ = ["WRITE_POLICIES", "HiRadixCache", "HostReads", "MatchResult"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
R = TypeVar("R", bound=CacheRequest)


class HiRadixCache(RadixCache):
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
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write_policy {write_policy!r}")
        self.host_pool = host_pool
        self.controller = controller
        self.write_policy = write_policy
        self.load_back_threshold = load_back_threshold
        self.counters = {"evictions": 0, "demotions": 0, "promotions": 0, "host_evictions": 0}
        self.l3 = L3Tier(
            self,
            host_pool,
            controller,
            prefetch_policy,
            prefetch_timeout_base,
            prefetch_timeout_per_ki_token,
            page_size if prefetch_threshold is None else prefetch_threshold,
        )
        alloc = token_to_kv_pool_allocator
        self.copies = HostCopies(
            self,
            alloc,
            host_pool,
            controller,
            self.l3,
            self.counters,
            write_policy,
            load_back_threshold,
        )
        self.eviction = TierEviction(
            self, alloc, host_pool, controller, self.copies, self.l3, self.counters, write_policy
        )
        super().__init__(
            req_to_token_pool,
            token_to_kv_pool_allocator,
            page_size,
            eviction_policy=eviction_policy,
        )
        self.event_log = event_log

    # ---- lifecycle ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Drop the tree and every host slot (device slots: clear the allocator alongside)."""
        self.l3.prefetch.cancel_all()
        self.controller.start_writing()
        self.controller.wait_idle()
        self.check()
        self.controller.wait_storage_idle(STORAGE_SETTLE_S)
        self.check()
        self.host_pool.clear()
        self.copies.reset()
        super().reset()

    def shutdown(self) -> None:
        """Stop the copy workers after flushing queued writes and their L3 backups."""
        self.l3.prefetch.cancel_all()
        self.controller.start_writing()
        self.controller.wait_idle(timeout=60)
        self.check()  # acknowledged writes queue their L3 backups
        self.controller.shutdown()
        self.check()

    def settle(self, timeout: float) -> None:
        self.controller.wait_idle(timeout)
        self.check()

    def set_wake(self, wake: Callable[[], None]) -> None:
        self.controller.notify = wake

    def release_host_memory(self) -> None:
        """NOTE: L3 threads still copying from host slots keep the pool."""
        if not self.l3.storage_busy():
            self.host_pool.release_memory()

    def has_host_tier(self) -> bool:
        return True

    def check(self) -> None:
        """Drain finished writes, loads, L3 backups and prefetches (scheduler thread); safe to
        call every step."""
        self.copies.writing_check()
        self.copies.loading_check()
        self.l3.storage_check()
        self.copies.retry_writes()

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
        self._bump()
        node.value = value
        if node.lock_ref > 0:
            self._protected_size += len(value)
        else:
            self._evictable_size += len(value)

    def drop_value(self, node: TreeNode) -> None:
        self._bump()
        if node.lock_ref > 0:
            self._protected_size -= len(node.key)
        else:
            self._evictable_size -= len(node.key)
        node.value = None

    # ---- match / insert ----------------------------------------------------------------------
    def match_prefix(
        self, key: list[int] | tuple[int, ...], namespace: str | None = None, touch: bool = True
    ) -> MatchResult:
        """L1 + L2 match (no L3 I/O: see ``l3_start``). ``touch`` counts a hit and, for
        ``write_through_selective``, backs up nodes that reached two hits."""
        self.check()
        key = self._align(self.key_of(key, namespace))
        tiers = dict.fromkeys(TIERS, 0)
        if self.disable or not key:
            return MatchResult(self._empty(), self.root_node, self.root_node, 0, tiers)
        _, last_node, matched = self._match_helper(key, hit=True if touch else None)
        path = self._path(last_node)
        device = [n for n in path if n.value is not None]
        if touch:
            self.copies.backup_hot(device)
        host_len = sum(len(n.key) for n in path[len(device) :])
        tiers["l1"], tiers["l2"] = matched - host_len, host_len
        values = [device_value(n) for n in device]
        device_indices = torch.cat(values) if values else self._empty()
        last_device = device[-1] if device else self.root_node
        return MatchResult(device_indices, last_device, last_node, host_len, tiers)

    def record_hit(self, node: TreeNode) -> None:
        """One admission used the prefix ending at ``node`` (see RadixCache.record_hit)."""
        super().record_hit(node)
        path = self._path(node)
        self.copies.backup_hot([n for n in path if n.value is not None])

    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor) -> int:
        """As RadixCache.insert; host-only nodes on the path take the caller's slots (revive),
        so the returned prefix (what the caller must free) is the device part only."""
        key = self._align(key)
        if self.disable or not key:
            return 0
        node, pos, device_prefix = self.root_node, 0, 0
        while pos < len(key):
            child = node.children.get(self._page_key(key[pos:]))
            if child is None:
                break
            self._touch(child, hit=False)
            plen = self._key_match(child.key, key[pos:])
            if plen < len(child.key):
                child = self._split_node(child, plen)
            if child.value is None:
                self.set_value(child, value[pos : pos + plen].to(torch.int64).clone())
                self._emit("stored", "l1", plen, child)
            else:
                device_prefix = pos + plen
            node, pos = child, pos + plen
        if pos < len(key):
            leaf = self._add_leaf(node, key[pos:], value[pos : len(key)].to(torch.int64))
            if self.write_policy == "write_through":
                self.copies.write_backup(leaf)
        self.controller.start_writing()
        return device_prefix

    # ---- load back (l2 -> l1: ``self.copies``) --------------------------------------------------
    def init_load_back(
        self,
        last_node: TreeNode,
        match_result: MatchResult | None = None,
        wait: bool = True,
        hold: bool = False,
    ) -> tuple[torch.Tensor, TreeNode]:
        return self.copies.init_load_back(last_node, match_result, wait, hold)

    def pending_layer_wait(self) -> Callable[[int], None] | None:
        return self.copies.pending_layer_wait()

    def host_reads(self) -> HostReads | None:
        return self.copies.host_reads()

    def release_loads(self) -> None:
        """Let held loads copy (``init_load_back(hold=True)``)."""
        self.controller.release_loads()

    def wait_pending_loads(self) -> None:
        """Block until every started load landed (e.g. a batch that will not run its forward);
        the acks (unlock / error handling) are drained by the next ``check``."""
        self.controller.current_load.wait_finished()

    @property
    def waiting_writes(self) -> dict[int, TreeNode]:
        """Nodes whose write found L2's room held by L3 backups: written once it comes back."""
        return self.copies.waiting_writes

    # ---- eviction (``self.eviction``) ------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        return self.eviction.evict(num_tokens)

    def evict_host(self, num_tokens: int) -> int:
        return self.eviction.evict_host(num_tokens)

    def _collect_leaves(self) -> list[TreeNode]:
        """Unlocked device leaves (a device leaf may have host-only children)."""
        return self.eviction.device_leaves()

    # ---- tree operations: L2 (see BasePrefixCache.walk / plan_eviction / evict_plan) -----------
    def holds(self, node: TreeNode, tier: str) -> bool:
        if tier == "l2":
            return node.host_value is not None
        return super().holds(node, tier)

    def _eviction_candidates(self, tier: str, nodes: Sequence[TreeNode]) -> list[TreeNode]:
        return self.eviction.candidates(tier, nodes)

    def evict_plan(self, plan: EvictionPlan) -> int:
        """Frees the plan's nodes as ``evict`` or ``evict_host`` does, with the same events and
        counters (``TierEviction.evict_plan``)."""
        self._check_plan(plan)
        return self.eviction.evict_plan(plan)

    # ---- admin -------------------------------------------------------------------------------
    def flush_tier(self, tier: str) -> int:
        return self.eviction.flush_tier(tier)

    def clear(self, tiers: list[str] | tuple[str, ...] = TIERS) -> int:
        return self.eviction.clear(tiers)

    def tier_stats(self, hit_tokens: Mapping[str, int], held_tokens: int) -> TierSet:
        host_nodes = [n for n in self._all_nodes() if n.host_value is not None]
        c, s = self.counters, self.controller.stats
        l3, l3_moves = (
            self.l3.storage_stats(hit_tokens[Tier.L3]) if self.l3.has_storage() else (None, Moves())
        )
        l2 = L2Stats(
            capacity_tokens=self.host_pool.size,
            used_tokens=self.host_pool.size - self.host_pool.available_size(),
            evictable_tokens=sum(len(n.key) for n in host_nodes if self.eviction.is_host_leaf(n)),
            pinned_tokens=sum(len(n.key) for n in host_nodes if n.lock_ref > 0),
            hit_tokens=hit_tokens[Tier.L2],
            evicted_tokens=c["host_evictions"],
            promoted_tokens=l3_moves.promoted_tokens,
            demoted_tokens=l3_moves.demoted_tokens,
            bytes_in=l3_moves.bytes_in,
            bytes_out=l3_moves.bytes_out,
            errors=s["errors"],  # failed copies either way, each once
            cached_tokens=sum(len(n.key) for n in host_nodes),
            host_only_tokens=sum(len(n.key) for n in host_nodes if n.value is None),
            pending_free_tokens=self.host_pool.pending_free_size(),
            ongoing_writes=len(self.copies.ongoing_write),
            write_policy=self.write_policy,
        )
        l1_moves = Moves(
            promoted_tokens=c["promotions"],
            demoted_tokens=c["demotions"],
            bytes_in=s["bytes_h2d"],
            bytes_out=s["bytes_d2h"],
        )
        return TierSet(self.l1_stats(hit_tokens[Tier.L1], held_tokens, l1_moves), l2, l3)

    def check_integrity(self) -> None:
        super().check_integrity()
        for node in self._all_nodes():
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
        values = [n.host_value for n in self._all_nodes() if n.host_value is not None]
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    # ---- L3 (``self.l3``) ----------------------------------------------------------------------
    def has_storage(self) -> bool:
        return self.l3.has_storage()

    def can_attach_storage(self) -> bool:
        return True

    @property
    def object_size(self) -> int:
        return self.l3.object_size

    def attach_storage(self, storage: StorageBackend, object_size: int) -> None:
        self.l3.attach_storage(storage, object_size)

    def detach_storage(self, timeout: float = STORAGE_SETTLE_S) -> StorageBackend | None:
        return self.l3.detach_storage(timeout)

    def storage_info(self) -> dict[str, Any]:
        return self.l3.storage_info()

    def storage_prefix_len(self, key: list[int], namespace: str | None = None) -> int:
        return self.l3.storage_prefix_len(key, namespace)

    def node_in_storage(self, node: TreeNode) -> bool:
        return self.l3.node_in_storage(node)

    def storage_busy(self) -> bool:
        return self.l3.storage_busy()

    def delete_from_storage(self, nodes: list[TreeNode]) -> int:
        return self.l3.delete_from_storage(nodes)

    def drain_storage(self, timeout: float) -> int:
        return self.l3.drain_storage(timeout)

    def backup_in_flight_tokens(self, namespaces: frozenset[str]) -> int:
        return self.l3.backup_in_flight_tokens(namespaces)

    def set_backup_gate(self, gate: Callable[[TreeNode], bool] | None) -> None:
        self.l3.set_backup_gate(gate)

    def l3_start(self, req: CacheRequest) -> int:
        return self.l3.admission.start(req)

    def l3_matched(self, req: CacheRequest) -> None:
        self.l3.admission.matched(req)

    def l3_ready(self, req: R, behind: Sequence[R], rematch: Callable[[R], None]) -> bool:
        return self.l3.admission.ready(req, behind, rematch)

    def l3_admitted(self, req: CacheRequest) -> int:
        return self.l3.admission.admitted(req)

    def l3_forget(self, req: CacheRequest) -> None:
        self.l3.admission.forget(req)

    def l3_hit(self, req: CacheRequest) -> int:
        return self.l3.admission.l3_hit(req)

    def prefetch_deadline(self) -> float | None:
        return self.l3.prefetch.prefetch_deadline()

    def l3_objects(self) -> L3Index | None:
        return self.l3.l3_index

    # ---- L3Tree, TierTree: the tree operations its parts call (``hicache.l3.tree``, ``tier_tree``)
    def tree_key(
        self, token_ids: list[int] | tuple[int, ...], namespace: str | None
    ) -> tuple[int, ...]:
        return self._align(self.key_of(token_ids, namespace))

    def path_of(self, node: TreeNode) -> list[TreeNode]:
        return self._path(node)

    def match_node(self, key: tuple[int, ...]) -> tuple[TreeNode, int]:
        _, node, matched = self._match_helper(key, hit=None)
        return node, matched

    def hang_host_node(
        self, parent: TreeNode, key: tuple[int, ...], host_indices: torch.Tensor
    ) -> TreeNode:
        node = TreeNode(key)
        node.parent = parent
        node.in_storage = True
        parent.children[self._page_key(key)] = node
        self.set_host(node, host_indices)
        self._emit("stored", "l2", len(key), node)
        return node

    def all_nodes(self) -> list[TreeNode]:
        return self._all_nodes()

    def bump_version(self) -> None:
        self._bump()

    def writes_in_flight(self) -> bool:
        return self.copies.writes_in_flight()

    def set_host(self, node: TreeNode, host_value: torch.Tensor | None) -> None:
        self._bump()
        node.host_value = host_value

    def evict_leaf(self, node: TreeNode) -> int:
        return self._evict_leaf(node)

    def delete_leaf(self, node: TreeNode) -> None:
        self._delete_leaf(node)

    def emit(self, kind: str, tier: str, num_tokens: int, node: TreeNode | None = None) -> None:
        self._emit(kind, tier, num_tokens, node)

    def device_prefix(self, device: list[TreeNode]) -> tuple[torch.Tensor, TreeNode]:
        values = [device_value(n) for n in device]
        return (
            torch.cat(values) if values else self._empty(),
            device[-1] if device else self.root_node,
        )
