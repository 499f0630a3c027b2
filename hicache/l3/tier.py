"""L3Tier: the L3 (storage) tier of HiRadixCache (``cache.l3``): the attached backend (attach /
detach at run time), what it holds (a prefix's objects, a node's, the index of objects known
stored), the acks of L3 work, clear / delete, figures. Its backups (L2 -> L3) and prefetches
(L3 -> L2) are its parts ``backup`` (``hicache.l3.backup``) and ``prefetch``
(``hicache.l3.prefetch``); which waiting request reads its L3 hit when, and may be admitted, is
the scheduler's cache manager's decision (engine/runtime/scheduler/cache.py), over
``prefetch``'s calls. Bytes move on the controller's StorageIO threads.

Objects are ``S`` = ``object_size`` tokens, aligned from the root of the token path; object
``i`` covers tokens ``[i*S, (i+1)*S)`` and "ends inside" the node that holds token
``(i+1)*S - 1``. A tail shorter than S has no object.

    events   ``l3_index`` (hicache.l3.index) keeps the objects known stored, for routers' KV
             events: one call where a backup is acknowledged, an exists check answers, a
             prefetch read lands, objects are deleted or L3 is cleared (a file L3 reports its
             own changes: these calls are then no-ops).

The tier reaches the tree only through ``L3Tree`` (``hicache.l3.tree``); with no backend
attached (``storage_io`` None) it is the "no L3" state: every call answers as an empty tier.
"""

from __future__ import annotations

import logging
from typing import Any

from hicache.errors import StorageBusyError
from hicache.l3.backup import L3Backup
from hicache.l3.index import L3Index
from hicache.l3.prefetch import L3Prefetch
from hicache.l3.tree import L3Tree
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.observe.stats import L3Stats, Moves, l3_stats
from hicache.storage.base import StorageBackend
from hicache.transfer.controller import HiCacheController
from hicache.transfer.storage_io import StorageIO
from hicache.tree.node import TreeNode

log = logging.getLogger(__name__)

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
        self.backup = L3Backup(self, tree, host_pool)

    @property
    def storage(self) -> StorageBackend | None:
        """The attached backend (None: no L3)."""
        return self.storage_io.storage if self.storage_io is not None else None

    @property
    def io(self) -> StorageIO:
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
        ns, tokens = self.tree.keys.split_key(key)
        return self.storage_io.keys(tokens, ns)

    def storage_hit(self, keys: list[str]) -> int:
        """Leading ``keys`` present in L3 (0 on error)."""
        if self.storage_io is None or not keys:
            return 0
        try:
            return self.storage_io.storage.batch_exists(keys)
        except Exception:
            log.exception("L3 exists failed")
            self.io.stats["prefetch_errors"] += 1
            return 0

    def storage_prefix_len(self, key: list[int], namespace: str | None = None) -> int:
        """Tokens of ``key``'s prefix held by L3 (whole objects; admin MatchPrefix)."""
        if self.storage_io is None:
            return 0
        keys = self.storage_keys(self.tree.keys.tree_key(key, namespace))
        hit = self.storage_hit(keys)
        self.index.found(namespace, key, keys, hit)
        return hit * self.object_size

    # ---- acks (scheduler thread) ---------------------------------------------------------------
    def storage_check(self) -> None:
        """Drain L3 acks: release backup host slots, collect finished prefetches."""
        io = self.storage_io
        if io is None:
            return
        for job in io.drain_backup_acks():
            self.backup.landed(job)
        self.backup.submit_deferred()
        for op in io.drain_prefetch_acks():
            self.prefetch.landed(op)

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
                f"L3 still has {self.io.pending()} backups / prefetches in flight after "
                f"{timeout:g} s; L3 was not changed"
            )
        self.storage_check()
        return self.io.storage

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
        self.backup.detached()  # the deferred ones go before the check would submit them
        self.storage_check()  # every op is done: releases backup slots, collects prefetches
        storage = self.storage_io.storage
        if not self.controller.detach_storage(0.0):
            raise AssertionError("L3 work was queued while detaching")
        self.storage_io = None
        self.index.close()
        self.l3_index = None
        for n in self.tree.all_nodes():
            n.in_storage = False
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
        io = self.io
        return l3_stats(
            hit_tokens=hit_tokens,
            backend=io.storage.stats(),
            describe=io.storage.describe(),
            object_tokens=self.object_size,
            bytes_per_token=self.controller.bytes_per_token,
            prefetch_policy=self.prefetch.prefetch_policy,
            io=io.stats,
            counters=self.l3_counters,
            pending_backups=len(self.backup.ongoing_backup),
            deferred_backups=len(self.backup.deferred_backups),
            pending_prefetches=len(self.prefetch.ongoing_prefetch),
        )
