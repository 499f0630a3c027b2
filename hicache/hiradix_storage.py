"""The L3 half of HiRadixCache: which objects to back up, which to prefetch, and how a
prefetch enters the tree. Bytes move on the controller's StorageIO threads.

Objects are ``S`` = ``object_size`` tokens, aligned from the root of the token path; object
``i`` covers tokens ``[i*S, (i+1)*S)`` and "ends inside" the node that holds token
``(i+1)*S - 1``. A tail shorter than S has no object.

    backup   a node's D->H write is acknowledged -> the objects ending inside it are read from
             the host slots of its path (protected until stored) by the backup thread
    prefetch a waiting request matched m tokens in L1+L2 and L3 holds objects up to h*S > m:
             objects m//S .. h-1 are read into fresh host slots by the prefetch thread
             positions:  0 ........ (m//S)*S ..... m ............... h*S
                         | tree (L1/L2)          |  new host-only node |
                         |           | prefetched; the part < m is freed |
             The request's turn (``poll_prefetch``) or the read's end inserts what landed.
    repair   L3 lost objects that L2 still holds (deleted, corrupt): the next match of that
             prefix backs them up again.

NOTE: a pending prefetch holds ``host_ref`` on its anchor node (the end of the tree match, then
the inserted node), so host eviction cannot take the path it will hang from.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hicache.base_prefix_cache import MatchResult, PrefetchStart
from hicache.controller import HiCacheController
from hicache.host_pool import MHATokenToKVPoolHost
from hicache.radix_cache import RadixCache, TreeNode
from hicache.stats import L3Stats, Moves, l3_stats
from hicache.storage_io import BackupJob, PrefetchOperation, StorageIO

log = logging.getLogger(__name__)

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# At most this share of the host pool may be protected by L3 backups in flight; beyond it a
# node's backup waits in ``deferred_backups`` (submitted as backups land) rather than letting a
# slow store pin all of L2. A deferred node that leaves L2 before its turn is not backed up.
MAX_BACKUP_HOST_SHARE = 0.5
# Admin flush / reset let pending L3 work land for at most this long (a hung store must not
# hang the scheduler thread)
STORAGE_SETTLE_S = 30.0
FLUSH_SETTLE_S = 2.0  # a flush of L3 on the scheduler thread waits at most this for L3 work


class StorageBusyError(RuntimeError):
    """L3 cannot be attached / detached now (one is attached; work is still in flight)."""


@dataclass
class PrefetchState:
    op: PrefetchOperation
    anchor: TreeNode | None  # holds host_ref until the request is admitted or goes away
    key: tuple[int, ...]  # namespaced tree key up to the end of the last object
    start: int  # token position of the first object (a multiple of S)
    inserted: int = 0  # tokens the tree took from it
    collected: bool = False


class StorageMixin(RadixCache):
    """The L3 half of HiRadixCache: a RadixCache with a host pool and a controller (set by
    HiRadixCache) whose host copies are backed up to and prefetched from L3."""

    controller: HiCacheController
    host_pool: MHATokenToKVPoolHost
    ongoing_write: dict[int, TreeNode]  # device->host writes not yet acknowledged

    def _init_storage(self, policy: str, timeout_base: float, timeout_per_ki_token: float,
                      threshold: int) -> None:
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {policy!r}; expected {PREFETCH_POLICIES}")
        self.prefetch_policy = policy
        self.prefetch_timeout_base = timeout_base
        self.prefetch_timeout_per_ki_token = timeout_per_ki_token
        self.prefetch_threshold = threshold
        self.storage_io = self.controller.storage_io
        self.object_size = self.storage_io.object_size if self.storage_io is not None else 0
        self.ongoing_prefetch: dict[str, PrefetchState] = {}
        self._prefetch_by_op: dict[int, PrefetchState] = {}
        self.ongoing_backup: dict[int, tuple[BackupJob, list[TreeNode], str | None]] = {}
        self._repairing: set[str] = set()  # first missing key of each repair in flight
        self.deferred_backups: OrderedDict[int, TreeNode] = OrderedDict()  # node id -> node
        self.backup_host_tokens = 0  # host slots protected by backups in flight
        # optional policy hook (e.g. a tenant's L3 quota): False = do not back this node up now
        self.backup_gate: Callable[[TreeNode], bool] | None = None
        self.l3_counters = {"prefetch_started": 0, "prefetch_tokens": 0, "prefetch_skipped": 0,
                            "prefetch_cancelled": 0, "prefetch_discarded_tokens": 0,
                            "prefetch_partial": 0, "backup_deferred": 0,
                            "backup_dropped_nodes": 0, "repaired_objects": 0,
                            "backup_gated_nodes": 0, "prefetch_yielded": 0}

    @property
    def _io(self) -> StorageIO:
        """The attached L3's I/O; NOTE: only called while L3 is attached."""
        if self.storage_io is None:
            raise RuntimeError("no L3 backend is attached")
        return self.storage_io

    # ---- keys --------------------------------------------------------------------------------
    def storage_keys(self, key: tuple[int, ...]) -> list[str]:
        """Object keys of a (namespaced, aligned) tree key; [] without L3."""
        if self.storage_io is None:
            return []
        ns, tokens = self.split_key(key)
        return self.storage_io.keys(tokens, ns)

    def storage_hit(self, keys: list[str]) -> int:
        """Leading ``keys`` present in L3 (0 on error)."""
        if self.storage is None or not keys:
            return 0
        try:
            return self.storage.batch_exists(keys)
        except Exception:
            log.exception("L3 exists failed")
            self._io.stats["prefetch_errors"] += 1
            return 0

    def storage_prefix_len(self, key: list[int], namespace: str | None = None) -> int:
        """Tokens of ``key``'s prefix held by L3 (whole objects; admin MatchPrefix)."""
        if self.storage_io is None:
            return 0
        full = self._align(self.key_of(key, namespace))
        return self.storage_hit(self.storage_keys(full)) * self.object_size

    # ---- backup (L2 -> L3) -------------------------------------------------------------------
    def backup_to_storage(self, node: TreeNode) -> bool:
        """Queue the objects ending inside ``node`` (host slots of its path); False when
        there is nothing to do or it cannot be done now."""
        if self.storage_io is None or node.in_storage or node.host_value is None:
            return False
        if self.backup_gate is not None and not self.backup_gate(node):
            self.l3_counters["backup_gated_nodes"] += 1
            return False
        path = self._path(node)
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
        return (self.backup_host_tokens > 0 and self.backup_host_tokens + tokens
                > MAX_BACKUP_HOST_SHARE * self.host_pool.size)

    def _submit_deferred(self) -> None:
        for node_id, node in list(self.deferred_backups.items()):
            need = len(node.key) + self.object_size  # at most: its objects reach back one
            if self._backup_full(need):
                return
            del self.deferred_backups[node_id]
            if node.host_value is None or not self._path(node) or self._path(node)[-1] is not node:
                self.l3_counters["backup_dropped_nodes"] += 1  # left L2 before its turn
                continue
            self.backup_to_storage(node)  # deferred again while a parent's write is in flight

    def _submit_backup(self, path: list[TreeNode], first: int, last: int,
                       nodes: list[TreeNode], repair_key: str | None = None) -> bool:
        S = self.object_size
        host = self._path_host_slots(path, first * S, last * S)
        if host is None:
            return False  # part of it is not in L2 (never written, or dropped)
        key = tuple(t for n in path for t in n.key)[: last * S]
        ns, tokens = self.split_key(key)
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

    def _path_host_slots(self, path: list[TreeNode], lo: int, hi: int) -> torch.Tensor | None:
        """Host slots of token positions ``[lo, hi)`` of ``path``; None if one is not on host."""
        parts, pos = [], 0
        for n in path:
            a, b = pos, pos + len(n.key)
            pos = b
            if b <= lo or a >= hi:
                continue
            if n.host_value is None:
                return None
            parts.append(n.host_value[max(lo, a) - a: min(hi, b) - a])
        return torch.cat(parts) if parts else None

    # ---- prefetch (L3 -> L2) -----------------------------------------------------------------
    def prefetch_keys(self, token_ids: list[int], namespace: str | None) -> list[str]:
        """The object keys of a request's tokens (compute once per request)."""
        return self.storage_keys(self._align(self.key_of(token_ids, namespace)))

    def start_prefetch(self, req_id: str, token_ids: list[int], namespace: str | None,
                       match: MatchResult, keys: list[str] | None = None) -> PrefetchStart:
        """A waiting request matched ``token_ids`` (``match``: its L1 + L2 match; ``keys``:
        ``prefetch_keys`` of them, computed once by the caller): start reading the L3 objects
        beyond the match. Returns the tokens that will add and L3's prefix of the request.
        Also repairs objects L3 lost that L2 still holds. No-op while the request has a
        prefetch."""
        if self.storage_io is None or req_id in self.ongoing_prefetch:
            return PrefetchStart(0, 0)
        key = self._align(self.key_of(token_ids, namespace))
        keys = self.storage_keys(key) if keys is None else keys[: len(key) // self.object_size]
        if not keys:
            return PrefetchStart(0, 0)
        S = self.object_size
        matched = len(match.device_indices) + match.host_hit_length
        hit = self.storage_hit(keys)
        in_l3 = hit * S
        if hit < matched // S and keys[hit] not in self._repairing:
            self._repair(key, hit, matched // S, keys[hit])
        first = matched // S
        new_tokens = hit * S - matched
        if new_tokens <= 0 or new_tokens < self.prefetch_threshold:
            return PrefetchStart(0, in_l3)
        anchor = match.last_host_node
        self._protect_host(anchor)
        need = (hit - first) * S
        if self.host_pool.available_size() < need:
            self.evict_host(need - self.host_pool.available_size())
        # L2 too full for all of it: the leading objects that fit, if still worth it
        fit = min(hit - first, self.host_pool.available_size() // S)
        new_tokens = (first + fit) * S - matched
        host = self.host_pool.alloc(fit * S) if fit and new_tokens >= max(
            1, self.prefetch_threshold) else None
        if host is None:
            self._release_host(anchor)
            self.l3_counters["prefetch_skipped"] += 1
            return PrefetchStart(0, in_l3)
        hit = first + fit
        self.host_pool.protect(host)
        op = PrefetchOperation(req_id, keys[first:hit], host)
        st = PrefetchState(op, anchor, key[: hit * S], first * S)
        self.ongoing_prefetch[req_id] = st
        self._prefetch_by_op[id(op)] = st
        self.l3_counters["prefetch_started"] += 1
        self.storage_io.prefetch(op)
        return PrefetchStart(new_tokens, in_l3)

    def poll_prefetch(self, req_id: str) -> int | None:
        """At the request's turn: None while the prefetch policy says wait; otherwise the tokens
        its prefetch put in the tree (0 without one). The tokens stay protected from host
        eviction until ``finish_prefetch`` (admission) or ``cancel_prefetch``."""
        st = self.ongoing_prefetch.get(req_id)
        if st is None:
            return 0
        if not st.collected:
            if not self._can_terminate(st.op):
                return None
            self._collect(st)
        return st.inserted

    def finish_prefetch(self, req_id: str) -> None:
        """The request was admitted (its path is locked now): drop the prefetch's state."""
        st = self.ongoing_prefetch.get(req_id)
        if st is None:
            return
        if not st.collected:
            self._collect(st)
        self._finish_prefetch(req_id)

    def prefetch_deadline(self) -> float | None:
        """Earliest time.monotonic() at which a waiting prefetch times out (timeout policy)."""
        if self.prefetch_policy != "timeout":
            return None
        times = [st.op.start_time + self._timeout(st.op)
                 for st in self.ongoing_prefetch.values() if not st.collected]
        return min(times) if times else None

    def cancel_prefetch(self, req_id: str) -> None:
        """The request went away: stop reading, give its host slots back."""
        st = self.ongoing_prefetch.get(req_id)
        if st is None:
            return
        if not st.collected:
            st.op.terminate()
            self.host_pool.free(st.op.host_indices)  # deferred until the thread is done
            st.collected = True
            self.l3_counters["prefetch_cancelled"] += 1
        self._finish_prefetch(req_id)

    def has_prefetch(self, req_id: str) -> bool:
        return req_id in self.ongoing_prefetch

    def yield_prefetch(self, req_id: str) -> int:
        """``req_id``'s landed prefetch gives its L2 room to a request that goes first: its
        objects stay in the tree, no longer protected (evictable); the request prefetches again
        at its own turn (L3 still holds them). Returns those tokens; 0 (nothing done) while
        the read is in flight: its slots would come back only once it returns."""
        st = self.ongoing_prefetch.get(req_id)
        if st is None or not st.collected:
            return 0
        self.l3_counters["prefetch_yielded"] += 1
        self._finish_prefetch(req_id)
        return st.inserted

    def cancel_all_prefetches(self) -> None:
        for req_id in list(getattr(self, "ongoing_prefetch", {})):
            self.cancel_prefetch(req_id)

    def fetch_from_storage(self, key: list[int], namespace: str | None = None,
                           timeout: float | None = 60.0) -> int:
        """Read ``key``'s L3 objects beyond the tree into L2 now (blocking; admin warm-up and
        tests). Returns the tokens added."""
        req_id = f"fetch-{time.monotonic_ns()}"
        self.start_prefetch(req_id, key, namespace,
                            self.match_prefix(key, namespace=namespace, touch=False))
        if req_id not in self.ongoing_prefetch:
            return 0
        self._io.wait_idle(timeout)
        self.storage_check()
        got = self.ongoing_prefetch[req_id].inserted
        self.finish_prefetch(req_id)
        return got

    def _timeout(self, op: PrefetchOperation) -> float:
        return (self.prefetch_timeout_base
                + self.prefetch_timeout_per_ki_token * len(op.keys) * self.object_size / 1024)

    def _can_terminate(self, op: PrefetchOperation) -> bool:
        if op.done or op.complete or self.prefetch_policy == "best_effort":
            return True
        if self.prefetch_policy == "wait_complete":
            return False
        return time.monotonic() - op.start_time >= self._timeout(op)

    def _collect(self, st: PrefetchState) -> None:
        """Take the objects that landed into the tree; free the rest."""
        S = self.object_size
        n = st.op.terminate()
        st.collected = True
        if n < len(st.op.keys):
            self.l3_counters["prefetch_partial"] += 1
        end = st.start + n * S
        host = st.op.host_indices
        inserted = self._insert_host(st.key[:end], st.start, host[: n * S]) if n else 0
        if n < len(st.op.keys):
            self.host_pool.free(host[n * S:])
        st.inserted = inserted
        self.l3_counters["prefetch_tokens"] += inserted
        # the protection moves to the node that now ends the path, until admission
        new_anchor = self._node_at(st.key[:end]) if inserted else None
        if new_anchor is not None:
            self._protect_host(new_anchor)
        if st.anchor is not None:
            self._release_host(st.anchor)
        st.anchor = new_anchor

    def _finish_prefetch(self, req_id: str) -> None:
        st = self.ongoing_prefetch.pop(req_id)
        if st.anchor is not None:
            self._release_host(st.anchor)
            st.anchor = None
        if st.op.done:
            self._prefetch_by_op.pop(id(st.op), None)

    def _insert_host(self, key: tuple[int, ...], start: int, host: torch.Tensor) -> int:
        """Hang ``key[start:]`` (host slots ``host``) below the tree's match of ``key`` as a
        host-only node; slots of tokens the tree already has are freed. Returns tokens added."""
        _, last, matched = self._match_helper(key, hit=None)
        if matched < start or matched >= len(key):
            # a gap (the prefix was evicted meanwhile) or everything is there already
            self.host_pool.free(host)
            if matched < start:
                self.l3_counters["prefetch_discarded_tokens"] += len(host)
            return 0
        skip = matched - start
        if skip:
            self.host_pool.free(host[:skip])
        node = TreeNode(key[matched:])
        node.parent = last
        node.in_storage = True
        last.children[self._page_key(node.key)] = node
        self._set_host(node, host[skip:].clone())
        self._emit("stored", "l2", len(node.key), node)
        return len(node.key)

    def _node_at(self, key: tuple[int, ...]) -> TreeNode | None:
        _, node, matched = self._match_helper(key, hit=None)
        return node if matched == len(key) and node is not self.root_node else None

    def _protect_host(self, node: TreeNode) -> None:
        node.host_ref += 1

    def _release_host(self, node: TreeNode) -> None:
        if node.host_ref <= 0:
            raise AssertionError(f"release_host on unprotected {node!r}")
        node.host_ref -= 1

    def _repair(self, key: tuple[int, ...], hit: int, end: int, first_key: str) -> None:
        """L3 holds objects ``< hit`` of ``key``; L2 has them up to ``end``: store them again."""
        if self._backup_full((end - hit) * self.object_size):
            return  # the next match of this prefix tries again
        _, last, _ = self._match_helper(key[: end * self.object_size], hit=None)
        path = self._path(last)
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
            _, nodes, repair_key = self.ongoing_backup.pop(id(job))
            self._repairing.discard(repair_key)
            self.host_pool.release(job.host_indices)
            self.backup_host_tokens -= len(job.host_indices)
            if job.failed == 0:
                for n in nodes:
                    n.in_storage = True
        self._submit_deferred()
        for op in self._io.drain_prefetch_acks():
            self.host_pool.release(op.host_indices)
            st = self._prefetch_by_op.pop(id(op), None)
            if st is not None and not st.collected:
                # NOTE: collected now, not when the queue scan reaches the request: a waiting
                # request sees its tokens in L2 at its next match.
                self._collect(st)

    def drain_storage(self, timeout: float) -> int:
        """At shutdown (the scheduler stopped): every L3 backup queued or deferred (waiting for
        room) lands within ``timeout`` seconds; otherwise logs how many objects are not stored
        and stops the backup threads. Returns the objects not stored."""
        io, deadline = self._io, time.monotonic() + timeout
        self.cancel_all_prefetches()
        self.controller.start_writing()  # device->host writes whose acks queue backups
        self.controller.wait_idle(timeout)
        while True:
            # acks: deferred backups go out as earlier ones land, and writes that waited for
            # the L2 room those held (their own backups follow)
            self.check()
            if not self.ongoing_backup and not self.deferred_backups and not self.ongoing_write:
                return 0
            left = max(0.0, deadline - time.monotonic())
            if self.ongoing_write:
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
        log.warning("L3: %d objects not stored at shutdown: %d in backups still running after "
                    "%g s, %d waiting for backup room", running + deferred, running, timeout,
                    deferred)
        io.shutdown(timeout=0.0, warn=False)
        return running + deferred

    def has_storage(self) -> bool:
        return self.storage_io is not None

    def can_attach_storage(self) -> bool:
        return True

    def backup_in_flight_tokens(self, namespaces: frozenset[str]) -> int:
        return sum(len(job.host_indices) for job, _, _ in self.ongoing_backup.values()
                   if job.namespace in namespaces)

    def set_backup_gate(self, gate: Callable[[TreeNode], bool] | None) -> None:
        self.backup_gate = gate

    def storage_info(self) -> dict[str, Any]:
        io = self.storage_io
        if io is None:
            return {"attached": False}
        describe = getattr(io.storage, "describe", None)
        info: dict[str, Any] = dict(describe()) if describe is not None else {}
        info.setdefault("backend", type(io.storage).__name__)
        info.update(attached=True, object_tokens=io.object_size, pending=io.pending())
        return info

    def storage_busy(self) -> bool:
        """Are L3 backups or prefetches in flight (a flush of L3 would have to wait)?"""
        return self.storage_io is not None and self.storage_io.pending() > 0

    def _settle_storage(self, timeout: float) -> None:
        """Waits up to ``timeout`` for the L3 work in flight and takes its acks; raises
        StorageBusyError (changing nothing on L3) when a stalled store keeps it."""
        if not self.controller.wait_storage_idle(timeout):
            raise StorageBusyError(
                f"L3 still has {self._io.pending()} backups / prefetches in flight after "
                f"{timeout:g} s; L3 was not changed")
        self.storage_check()

    def clear_storage(self, timeout: float = FLUSH_SETTLE_S) -> int:
        """Empty L3 (after pending backups landed); returns 0 (tokens are not counted). Raises
        StorageBusyError when they do not land within ``timeout`` (the scheduler thread must
        not wait on a stalled store)."""
        self._settle_storage(timeout)
        self.storage.clear()
        for n in self._all_nodes():
            n.in_storage = False
        self._bump()
        return 0

    def delete_from_storage(self, nodes: list[TreeNode]) -> int:
        """Deletes the L3 objects ending inside each of ``nodes`` (after pending backups
        landed) and returns how many there were: a flush of some namespaces, whose objects
        this tree knows, leaving every other namespace's objects alone."""
        if self.storage_io is None:
            return 0
        self._settle_storage(FLUSH_SETTLE_S)
        deleted, S = 0, self.object_size
        for node in nodes:
            path = self._path(node)
            if not path or path[-1] is not node:
                continue
            key = tuple(t for n in path for t in n.key)
            for k in self.storage_keys(key)[(len(key) - len(node.key)) // S:]:
                self.storage.delete(k)
                deleted += 1
            node.in_storage = False
        self._bump()
        return deleted

    # ---- attach / detach at run time (scheduler thread) ----------------------------------------
    def attach_storage(self, storage: Any, object_size: int) -> None:
        """Use ``storage`` as L3 from now on. Nodes already in L2 are backed up to it when a
        request next matches them (the repair path); new writes as they land."""
        if self.storage_io is not None:
            raise StorageBusyError("an L3 backend is already attached; detach it first")
        if object_size % self.page_size:
            raise ValueError(f"L3 object size {object_size} is not a multiple of the page size "
                             f"{self.page_size}")
        self.storage_io = self.controller.attach_storage(storage, object_size)
        self.storage, self.object_size = storage, object_size
        for n in self._all_nodes():
            n.in_storage = False
        self._bump()

    def detach_storage(self, timeout: float = STORAGE_SETTLE_S) -> Any:
        """Stop using L3 and return the backend (None if none was attached). Queued backups
        and prefetches finish first; what prefetches read enters L2 as usual (the requests
        waiting for them go on). Raises StorageBusyError, changing nothing, when they do not
        finish within ``timeout`` (a hung store: its threads still read host slots)."""
        if self.storage_io is None:
            return None
        if not self.controller.wait_storage_idle(timeout):
            raise StorageBusyError(
                f"L3 still has {self.storage_io.pending()} backups / prefetches in flight after "
                f"{timeout:g} s; nothing was detached")
        self.l3_counters["backup_dropped_nodes"] += len(self.deferred_backups)
        self.deferred_backups.clear()  # (before the check, which would submit them)
        self.storage_check()  # every op is done: releases backup slots, collects prefetches
        if not self.controller.detach_storage(0.0):
            raise AssertionError("L3 work was queued while detaching")
        storage, self.storage, self.storage_io = self.storage, None, None
        for n in self._all_nodes():
            n.in_storage = False
        self._repairing.clear()
        self._bump()
        return storage

    def node_in_storage(self, node: TreeNode) -> bool:
        """Are the L3 objects ending inside ``node`` stored (asks the backend)?"""
        if self.storage_io is None:
            return False
        path = self._path(node)
        if not path or path[-1] is not node:
            return False
        key = tuple(t for n in path for t in n.key)
        start, S = len(key) - len(node.key), self.object_size
        keys = self.storage_keys(key)[start // S:]
        return bool(keys) and all(self.storage.exists_mask(keys))

    def storage_stats(self, hit_tokens: int) -> tuple[L3Stats, Moves]:
        """L3's record and the L2 <-> L3 traffic (reported on L2); ``hit_tokens``: prompt
        tokens L3 served (the scheduler's count)."""
        return l3_stats(
            hit_tokens=hit_tokens, backend=self.storage.stats(), describe=self.storage.describe(),
            object_tokens=self.object_size, bytes_per_token=self.controller.bytes_per_token,
            prefetch_policy=self.prefetch_policy, io=self._io.stats, counters=self.l3_counters,
            pending_backups=len(self.ongoing_backup), deferred_backups=len(self.deferred_backups),
            pending_prefetches=len(self.ongoing_prefetch))
