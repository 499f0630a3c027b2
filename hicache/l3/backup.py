"""L3Backup: storing L2's KV as L3 objects, a part of the L3 tier (``cache.l3.backup``). Bytes
move on the controller's StorageIO backup thread.

    backup   a node's D->H write is acknowledged (``hicache.l2.tier``) -> the objects ending
             inside it are read from the host slots of its path (protected until stored)
    defer    at most ``MAX_BACKUP_HOST_SHARE`` of the host pool may be protected by backups in
             flight; beyond it a node waits in ``deferred_backups`` (submitted as backups
             land), and one that leaves L2 before its turn is not backed up
    repair   L3 lost objects that L2 still holds (deleted, corrupt): the next match of that
             prefix (``hicache.l3.prefetch``) stores them again
    gate     an optional policy hook (``gate``: a tenant's L3 quota) says no to a node
    drain    at shutdown, what is queued or deferred lands within a timeout
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hicache.l3.tree import L3Tree
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.transfer.storage_io import BackupJob
from hicache.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.l3.tier import L3Tier

log = logging.getLogger(__name__)

# At most this share of the host pool may be protected by L3 backups in flight; beyond it a
# node's backup waits in ``deferred_backups`` (submitted as backups land) rather than letting a
# slow store pin all of L2. A deferred node that leaves L2 before its turn is not backed up.
MAX_BACKUP_HOST_SHARE = 0.5


class L3Backup:
    """The backups in flight and waiting, by node, over ``tree``'s host copies."""

    def __init__(self, tier: L3Tier, tree: L3Tree, host_pool: MHATokenToKVPoolHost) -> None:
        self.tier = tier
        self.tree = tree
        self.host_pool = host_pool
        self.counters = tier.l3_counters
        self.ongoing_backup: dict[int, tuple[BackupJob, list[TreeNode], str | None]] = {}
        self._repairing: set[str] = set()  # first missing key of each repair in flight
        self.deferred_backups: OrderedDict[int, TreeNode] = OrderedDict()  # node id -> node
        self.backup_host_tokens = 0  # host slots protected by backups in flight
        # optional policy hook (e.g. a tenant's L3 quota): False = do not back this node up now
        self.gate: Callable[[TreeNode], bool] | None = None

    def detached(self) -> None:
        """L3 went away (every backup landed): the deferred ones are dropped."""
        self.counters["backup_dropped_nodes"] += len(self.deferred_backups)
        self.deferred_backups.clear()
        self._repairing.clear()

    def backup_to_storage(self, node: TreeNode) -> bool:
        """Queue the objects ending inside ``node`` (host slots of its path); False when
        there is nothing to do or it cannot be done now."""
        if self.tier.storage_io is None or node.in_storage or node.host_value is None:
            return False
        if self.gate is not None and not self.gate(node):
            self.counters["backup_gated_nodes"] += 1
            return False
        path = self.tree.path_of(node)
        if not path or path[-1] is not node:
            return False  # no longer in the tree
        end = sum(len(n.key) for n in path)
        start = end - len(node.key)
        S = self.tier.object_size
        first, last = start // S, end // S
        if last <= first:
            node.in_storage = True  # no object ends inside it
            return False
        if self._host_in_flight(path, first * S, last * S):
            # NOTE: an object reaching back into a node whose device->host write has not
            # landed (written after this one: its first write found L2 full) would store
            # bytes the copy has not written yet; submitted after that write's ack
            self.deferred_backups[node.id] = node
            return False
        if self._backup_full((last - first) * S):
            if node.id not in self.deferred_backups:
                self.deferred_backups[node.id] = node
                self.counters["backup_deferred"] += 1
            return False
        return self._submit_backup(path, first, last, [node])

    def _backup_full(self, tokens: int) -> bool:
        """Would ``tokens`` more host slots in flight exceed the backups' share of L2?"""
        return (
            self.backup_host_tokens > 0
            and self.backup_host_tokens + tokens > MAX_BACKUP_HOST_SHARE * self.host_pool.size
        )

    def submit_deferred(self) -> None:
        for node_id, node in list(self.deferred_backups.items()):
            need = len(node.key) + self.tier.object_size  # at most: its objects reach back one
            if self._backup_full(need):
                return
            del self.deferred_backups[node_id]
            path = self.tree.path_of(node)
            if node.host_value is None or not path or path[-1] is not node:
                self.counters["backup_dropped_nodes"] += 1  # left L2 before its turn
                continue
            self.backup_to_storage(node)  # deferred again while a parent's write is in flight

    def _submit_backup(
        self,
        path: list[TreeNode],
        first: int,
        last: int,
        nodes: list[TreeNode],
        repair_key: str | None = None,
    ) -> bool:
        S = self.tier.object_size
        host = self._path_host_slots(path, first * S, last * S)
        if host is None:
            return False  # part of it is not in L2 (never written, or dropped)
        key = tuple(t for n in path for t in n.key)[: last * S]
        ns, tokens = self.tree.keys.split_key(key)
        job = BackupJob(ns, tokens, first, host, [n.id for n in nodes])
        self.host_pool.protect(host)
        self.backup_host_tokens += len(host)
        self.ongoing_backup[id(job)] = (job, nodes, repair_key)
        if repair_key is not None:
            self._repairing.add(repair_key)
        self.tier.io.backup(job)
        return True

    @staticmethod
    def _host_in_flight(path: list[TreeNode], lo: int, hi: int) -> bool:
        """Does a node holding token positions ``[lo, hi)`` of ``path`` wait for its host
        bytes (a device->host write not yet acknowledged)?"""
        pos = 0
        for n in path:
            a, pos = pos, pos + len(n.key)
            if pos > lo and a < hi and n.host_pending is not None:
                return True
        return False

    @staticmethod
    def _path_host_slots(path: list[TreeNode], lo: int, hi: int) -> torch.Tensor | None:
        """Host slots of token positions ``[lo, hi)`` of ``path``; None if one is not on host."""
        parts, pos = [], 0
        for n in path:
            a, b = pos, pos + len(n.key)
            pos = b
            if b <= lo or a >= hi:
                continue
            if n.host_value is None:
                return None
            parts.append(n.host_value[max(lo, a) - a : min(hi, b) - a])
        return torch.cat(parts) if parts else None

    def repair(self, key: tuple[int, ...], hit: int, end: int, first_key: str) -> None:
        """L3 holds objects ``< hit`` of ``key``; L2 has them up to ``end``: store them again
        (unless a repair from ``first_key``, the first missing object, is in flight)."""
        if first_key in self._repairing:
            return
        if self._backup_full((end - hit) * self.tier.object_size):
            return  # the next match of this prefix tries again
        last, _ = self.tree.match_node(key[: end * self.tier.object_size])
        path = self.tree.path_of(last)
        if self._host_in_flight(path, hit * self.tier.object_size, end * self.tier.object_size):
            return  # the next match of this prefix tries again, once the bytes landed
        S, pos, nodes = self.tier.object_size, 0, []
        for n in path:
            pos += len(n.key)
            if pos > hit * S:
                n.in_storage = False  # some object ending inside it is gone
                nodes.append(n)
        if self._submit_backup(path, hit, end, nodes, repair_key=first_key):
            self.counters["repaired_objects"] += end - hit

    def landed(self, job: BackupJob) -> None:
        """A backup job is done (stored, or failed): its host slots go back; its nodes are in
        L3 if every object was stored."""
        _, nodes, repair_key = self.ongoing_backup.pop(id(job))
        self._repairing.discard(repair_key)
        self.host_pool.release(job.host_indices)
        self.backup_host_tokens -= len(job.host_indices)
        if job.failed == 0:
            for n in nodes:
                n.in_storage = True
        self.tier.index.stored(job.namespace, job.path_tokens, job.keys, job.landed)

    def drain(self, timeout: float) -> int:
        """At shutdown (the scheduler stopped): every L3 backup queued or deferred (waiting for
        room) lands within ``timeout`` seconds; otherwise logs how many objects are not stored
        and stops the backup threads. Returns the objects not stored."""
        tier, host = self.tier, self.tree.host
        io, controller, deadline = tier.io, tier.controller, time.monotonic() + timeout
        tier.prefetch.cancel_all()
        controller.start_writing()  # device->host writes whose acks queue backups
        controller.wait_idle(timeout)
        while True:
            # acks: deferred backups go out as earlier ones land, and writes that waited for
            # the L2 room those held (their own backups follow)
            host.check()
            writing = host.writes_in_flight()
            if not self.ongoing_backup and not self.deferred_backups and not writing:
                return 0
            left = max(0.0, deadline - time.monotonic())
            if writing:
                if not controller.wait_idle(left):
                    break
            elif not controller.wait_storage_idle(left):
                break
        running, S = io.pending_objects(), tier.object_size
        deferred = 0
        for node in self.deferred_backups.values():
            end, n = 0, node  # type: int, TreeNode | None
            while n is not None:  # its position (whether or not it is still in the tree)
                end, n = end + len(n.key), n.parent
            deferred += end // S - (end - len(node.key)) // S
        log.warning(
            "L3: %d objects not stored at shutdown: %d in backups still running after "
            "%g s, %d waiting for backup room",
            running + deferred,
            running,
            timeout,
            deferred,
        )
        io.shutdown(timeout=0.0, warn=False)
        return running + deferred

    def in_flight_tokens(self, namespaces: frozenset[str]) -> int:
        """Tokens of ``namespaces`` whose backup is in flight."""
        return sum(
            len(job.host_indices)
            for job, _, _ in self.ongoing_backup.values()
            if job.namespace in namespaces
        )
