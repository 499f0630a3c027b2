"""L3Tier: the L3 (storage) tier of HiRadixCache: which objects to back up and when, repair of
objects L3 lost, the acks of L3 work, attach / detach at run time, clear / delete, figures.
Its prefetches (L3 -> L2) and the admission of the requests waiting for them are its parts
``prefetch`` (``hicache.l3.prefetch``) and ``admission`` (``hicache.l3.admission``). Bytes move
on the controller's StorageIO threads.

Objects are ``S`` = ``object_size`` tokens, aligned from the root of the token path; object
``i`` covers tokens ``[i*S, (i+1)*S)`` and "ends inside" the node that holds token
``(i+1)*S - 1``. A tail shorter than S has no object.

    backup   a node's D->H write is acknowledged -> the objects ending inside it are read from
             the host slots of its path (protected until stored) by the backup thread
    repair   L3 lost objects that L2 still holds (deleted, corrupt): the next match of that
             prefix backs them up again.
    events   ``l3_index`` (hicache.l3.index) keeps the objects known stored, for routers' KV
             events: one call where a backup is acknowledged, an exists check answers, a
             prefetch read lands, objects are deleted or L3 is cleared (a file L3 reports its
             own changes: these calls are then no-ops).

The tier reaches the tree only through ``L3Tree`` (``hicache.l3.tree``); with no backend
attached (``storage_io`` None) it is the "no L3" state: every call answers as an empty tier.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from hicache.errors import StorageBusyError
from hicache.l3.admission import L3Admission
from hicache.l3.index import L3Index
from hicache.l3.prefetch import L3Prefetch
from hicache.l3.tree import L3Tree
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.observe.stats import L3Stats, Moves, l3_stats
from hicache.storage.base import StorageBackend
from hicache.transfer.controller import HiCacheController
from hicache.transfer.storage_io import BackupJob, StorageIO
from hicache.tree.node import TreeNode

log = logging.getLogger(__name__)

# At most this share of the host pool may be protected by L3 backups in flight; beyond it a
# node's backup waits in ``deferred_backups`` (submitted as backups land) rather than letting a
# slow store pin all of L2. A deferred node that leaves L2 before its turn is not backed up.
MAX_BACKUP_HOST_SHARE = 0.5
# Admin flush / reset let pending L3 work land for at most this long (a hung store must not
# hang the scheduler thread)
STORAGE_SETTLE_S = 30.0
FLUSH_SETTLE_S = 2.0  # a flush of L3 on the scheduler thread waits at most this for L3 work


class L3Tier:
    """L3 state and decisions over ``tree``'s host copies (``host_pool``), moved by
    ``controller``'s StorageIO."""

    def __init__(
        self,
        tree: L3Tree,
        host_pool: MHATokenToKVPoolHost,
        controller: HiCacheController,
        prefetch_policy: str = "timeout",
        prefetch_timeout_base: float = 1.0,
        prefetch_timeout_per_ki_token: float = 0.25,
        prefetch_threshold: int = 0,
    ) -> None:
        self.tree = tree
        self.host_pool = host_pool
        self.controller = controller
        self.storage_io = controller.storage_io
        self.object_size = self.storage_io.object_size if self.storage_io is not None else 0
        self.l3_index = self._new_l3_index()
        self.ongoing_backup: dict[int, tuple[BackupJob, list[TreeNode], str | None]] = {}
        self._repairing: set[str] = set()  # first missing key of each repair in flight
        self.deferred_backups: OrderedDict[int, TreeNode] = OrderedDict()  # node id -> node
        self.backup_host_tokens = 0  # host slots protected by backups in flight
        # optional policy hook (e.g. a tenant's L3 quota): False = do not back this node up now
        self.backup_gate: Callable[[TreeNode], bool] | None = None
        self.l3_counters = {
            "prefetch_started": 0,
            "prefetch_tokens": 0,
            "prefetch_skipped": 0,
            "prefetch_cancelled": 0,
            "prefetch_discarded_tokens": 0,
            "prefetch_partial": 0,
            "backup_deferred": 0,
            "backup_dropped_nodes": 0,
            "repaired_objects": 0,
            "backup_gated_nodes": 0,
            "prefetch_yielded": 0,
        }
        self.prefetch = L3Prefetch(
            self,
            tree,
            host_pool,
            prefetch_policy,
            prefetch_timeout_base,
            prefetch_timeout_per_ki_token,
            prefetch_threshold,
        )
        self.admission = L3Admission(self)

    @property
    def storage(self) -> StorageBackend | None:
        """The attached backend (None: no L3)."""
        return self.storage_io.storage if self.storage_io is not None else None

    @property
    def _io(self) -> StorageIO:
        """The attached L3's I/O; NOTE: only called while L3 is attached."""
        if self.storage_io is None:
            raise RuntimeError("no L3 backend is attached")
        return self.storage_io

    @property
    def index(self) -> L3Index:
        """The attached L3's index; NOTE: only called while L3 is attached."""
        if self.l3_index is None:
            raise RuntimeError("no L3 backend is attached")
        return self.l3_index

    def _new_l3_index(self) -> L3Index | None:
        io = self.storage_io
        return None if io is None else L3Index(io.storage, io.fingerprint, io.object_size)

    def has_storage(self) -> bool:
        return self.storage_io is not None

    # ---- keys --------------------------------------------------------------------------------
    def storage_keys(self, key: tuple[int, ...]) -> list[str]:
        """Object keys of a (namespaced, aligned) tree key; [] without L3."""
        if self.storage_io is None:
            return []
        ns, tokens = self.tree.split_key(key)
        return self.storage_io.keys(tokens, ns)

    def storage_hit(self, keys: list[str]) -> int:
        """Leading ``keys`` present in L3 (0 on error)."""
        if self.storage_io is None or not keys:
            return 0
        try:
            return self.storage_io.storage.batch_exists(keys)
        except Exception:
            log.exception("L3 exists failed")
            self._io.stats["prefetch_errors"] += 1
            return 0

    def storage_prefix_len(self, key: list[int], namespace: str | None = None) -> int:
        """Tokens of ``key``'s prefix held by L3 (whole objects; admin MatchPrefix)."""
        if self.storage_io is None:
            return 0
        keys = self.storage_keys(self.tree.tree_key(key, namespace))
        hit = self.storage_hit(keys)
        self.index.found(namespace, key, keys, hit)
        return hit * self.object_size

    # ---- backup (L2 -> L3) -------------------------------------------------------------------
    def backup_to_storage(self, node: TreeNode) -> bool:
        """Queue the objects ending inside ``node`` (host slots of its path); False when
        there is nothing to do or it cannot be done now."""
        if self.storage_io is None or node.in_storage or node.host_value is None:
            return False
        if self.backup_gate is not None and not self.backup_gate(node):
            self.l3_counters["backup_gated_nodes"] += 1
            return False
        path = self.tree.path_of(node)
        if not path or path[-1] is not node:
            return False  # no longer in the tree
        end = sum(len(n.key) for n in path)
        start = end - len(node.key)
        S = self.object_size
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
                self.l3_counters["backup_deferred"] += 1
            return False
        return self._submit_backup(path, first, last, [node])

    def _backup_full(self, tokens: int) -> bool:
        """Would ``tokens`` more host slots in flight exceed the backups' share of L2?"""
        return (
            self.backup_host_tokens > 0
            and self.backup_host_tokens + tokens > MAX_BACKUP_HOST_SHARE * self.host_pool.size
        )

    def _submit_deferred(self) -> None:
        for node_id, node in list(self.deferred_backups.items()):
            need = len(node.key) + self.object_size  # at most: its objects reach back one
            if self._backup_full(need):
                return
            del self.deferred_backups[node_id]
            path = self.tree.path_of(node)
            if node.host_value is None or not path or path[-1] is not node:
                self.l3_counters["backup_dropped_nodes"] += 1  # left L2 before its turn
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
        S = self.object_size
        host = self._path_host_slots(path, first * S, last * S)
        if host is None:
            return False  # part of it is not in L2 (never written, or dropped)
        key = tuple(t for n in path for t in n.key)[: last * S]
        ns, tokens = self.tree.split_key(key)
        job = BackupJob(ns, tokens, first, host, [n.id for n in nodes])
        self.host_pool.protect(host)
        self.backup_host_tokens += len(host)
        self.ongoing_backup[id(job)] = (job, nodes, repair_key)
        if repair_key is not None:
            self._repairing.add(repair_key)
        self._io.backup(job)
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
        if self._backup_full((end - hit) * self.object_size):
            return  # the next match of this prefix tries again
        last, _ = self.tree.match_node(key[: end * self.object_size])
        path = self.tree.path_of(last)
        if self._host_in_flight(path, hit * self.object_size, end * self.object_size):
            return  # the next match of this prefix tries again, once the bytes landed
        S, pos, nodes = self.object_size, 0, []
        for n in path:
            pos += len(n.key)
            if pos > hit * S:
                n.in_storage = False  # some object ending inside it is gone
                nodes.append(n)
        if self._submit_backup(path, hit, end, nodes, repair_key=first_key):
            self.l3_counters["repaired_objects"] += end - hit

    # ---- acks (scheduler thread) ---------------------------------------------------------------
    def storage_check(self) -> None:
        """Drain L3 acks: release backup host slots, collect finished prefetches."""
        io = self.storage_io
        if io is None:
            return
        for job in io.drain_backup_acks():
            self._backup_landed(job)
        self._submit_deferred()
        for op in io.drain_prefetch_acks():
            self.prefetch.landed(op)

    def _backup_landed(self, job: BackupJob) -> None:
        """A backup job is done (stored, or failed): its host slots go back; its nodes are in
        L3 if every object was stored."""
        _, nodes, repair_key = self.ongoing_backup.pop(id(job))
        self._repairing.discard(repair_key)
        self.host_pool.release(job.host_indices)
        self.backup_host_tokens -= len(job.host_indices)
        if job.failed == 0:
            for n in nodes:
                n.in_storage = True
        self.index.stored(job.namespace, job.path_tokens, job.keys, job.landed)

    def drain_storage(self, timeout: float) -> int:
        """At shutdown (the scheduler stopped): every L3 backup queued or deferred (waiting for
        room) lands within ``timeout`` seconds; otherwise logs how many objects are not stored
        and stops the backup threads. Returns the objects not stored."""
        io, deadline = self._io, time.monotonic() + timeout
        self.prefetch.cancel_all()
        self.controller.start_writing()  # device->host writes whose acks queue backups
        self.controller.wait_idle(timeout)
        while True:
            # acks: deferred backups go out as earlier ones land, and writes that waited for
            # the L2 room those held (their own backups follow)
            self.tree.check()
            writing = self.tree.writes_in_flight()
            if not self.ongoing_backup and not self.deferred_backups and not writing:
                return 0
            left = max(0.0, deadline - time.monotonic())
            if writing:
                if not self.controller.wait_idle(left):
                    break
            elif not self.controller.wait_storage_idle(left):
                break
        running, S = io.pending_objects(), self.object_size
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

    def backup_in_flight_tokens(self, namespaces: frozenset[str]) -> int:
        return sum(
            len(job.host_indices)
            for job, _, _ in self.ongoing_backup.values()
            if job.namespace in namespaces
        )

    def set_backup_gate(self, gate: Callable[[TreeNode], bool] | None) -> None:
        self.backup_gate = gate

    def storage_info(self) -> dict[str, Any]:
        io = self.storage_io
        if io is None:
            return {"attached": False}
        info: dict[str, Any] = dict(io.storage.describe())
        info.setdefault("backend", type(io.storage).__name__)
        info.update(attached=True, object_tokens=io.object_size, pending=io.pending())
        return info

    def storage_busy(self) -> bool:
        """Are L3 backups or prefetches in flight (a flush of L3 would have to wait)?"""
        return self.storage_io is not None and self.storage_io.pending() > 0

    def _settle_storage(self, timeout: float) -> StorageBackend:
        """Waits up to ``timeout`` for the L3 work in flight and takes its acks; raises
        StorageBusyError (changing nothing on L3) when a stalled store keeps it. Returns the
        attached backend."""
        if not self.controller.wait_storage_idle(timeout):
            raise StorageBusyError(
                f"L3 still has {self._io.pending()} backups / prefetches in flight after "
                f"{timeout:g} s; L3 was not changed"
            )
        self.storage_check()
        return self._io.storage

    def clear_storage(self, timeout: float = FLUSH_SETTLE_S) -> int:
        """Empty L3 (after pending backups landed); returns 0 (tokens are not counted). Raises
        StorageBusyError when they do not land within ``timeout`` (the scheduler thread must
        not wait on a stalled store)."""
        self._settle_storage(timeout).clear()
        self.index.cleared()
        for n in self.tree.all_nodes():
            n.in_storage = False
        self.tree.bump_version()
        return 0

    def delete_from_storage(self, nodes: list[TreeNode]) -> int:
        """Deletes the L3 objects ending inside each of ``nodes`` (after pending backups
        landed) and returns how many there were: a flush of some namespaces, whose objects
        this tree knows, leaving every other namespace's objects alone."""
        if self.storage_io is None:
            return 0
        storage = self._settle_storage(FLUSH_SETTLE_S)
        deleted, S = 0, self.object_size
        for node in nodes:
            path = self.tree.path_of(node)
            if not path or path[-1] is not node:
                continue
            key = tuple(t for n in path for t in n.key)
            for k in self.storage_keys(key)[(len(key) - len(node.key)) // S :]:
                storage.delete(k)
                self.index.lost(k)
                deleted += 1
            node.in_storage = False
        self.tree.bump_version()
        return deleted

    # ---- attach / detach at run time (scheduler thread) ----------------------------------------
    def attach_storage(self, storage: StorageBackend, object_size: int) -> None:
        """Use ``storage`` as L3 from now on. Nodes already in L2 are backed up to it when a
        request next matches them (the repair path); new writes as they land."""
        if self.storage_io is not None:
            raise StorageBusyError("an L3 backend is already attached; detach it first")
        if object_size % self.tree.page_size:
            raise ValueError(
                f"L3 object size {object_size} is not a multiple of the page size "
                f"{self.tree.page_size}"
            )
        self.storage_io = self.controller.attach_storage(storage, object_size)
        self.object_size = object_size
        self.l3_index = self._new_l3_index()
        for n in self.tree.all_nodes():
            n.in_storage = False
        self.tree.bump_version()

    def detach_storage(self, timeout: float = STORAGE_SETTLE_S) -> StorageBackend | None:
        """Stop using L3 and return the backend (None if none was attached). Queued backups
        and prefetches finish first; what prefetches read enters L2 as usual (the requests
        waiting for them go on). Raises StorageBusyError, changing nothing, when they do not
        finish within ``timeout`` (a hung store: its threads still read host slots)."""
        if self.storage_io is None:
            return None
        if not self.controller.wait_storage_idle(timeout):
            raise StorageBusyError(
                f"L3 still has {self.storage_io.pending()} backups / prefetches in flight after "
                f"{timeout:g} s; nothing was detached"
            )
        self.l3_counters["backup_dropped_nodes"] += len(self.deferred_backups)
        self.deferred_backups.clear()  # (before the check, which would submit them)
        self.storage_check()  # every op is done: releases backup slots, collects prefetches
        storage = self.storage_io.storage
        if not self.controller.detach_storage(0.0):
            raise AssertionError("L3 work was queued while detaching")
        self.storage_io = None
        self.index.close()
        self.l3_index = None
        for n in self.tree.all_nodes():
            n.in_storage = False
        self._repairing.clear()
        self.tree.bump_version()
        return storage

    def node_in_storage(self, node: TreeNode) -> bool:
        """Are the L3 objects ending inside ``node`` stored (asks the backend)?"""
        if self.storage_io is None:
            return False
        path = self.tree.path_of(node)
        if not path or path[-1] is not node:
            return False
        key = tuple(t for n in path for t in n.key)
        start, S = len(key) - len(node.key), self.object_size
        keys = self.storage_keys(key)[start // S :]
        return bool(keys) and all(self.storage_io.storage.exists_mask(keys))

    def storage_stats(self, hit_tokens: int) -> tuple[L3Stats, Moves]:
        """L3's record and the L2 <-> L3 traffic (reported on L2); ``hit_tokens``: prompt
        tokens L3 served (the scheduler's count)."""
        io = self._io
        return l3_stats(
            hit_tokens=hit_tokens,
            backend=io.storage.stats(),
            describe=io.storage.describe(),
            object_tokens=self.object_size,
            bytes_per_token=self.controller.bytes_per_token,
            prefetch_policy=self.prefetch.prefetch_policy,
            io=io.stats,
            counters=self.l3_counters,
            pending_backups=len(self.ongoing_backup),
            deferred_backups=len(self.deferred_backups),
            pending_prefetches=len(self.prefetch.ongoing_prefetch),
        )
