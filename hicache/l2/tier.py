"""HostTier: the L2 (host memory) tier of HiRadixCache (``cache.host``): its pool, the copies
between a node's device slots (L1) and its host slots (L2), their acknowledgements, and the
eviction from both tiers (its part ``eviction``, hicache.l2.eviction). The tree decides which
nodes are copied; ``controller`` moves the bytes on its workers and acknowledges; the acks are
taken here (``check``), on the scheduler thread.

    write  (l1 -> l2)  ``write_backup``: host slots taken now, the node locked and its
                       ``host_pending`` set until the ack; then its L3 backup is queued
                       (``write_through``: a node as it is inserted, or matched with no host
                       copy; ``write_through_selective``: a node matched a second time;
                       ``write_back``: a node about to be evicted)
    load   (l2 -> l1)  ``load_back``: device slots taken now for the host part of a path,
                       the path locked until the ack; a failed load drops them again. The next
                       forward waits for it layer by layer (``pending_layer_wait``), or reads
                       the loading KV from host in place (``host_reads``, then the
                       controller's ``release_loads``)

The scheduler's cache manager (engine/runtime/scheduler/cache.py) calls ``check`` every step,
``load_back`` at admission and the wait / host-read calls around each forward.

NOTE: a write that finds L2's room held by L3 backups (pending free) waits in
``waiting_writes`` and is written once some comes back (``retry_writes``), not dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hicache.l2.eviction import TierEviction
from hicache.l2.tree import TierTree
from hicache.l3.tier import L3Tier
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.observe.stats import L2Stats, Moves
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import MatchResult
from hicache.tree.node import TreeNode, host_value

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass
class HostReads:
    """Device slots whose KV is still loading, and the host slots that hold it meanwhile (a CPU
    forward reads those in place: ``HostTier.host_reads``)."""

    device_indices: torch.Tensor  # [n] int64
    host_indices: torch.Tensor  # [n] int64, pairwise with device_indices
    layer_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # host K, V [size, H, D]


class HostTier:
    """The host pool of ``tree`` and the writes and loads in flight between its device and host
    slots."""

    def __init__(
        self,
        tree: TierTree,
        allocator: TokenToKVPoolAllocator,
        pool: MHATokenToKVPoolHost,
        controller: HiCacheController,
        l3: L3Tier,
        write_policy: str = "write_through",  # one of WRITE_POLICIES (HiRadixCache checks)
        load_back_threshold: int = 0,
    ) -> None:
        self.tree = tree
        self.allocator = allocator
        self.pool = pool
        self.controller = controller
        self.l3 = l3
        self.write_policy = write_policy
        self.load_back_threshold = load_back_threshold
        self.counters = {"evictions": 0, "demotions": 0, "promotions": 0, "host_evictions": 0}
        self.ongoing_write: dict[int, TreeNode] = {}  # node id -> node written
        self.ongoing_load: dict[int, list[TreeNode]] = {}  # last node id -> nodes loaded
        self.waiting_writes: dict[int, TreeNode] = {}  # node id -> node to write
        self.eviction = TierEviction(tree, allocator, self, l3)

    def reset(self) -> None:
        """Forget the writes waiting for L2 room (the tree is dropped)."""
        self.waiting_writes = {}

    def writes_in_flight(self) -> bool:
        return bool(self.ongoing_write)

    # ---- the engine's loop ---------------------------------------------------------------------
    def check(self) -> None:
        """Take the acks of finished writes, loads, L3 backups and prefetches, and write what
        waited for L2 room (scheduler thread; safe to call every step)."""
        self.writing_check()
        self.loading_check()
        self.l3.storage_check()
        self.retry_writes()

    def settle(self, timeout: float) -> None:
        """Let in-flight copies finish (at most ``timeout`` s) and take their acks, so nodes
        locked only by a copy become evictable."""
        self.controller.wait_idle(timeout)
        self.check()

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called from the copy threads whenever a copy is acknowledged."""
        self.controller.notify = wake

    def shutdown(self) -> None:
        """Stop the copy workers after flushing queued writes and their L3 backups."""
        self.l3.prefetch.cancel_all()
        self.controller.start_writing()
        self.controller.wait_idle(timeout=60)
        self.check()  # acknowledged writes queue their L3 backups
        self.controller.shutdown()
        self.check()

    def release_memory(self) -> None:
        """The engine is gone: give the pool's memory back. NOTE: not while L3 threads still
        copy from host slots."""
        if not self.l3.storage_busy():
            self.pool.release_memory()

    # ---- acks (scheduler thread) ---------------------------------------------------------------
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
                        self.pool.free(n.host_value)
                        self.tree.set_host(n, None)
                self.tree.dec_lock_ref(node)
                if op.ok:  # the parts split off above it hold objects of their own
                    for n in reversed(written):
                        self.l3.backup.backup_to_storage(n)

    def loading_check(self) -> None:
        for op in self.controller.drain_load_acks():
            for node_id in op.node_ids:
                nodes = self.ongoing_load.pop(node_id, None)
                if nodes is None:
                    continue
                self.tree.dec_lock_ref(nodes[-1])
                if not op.ok:  # the bytes never landed: drop the device copies again
                    for node in reversed(nodes):
                        if node.value is not None and node.lock_ref == 0:
                            self.allocator.free(node.value)
                            self.tree.drop_value(node)

    def land_writes(self) -> None:
        """Start the queued writes, wait until every copy landed and take the acks."""
        self.controller.start_writing()
        self.controller.wait_idle()
        self.writing_check()

    # ---- writes (l1 -> l2) ---------------------------------------------------------------------
    def backup_hot(self, device: list[TreeNode]) -> None:
        """Write the nodes of ``device`` the write policy backs up once used."""
        for node in device:
            self._maybe_backup(node)
        self.controller.start_writing()

    def _maybe_backup(self, node: TreeNode) -> None:
        if node.host_value is not None or self.write_policy == "write_back":
            return
        if self.write_policy == "write_through" or node.hit_count >= 2:
            self.write_backup(node)

    def write_backup(self, node: TreeNode) -> bool:
        """Queue a D->H copy of ``node`` (locked until acknowledged); False when no host room."""
        if node.value is None or node.host_value is not None or node.id in self.ongoing_write:
            return False
        host_indices = self.controller.write(node.value, node.id)
        if host_indices is None:
            self.eviction.evict_host(len(node.key) - self.pool.available_size())
            host_indices = self.controller.write(node.value, node.id)
        if host_indices is None:
            if self.pool.pending_free_size():
                self.waiting_writes[node.id] = node
            return False
        self.tree.set_host(node, host_indices)
        node.host_pending = object()
        self.ongoing_write[node.id] = node
        self.tree.inc_lock_ref(node)
        return True

    def retry_writes(self) -> None:
        """Write the nodes whose write found L2's room held, once some came back."""
        if not self.waiting_writes or not self.pool.available_size():
            return
        nodes, self.waiting_writes = list(self.waiting_writes.values()), {}
        for node in nodes:
            path = self.tree.path_of(node)
            if path and path[-1] is node:  # still in the tree (with its device copy or not)
                self.write_backup(node)
        self.controller.start_writing()

    # ---- loads (l2 -> l1) ----------------------------------------------------------------------
    def load_back(
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
        ``wait=False``): the copy waits for ``controller.release_loads()``; the next forward reads the KV
        from host in place (``host_reads``) instead of waiting for it."""
        self.check()
        target = match_result.last_host_node if match_result is not None else last_node
        path = self.tree.path_of(target)
        device = [n for n in path if n.value is not None]
        host_nodes = path[len(device) :]
        host_len = sum(len(n.key) for n in host_nodes)
        if host_len == 0 or host_len < self.load_back_threshold:
            return self.tree.device_prefix(device)
        last = host_nodes[-1]
        self.tree.inc_lock_ref(last)
        host_indices = torch.cat([host_value(n) for n in host_nodes])
        device_indices = self.controller.load(host_indices, last.id)
        if device_indices is None:
            self.tree.evict(host_len - self.allocator.available_size())
            device_indices = self.controller.load(host_indices, last.id)
        if device_indices is None:
            self.tree.dec_lock_ref(last)
            return self.tree.device_prefix(device)
        try:
            counter = self.controller.start_loading(hold=hold and not wait)
        except BaseException:
            # NOTE: the nodes must not point at slots nothing will ever write (a later match
            # would serve them as an L1 hit): the load never started, so undo it whole
            self.controller.cancel_queued_loads()
            self.tree.dec_lock_ref(last)
            raise
        # the copy may be running already: its ack is drained by loading_check on this thread
        offset = 0
        for node in host_nodes:
            self.tree.set_value(node, device_indices[offset : offset + len(node.key)])
            offset += len(node.key)
            self.tree.emit("promoted", "l1", len(node.key), node)
        self.counters["promotions"] += host_len
        self.ongoing_load[last.id] = host_nodes
        if not wait:
            # NOTE: overlap: the load stays in flight (``controller.current_load``); the nodes
            # are locked until ``loading_check`` drains its ack. Attention for layer i must run
            # only after layer i's KV is on device: see ``pending_layer_wait``.
            return self.tree.device_prefix([n for n in path if n.value is not None])
        counter.wait_finished()
        self.controller.wait_idle()
        self.loading_check()
        return self.tree.device_prefix([n for n in path if n.value is not None])

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
        then ``controller.release_loads()`` lets the held copies go."""
        ops = self.controller.pending_loads()
        if not ops:
            return None
        return HostReads(
            torch.cat([o.device_indices for o in ops]),
            torch.cat([o.host_indices for o in ops]),
            self.pool.layer_kv,
        )

    def wait_pending_loads(self) -> None:
        """Block until every started load landed (e.g. a batch that will not run its forward);
        the acks (unlock / error handling) are taken by the next ``check``."""
        self.controller.current_load.wait_finished()

    # ---- figures -------------------------------------------------------------------------------
    def moves(self) -> Moves:
        """The L1 <-> L2 traffic (reported on L1)."""
        c, s = self.counters, self.controller.stats
        return Moves(
            promoted_tokens=c["promotions"],
            demoted_tokens=c["demotions"],
            bytes_in=s["bytes_h2d"],
            bytes_out=s["bytes_d2h"],
        )

    def stats(self, hit_tokens: int, l3_moves: Moves) -> L2Stats:
        """L2's record; ``hit_tokens``: prompt tokens L2 served (the scheduler's count);
        ``l3_moves``: the L2 <-> L3 traffic (none without L3)."""
        host_nodes = [n for n in self.tree.all_nodes() if n.host_value is not None]
        pool = self.pool
        return L2Stats(
            capacity_tokens=pool.size,
            used_tokens=pool.size - pool.available_size(),
            evictable_tokens=sum(len(n.key) for n in host_nodes if self.eviction.is_host_leaf(n)),
            pinned_tokens=sum(len(n.key) for n in host_nodes if n.lock_ref > 0),
            hit_tokens=hit_tokens,
            evicted_tokens=self.counters["host_evictions"],
            promoted_tokens=l3_moves.promoted_tokens,
            demoted_tokens=l3_moves.demoted_tokens,
            bytes_in=l3_moves.bytes_in,
            bytes_out=l3_moves.bytes_out,
            errors=self.controller.stats["errors"],  # failed copies either way, each once
            cached_tokens=sum(len(n.key) for n in host_nodes),
            host_only_tokens=sum(len(n.key) for n in host_nodes if n.value is None),
            pending_free_tokens=pool.pending_free_size(),
            ongoing_writes=len(self.ongoing_write),
            write_policy=self.write_policy,
        )
