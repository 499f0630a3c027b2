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

L3 is a part, ``self.l3`` (``hicache.l3_tier.L3Tier``; with no backend attached: no L3): a
written node's objects are backed up from its host slots after the write is acknowledged; a
waiting request's L3 hit is prefetched into host slots on the controller's threads and
inserted as a host-only node; the L3 admission of waiting requests is its decision. The tier
calls the tree only through ``L3Tree`` (``hicache.l3_tree``), implemented below; the
BasePrefixCache L3 methods forward to it. ``version`` changes whenever the cached tokens or
their tiers change, so callers can keep a match until the tree changed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from hicache.base_prefix_cache import HostReads, MatchResult
from hicache.cache_request import CacheRequest
from hicache.controller import HiCacheController
from hicache.eviction_plan import EvictionPlan
from hicache.l3_blocks import L3Index
from hicache.l3_tier import STORAGE_SETTLE_S, L3Tier
from hicache.radix_cache import RadixCache, TreeNode
from hicache.stats import L2Stats, Moves, TierSet
from hicache.storage.base import StorageBackend
from hicache.tier import TIERS, Tier

__all__ = ["WRITE_POLICIES", "HiRadixCache", "HostReads", "MatchResult"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
R = TypeVar("R", bound=CacheRequest)


class HiRadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: Any,
        token_to_kv_pool_allocator: Any,
        page_size: int,
        host_pool: Any,
        controller: HiCacheController,
        write_policy: str = "write_through",
        eviction_policy: str = "lru",
        load_back_threshold: int = 0,
        prefetch_threshold: int | None = None,
        event_log: Any = None,
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
        self.ongoing_write: dict[int, TreeNode] = {}
        self.ongoing_load: dict[int, list[TreeNode]] = {}
        # write-through copies that found L2's room held by L3 backups of evicted pages (given
        # back when those land): written then (check), not dropped
        self.waiting_writes: dict[int, TreeNode] = {}
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
        self.waiting_writes = {}
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
        self.writing_check()
        self.loading_check()
        self.l3.storage_check()
        self._retry_writes()

    def writing_check(self) -> None:
        for op in self.controller.drain_write_acks():
            for node_id in op.node_ids:
                node = self.ongoing_write.pop(node_id, None)
                if node is None:
                    continue
                # the write's host slots: the node's, and those of the parts split off above it
                written, pending = [node], node.host_pending
                while (
                    pending is not None
                    and (up := written[-1].parent) is not None
                    and up.host_pending is pending
                ):
                    written.append(up)
                for n in written:
                    n.host_pending = None
                    if not op.ok and n.host_value is not None:
                        self.host_pool.free(n.host_value)
                        self._set_host(n, None)
                self.dec_lock_ref(node)
                if op.ok:  # the parts split off above it hold objects of their own
                    for n in reversed(written):
                        self.l3.backup_to_storage(n)

    def loading_check(self) -> None:
        for op in self.controller.drain_load_acks():
            for node_id in op.node_ids:
                nodes = self.ongoing_load.pop(node_id, None)
                if nodes is None:
                    continue
                self.dec_lock_ref(nodes[-1])
                if not op.ok:  # the bytes never landed: drop the device copies again
                    for node in reversed(nodes):
                        if node.value is not None and node.lock_ref == 0:
                            self.token_to_kv_pool_allocator.free(node.value)
                            self._drop_value(node)

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

    def _set_value(self, node: TreeNode, value: torch.Tensor) -> None:
        self._bump()
        node.value = value
        if node.lock_ref > 0:
            self._protected_size += len(value)
        else:
            self._evictable_size += len(value)

    def _drop_value(self, node: TreeNode) -> None:
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
            self._backup_hot(device)
        host_len = sum(len(n.key) for n in path[len(device) :])
        tiers["l1"], tiers["l2"] = matched - host_len, host_len
        values = [self._device_value(n) for n in device]
        device_indices = torch.cat(values) if values else self._empty()
        last_device = device[-1] if device else self.root_node
        return MatchResult(device_indices, last_device, last_node, host_len, tiers)

    def record_hit(self, node: TreeNode) -> None:
        """One admission used the prefix ending at ``node`` (see RadixCache.record_hit)."""
        super().record_hit(node)
        path = self._path(node)
        self._backup_hot([n for n in path if n.value is not None])

    def _backup_hot(self, device: list[TreeNode]) -> None:
        for node in device:
            self._maybe_backup(node)
        self.controller.start_writing()

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
                self._set_value(child, value[pos : pos + plen].to(torch.int64).clone())
                self._emit("stored", "l1", plen, child)
            else:
                device_prefix = pos + plen
            node, pos = child, pos + plen
        if pos < len(key):
            leaf = self._add_leaf(node, key[pos:], value[pos : len(key)].to(torch.int64))
            if self.write_policy == "write_through":
                self._write_backup(leaf)
        self.controller.start_writing()
        return device_prefix

    # ---- load back (l2 -> l1) ------------------------------------------------------------------
    def init_load_back(
        self,
        last_node: TreeNode,
        match_result: MatchResult | None = None,
        wait: bool = True,
        hold: bool = False,
    ) -> tuple[torch.Tensor, TreeNode]:
        """Promote the host part of the path ending at ``match_result.last_host_node`` (or
        ``last_node``) to device. Returns the device slots of the whole prefix and its new last
        device node (not locked: the caller locks it). ``wait=True`` waits until the bytes
        landed; ``wait=False`` returns with the load in flight (layer-wise overlap): the caller
        must then run the next forward with ``pending_layer_wait()`` (or call
        ``wait_pending_loads()``) before anything reads the returned slots. ``hold`` (with
        ``wait=False``): the copy waits for ``release_loads()``; the next forward reads the KV
        from host in place (``host_reads``) instead of waiting for it."""
        self.check()
        target = match_result.last_host_node if match_result is not None else last_node
        path = self._path(target)
        device = [n for n in path if n.value is not None]
        host_nodes = path[len(device) :]
        host_len = sum(len(n.key) for n in host_nodes)
        if host_len == 0 or host_len < self.load_back_threshold:
            return self._device_prefix(device)
        last = host_nodes[-1]
        self.inc_lock_ref(last)
        host_indices = torch.cat([self._host_value(n) for n in host_nodes])
        device_indices = self.controller.load(host_indices, last.id)
        if device_indices is None:
            self.evict(host_len - self.token_to_kv_pool_allocator.available_size())
            device_indices = self.controller.load(host_indices, last.id)
        if device_indices is None:
            self.dec_lock_ref(last)
            return self._device_prefix(device)
        try:
            counter = self.controller.start_loading(hold=hold and not wait)
        except BaseException:
            # NOTE: the nodes must not point at slots nothing will ever write (a later match
            # would serve them as an L1 hit): the load never started, so undo it whole
            self.controller.cancel_queued_loads()
            self.dec_lock_ref(last)
            raise
        # the copy may be running already: its ack is drained by loading_check on this thread
        offset = 0
        for node in host_nodes:
            self._set_value(node, device_indices[offset : offset + len(node.key)])
            offset += len(node.key)
            self._emit("promoted", "l1", len(node.key), node)
        self.counters["promotions"] += host_len
        self.ongoing_load[last.id] = host_nodes
        if not wait:
            # NOTE: overlap: the load stays in flight (``controller.current_load``); the nodes
            # are locked until ``loading_check`` drains its ack. Attention for layer i must run
            # only after layer i's KV is on device: see ``pending_layer_wait``.
            return self._device_prefix([n for n in path if n.value is not None])
        counter.wait_finished()
        self.controller.wait_idle()
        self.loading_check()
        return self._device_prefix([n for n in path if n.value is not None])

    def pending_layer_wait(self) -> Callable[[int], None] | None:
        """Per-layer wait for the forward (``ForwardBatch.wait_layer``), or None when no load is
        in flight. Loads run FIFO on one worker, so waiting on the newest started load's layer
        i implies layer i of every earlier load (``controller.wait_layer``)."""
        counter = self.controller.current_load
        if counter.finished:  # every byte landed (CUDA: not merely every copy issued)
            return None

        def wait_layer(layer_id: int) -> None:
            counter.wait_until(layer_id)

        return wait_layer

    def host_reads(self) -> HostReads | None:
        """The device slots of loads still in flight and their host copies, or None. A forward
        that reads these slots' KV from ``layer_kv`` instead of the device pool needs no wait;
        then ``release_loads()`` lets the held copies go."""
        ops = self.controller.pending_loads()
        if not ops:
            return None
        return HostReads(
            torch.cat([o.device_indices for o in ops]),
            torch.cat([o.host_indices for o in ops]),
            self.host_pool.layer_kv,
        )

    def release_loads(self) -> None:
        """Let held loads copy (``init_load_back(hold=True)``)."""
        self.controller.release_loads()

    def wait_pending_loads(self) -> None:
        """Block until every started load landed (e.g. a batch that will not run its forward);
        the acks (unlock / error handling) are drained by the next ``check``."""
        self.controller.current_load.wait_finished()

    def _device_prefix(self, device: list[TreeNode]) -> tuple[torch.Tensor, TreeNode]:
        values = [self._device_value(n) for n in device]
        return (
            torch.cat(values) if values else self._empty(),
            device[-1] if device else self.root_node,
        )

    # ---- writes (l1 -> l2) ---------------------------------------------------------------------
    def _maybe_backup(self, node: TreeNode) -> None:
        if node.host_value is not None or self.write_policy == "write_back":
            return
        if self.write_policy == "write_through" or node.hit_count >= 2:
            self._write_backup(node)

    def _write_backup(self, node: TreeNode) -> bool:
        """Queue a D->H copy of ``node`` (locked until acknowledged); False when no host room."""
        if node.value is None or node.host_value is not None or node.id in self.ongoing_write:
            return False
        host_indices = self.controller.write(node.value, node.id)
        if host_indices is None:
            self.evict_host(len(node.key) - self.host_pool.available_size())
            host_indices = self.controller.write(node.value, node.id)
        if host_indices is None:
            if self.host_pool.pending_free_size():
                self.waiting_writes[node.id] = node
            return False
        self._set_host(node, host_indices)
        node.host_pending = object()
        self.ongoing_write[node.id] = node
        self.inc_lock_ref(node)
        return True

    def _retry_writes(self) -> None:
        """Write the nodes whose write found L2's room held, once some came back."""
        if not self.waiting_writes or not self.host_pool.available_size():
            return
        nodes, self.waiting_writes = list(self.waiting_writes.values()), {}
        for node in nodes:
            path = self._path(node)
            if path and path[-1] is node:  # still in the tree (with its device copy or not)
                self._write_backup(node)
        self.controller.start_writing()

    # ---- eviction ----------------------------------------------------------------------------
    def _collect_leaves(self) -> list[TreeNode]:
        """Unlocked device leaves (no device-resident child): device eviction candidates."""
        return [n for n in self._all_nodes() if self._is_device_leaf(n)]

    def _is_device_leaf(self, n: TreeNode) -> bool:
        return (
            n is not self.root_node
            and n.value is not None
            and n.lock_ref == 0
            and all(c.value is None for c in n.children.values())
        )

    def _host_protected_below(self, node: TreeNode) -> bool:
        """A pending prefetch anchors on ``node`` or a host-only descendant."""
        return any(d.host_ref > 0 for d in self._subtree(node))

    def evict(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` device slots if possible: backed-up leaves are demoted to host,
        the rest deleted (write_back, or leaves with host children: backed up first)."""
        self.check()
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(self.eviction_priority(n), n.id, n) for n in self._collect_leaves()]
        heapq.heapify(heap)
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._is_device_leaf(node):
                continue
            parent = node.parent
            freed = self._evict_device_leaf(node)
            if not freed:
                continue  # deleting would drop a waiting request's prefetch anchor
            num_evicted += freed
            if parent is not None and self._is_device_leaf(parent):
                heapq.heappush(heap, (self.eviction_priority(parent), parent.id, parent))
        self.counters["evictions"] += num_evicted
        if num_evicted < num_tokens and self.ongoing_write:
            # NOTE: in-flight writes lock their nodes; let them land, then try again.
            self.controller.start_writing()
            self.controller.wait_idle()
            self.writing_check()
            num_evicted += self.evict(num_tokens - num_evicted)
        return num_evicted

    def _evict_device_leaf(self, node: TreeNode) -> int:
        """Free an unlocked device leaf's device slots: demote it when it has (or, under
        write_back or with host children, gets) a host copy, else delete it with its host-only
        descendants; returns the device tokens freed (0: a prefetch anchors below it, kept)."""
        needs_backup = self.write_policy == "write_back" or bool(node.children)
        if node.host_value is None and needs_backup and self._write_backup(node):
            # synchronous: the device copy must be read before its slots are freed
            self.controller.start_writing()
            self.controller.wait_idle()
            self.writing_check()
        if node.host_value is not None:
            return self._demote(node)
        if self._host_protected_below(node):
            return 0
        return self._delete_subtree(node)

    def _demote(self, node: TreeNode) -> int:
        num = len(node.key)
        self.token_to_kv_pool_allocator.free(self._device_value(node))
        self._drop_value(node)
        self.evicted_tokens += num
        self.counters["demotions"] += num
        self._emit("demoted", "l2", num, node)
        return num

    def _delete_subtree(self, node: TreeNode) -> int:
        """Delete an unlocked device leaf and its host-only descendants; returns device tokens."""
        for d in self._subtree(node)[1:]:
            if d.host_value is not None:
                self.host_pool.free(d.host_value)
                self._set_host(d, None)
                self._emit("removed", "l2", len(d.key), d)
        node.children = {}
        return self._evict_leaf(node)

    def evict_host(self, num_tokens: int) -> int:
        """LRU over host-only leaves with no lock: free their host slots and drop them."""
        self.check()
        if num_tokens <= 0:
            return 0
        heap = [
            (self.eviction_priority(n), n.id, n) for n in self._all_nodes() if self._is_host_leaf(n)
        ]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if not self._is_host_leaf(node):
                continue
            parent = node.parent
            freed += self._evict_host_leaf(node)
            if parent is not None and self._is_host_leaf(parent):
                heapq.heappush(heap, (self.eviction_priority(parent), parent.id, parent))
        self.counters["host_evictions"] += freed
        return freed

    def _evict_host_leaf(self, node: TreeNode) -> int:
        """Free a host-only leaf's host slots and drop it; returns the tokens freed."""
        self.host_pool.free(self._host_value(node))
        self._set_host(node, None)
        self._delete_leaf(node)
        self._emit("removed", "l2", len(node.key), node)
        return len(node.key)

    def _is_host_leaf(self, n: TreeNode) -> bool:
        return (
            n is not self.root_node
            and n.value is None
            and n.host_value is not None
            and not n.children
            and n.lock_ref == 0
            and n.host_ref == 0
        )

    # ---- tree operations: L2 (see BasePrefixCache.walk / plan_eviction / evict_plan) -----------
    def holds(self, node: TreeNode, tier: str) -> bool:
        if tier == "l2":
            return node.host_value is not None
        return super().holds(node, tier)

    def _eviction_candidates(self, tier: str, nodes: Sequence[TreeNode]) -> list[TreeNode]:
        """l1: unlocked device nodes, but not one without a host copy that anchors a pending
        prefetch on or below it (``evict`` keeps it unless a backup happens to fit then, which
        a plan cannot know); l2: unlocked host-only nodes no prefetch anchors on."""
        if tier == "l2":
            return [
                n
                for n in nodes
                if n.value is None
                and n.host_value is not None
                and n.lock_ref == 0
                and n.host_ref == 0
                and n is not self.root_node
            ]
        if tier != "l1":
            return []
        out = [
            n for n in nodes if n is not self.root_node and n.value is not None and n.lock_ref == 0
        ]
        if any(n.host_value is None for n in out):
            anchored = self._anchored_paths()
            out = [n for n in out if n.host_value is not None or n.id not in anchored]
        return out

    def _anchored_paths(self) -> set[int]:
        """Ids of the nodes with a pending prefetch's anchor (``host_ref``) on or below them."""
        out: set[int] = set()
        for node in self._all_nodes():
            cur: TreeNode | None = node if node.host_ref > 0 else None
            while cur is not None and cur.id not in out:
                out.add(cur.id)
                cur = cur.parent
        return out

    def evict_plan(self, plan: EvictionPlan) -> int:
        """Frees the plan's nodes as ``evict`` (demote or delete: ``_evict_device_leaf``) or
        ``evict_host`` (``_evict_host_leaf``) does, with the same events and counters."""
        self._check_plan(plan)
        leaf, evict_one, counter = (
            (self._is_device_leaf, self._evict_device_leaf, "evictions")
            if plan.tier == "l1"
            else (self._is_host_leaf, self._evict_host_leaf, "host_evictions")
        )
        freed = 0
        for node in plan.nodes:
            # NOTE: only a prefetch landing while a backup makes room in L2 (``_write_backup``
            # runs ``evict_host``, which takes acks) can change a planned node meanwhile: one
            # that is no longer a leaf of the tier is left, and the plan frees less
            if leaf(node):
                freed += evict_one(node)
        self.counters[counter] += freed
        return freed

    # ---- admin -------------------------------------------------------------------------------
    def flush_tier(self, tier: str) -> int:
        """Empty one tier ("l1" demotes/deletes every unlocked device leaf, "l2" drops every
        unlocked host copy, "l3" clears storage); returns the tokens freed."""
        self.controller.start_writing()
        self.controller.wait_idle()
        self.check()
        if tier == "l1":
            return self.evict(1 << 62)
        if tier == "l2":
            freed = self.evict_host(1 << 62)
            for n in self._all_nodes():
                if (
                    n.value is not None
                    and n.host_value is not None
                    and n.lock_ref == 0
                    and n.host_ref == 0
                ):
                    self.host_pool.free(n.host_value)
                    self._set_host(n, None)
                    freed += len(n.key)
            return freed
        if tier == "l3" and self.l3.has_storage():
            return self.l3.clear_storage()
        raise ValueError(f"tier {tier!r} is not enabled")

    def clear(self, tiers: list[str] | tuple[str, ...] = TIERS) -> int:
        return sum(self.flush_tier(t) for t in tiers if t != "l3" or self.l3.has_storage())

    def tier_stats(self, hit_tokens: Mapping[str, int], held_tokens: int) -> TierSet:
        host_nodes = [n for n in self._all_nodes() if n.host_value is not None]
        c, s = self.counters, self.controller.stats
        l3, l3_moves = (
            self.l3.storage_stats(hit_tokens[Tier.L3]) if self.l3.has_storage() else (None, Moves())
        )
        l2 = L2Stats(
            capacity_tokens=self.host_pool.size,
            used_tokens=self.host_pool.size - self.host_pool.available_size(),
            evictable_tokens=sum(len(n.key) for n in host_nodes if self._is_host_leaf(n)),
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
            ongoing_writes=len(self.ongoing_write),
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

    # ---- L3Tree: the tree operations the L3 tier calls (``hicache.l3_tree``) ---------------------
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
        self._set_host(node, host_indices)
        self._emit("stored", "l2", len(key), node)
        return node

    def all_nodes(self) -> list[TreeNode]:
        return self._all_nodes()

    def bump_version(self) -> None:
        self._bump()

    def writes_in_flight(self) -> bool:
        return bool(self.ongoing_write)

    # ---- helpers -----------------------------------------------------------------------------
    def _path_key(self, node: TreeNode) -> tuple[int, ...]:
        return tuple(t for n in self._path(node) for t in n.key)

    def _subtree(self, node: TreeNode) -> list[TreeNode]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out
