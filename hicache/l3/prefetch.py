"""L3Prefetch: reading a waiting request's L3 hit into L2 (part of ``L3Tier``), and how it
enters the tree. Bytes move on the controller's StorageIO prefetch thread.

    prefetch a waiting request matched m tokens in L1+L2 and L3 holds objects up to h*S > m:
             objects m//S .. h-1 are read into fresh host slots by the prefetch thread
             positions:  0 ........ (m//S)*S ..... m ............... h*S
                         | tree (L1/L2)          |  new host-only node |
                         |           | prefetched; the part < m is freed |
             The request's turn (``poll_prefetch``) or the read's end inserts what landed.

The prefetch policy decides how long a request waits for its read: ``best_effort`` (not at
all), ``wait_complete`` (until every object landed), ``timeout`` (until every object landed or
``timeout_base + timeout_per_ki_token * tokens / 1024`` seconds passed).

NOTE: a pending prefetch holds ``host_ref`` on its anchor node (the end of the tree match, then
the inserted node), so host eviction cannot take the path it will hang from.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from hicache.l3.tree import L3Tree
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.transfer.storage_io import PrefetchOperation
from hicache.tree.base import MatchResult
from hicache.tree.node import TreeNode

if TYPE_CHECKING:
    from hicache.l3.tier import L3Tier

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


class PrefetchStart(NamedTuple):
    tokens: int  # tokens the prefetch will add beyond the L1 + L2 match (0: none started)
    in_l3: int  # tokens of the request's prefix L3 holds (whole objects from the root)


@dataclass
class PrefetchState:
    op: PrefetchOperation
    anchor: TreeNode | None  # holds host_ref until the request is admitted or goes away
    key: tuple[int, ...]  # namespaced tree key up to the end of the last object
    start: int  # token position of the first object (a multiple of S)
    inserted: int = 0  # tokens the tree took from it
    collected: bool = False


class L3Prefetch:
    """The prefetches of waiting requests, by request id."""

    def __init__(
        self,
        tier: L3Tier,
        tree: L3Tree,
        host_pool: MHATokenToKVPoolHost,
        policy: str,
        timeout_base: float,
        timeout_per_ki_token: float,
        threshold: int,
    ) -> None:
        if policy not in PREFETCH_POLICIES:
            raise ValueError(f"unknown prefetch policy {policy!r}; expected {PREFETCH_POLICIES}")
        self.tier = tier
        self.tree = tree
        self.host_pool = host_pool
        self.prefetch_policy = policy
        self.prefetch_timeout_base = timeout_base
        self.prefetch_timeout_per_ki_token = timeout_per_ki_token
        self.prefetch_threshold = threshold  # fewest new tokens a prefetch is started for
        self.ongoing_prefetch: dict[str, PrefetchState] = {}
        self._prefetch_by_op: dict[int, PrefetchState] = {}
        self.counters = tier.l3_counters

    def prefetch_keys(self, token_ids: list[int], namespace: str | None) -> list[str]:
        """The object keys of a request's tokens (compute once per request)."""
        return self.tier.storage_keys(self.tree.keys.tree_key(token_ids, namespace))

    def start_prefetch(
        self,
        req_id: str,
        token_ids: list[int],
        namespace: str | None,
        match: MatchResult,
        keys: list[str] | None = None,
    ) -> PrefetchStart:
        """A waiting request matched ``token_ids`` (``match``: its L1 + L2 match; ``keys``:
        ``prefetch_keys`` of them, computed once by the caller): start reading the L3 objects
        beyond the match. Returns the tokens that will add and L3's prefix of the request.
        Also repairs objects L3 lost that L2 still holds. No-op while the request has a
        prefetch."""
        io = self.tier.storage_io
        if io is None or req_id in self.ongoing_prefetch:
            return PrefetchStart(0, 0)
        S = self.tier.object_size
        key = self.tree.keys.tree_key(token_ids, namespace)
        keys = self.tier.storage_keys(key) if keys is None else keys[: len(key) // S]
        if not keys:
            return PrefetchStart(0, 0)
        matched = len(match.device_indices) + match.host_hit_length
        hit = self.tier.storage_hit(keys)
        self.tier.index.found(namespace, token_ids, keys, hit)
        in_l3 = hit * S
        if hit < matched // S:
            self.tier.backup.repair(key, hit, matched // S, keys[hit])
        first = matched // S
        new_tokens = hit * S - matched
        if new_tokens <= 0 or new_tokens < self.prefetch_threshold:
            return PrefetchStart(0, in_l3)
        anchor = match.last_host_node
        self._protect_host(anchor)
        need = (hit - first) * S
        if self.host_pool.available_size() < need:
            self.tree.host.eviction.evict_host(need - self.host_pool.available_size())
        # L2 too full for all of it: the leading objects that fit, if still worth it
        fit = min(hit - first, self.host_pool.available_size() // S)
        new_tokens = (first + fit) * S - matched
        host = (
            self.host_pool.alloc(fit * S)
            if fit and new_tokens >= max(1, self.prefetch_threshold)
            else None
        )
        if host is None:
            self._release_host(anchor)
            self.counters["prefetch_skipped"] += 1
            return PrefetchStart(0, in_l3)
        hit = first + fit
        self.host_pool.protect(host)
        op = PrefetchOperation(req_id, keys[first:hit], host)
        st = PrefetchState(op, anchor, key[: hit * S], first * S)
        self.ongoing_prefetch[req_id] = st
        self._prefetch_by_op[id(op)] = st
        self.counters["prefetch_started"] += 1
        io.prefetch(op)
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
        times = [
            st.op.start_time + self._timeout(st.op)
            for st in self.ongoing_prefetch.values()
            if not st.collected
        ]
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
            self.counters["prefetch_cancelled"] += 1
        self._finish_prefetch(req_id)

    def has_prefetch(self, req_id: str) -> bool:
        """Does the request have prefetch state (in flight or landed, not yet admitted)?"""
        return req_id in self.ongoing_prefetch

    def yield_prefetch(self, req_id: str) -> int:
        """``req_id``'s landed prefetch gives its L2 room to a request that goes first: its
        objects stay in the tree, no longer protected (evictable); the request prefetches again
        at its own turn (L3 still holds them). Returns those tokens; 0 (nothing done) while
        the read is in flight: its slots would come back only once it returns."""
        st = self.ongoing_prefetch.get(req_id)
        if st is None or not st.collected:
            return 0
        self.counters["prefetch_yielded"] += 1
        self._finish_prefetch(req_id)
        return st.inserted

    def cancel_all(self) -> None:
        for req_id in list(self.ongoing_prefetch):
            self.cancel_prefetch(req_id)

    def fetch_from_storage(
        self, key: list[int], namespace: str | None = None, timeout: float | None = 60.0
    ) -> int:
        """Read ``key``'s L3 objects beyond the tree into L2 now (blocking; admin warm-up and
        tests). Returns the tokens added."""
        req_id = f"fetch-{time.monotonic_ns()}"
        self.start_prefetch(
            req_id, key, namespace, self.tree.match_prefix(key, namespace=namespace, touch=False)
        )
        io = self.tier.storage_io
        if io is None or req_id not in self.ongoing_prefetch:
            return 0
        io.wait_idle(timeout)
        self.tier.storage_check()
        got = self.ongoing_prefetch[req_id].inserted
        self.finish_prefetch(req_id)
        return got

    def landed(self, op: PrefetchOperation) -> None:
        """The prefetch thread is done with ``op`` (its ack): its host slots are no longer read.
        NOTE: collected now, not when the queue scan reaches the request: a waiting request
        sees its tokens in L2 at its next match."""
        self.tier.index.read(op.keys, op.completed, op.missed)
        self.host_pool.release(op.host_indices)
        st = self._prefetch_by_op.pop(id(op), None)
        if st is not None and not st.collected:
            self._collect(st)

    def _timeout(self, op: PrefetchOperation) -> float:
        return (
            self.prefetch_timeout_base
            + self.prefetch_timeout_per_ki_token * len(op.keys) * self.tier.object_size / 1024
        )

    def _can_terminate(self, op: PrefetchOperation) -> bool:
        if op.done or op.complete or self.prefetch_policy == "best_effort":
            return True
        if self.prefetch_policy == "wait_complete":
            return False
        return time.monotonic() - op.start_time >= self._timeout(op)

    def _collect(self, st: PrefetchState) -> None:
        """Take the objects that landed into the tree; free the rest."""
        S = self.tier.object_size
        n = st.op.terminate()
        st.collected = True
        if n < len(st.op.keys):
            self.counters["prefetch_partial"] += 1
        end = st.start + n * S
        host = st.op.host_indices
        inserted = self._insert_host(st.key[:end], st.start, host[: n * S]) if n else 0
        if n < len(st.op.keys):
            self.host_pool.free(host[n * S :])
        st.inserted = inserted
        self.counters["prefetch_tokens"] += inserted
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
        last, matched = self.tree.match_node(key)
        if matched < start or matched >= len(key):
            # a gap (the prefix was evicted meanwhile) or everything is there already
            self.host_pool.free(host)
            if matched < start:
                self.counters["prefetch_discarded_tokens"] += len(host)
            return 0
        skip = matched - start
        if skip:
            self.host_pool.free(host[:skip])
        node = self.tree.hang_host_node(last, key[matched:], host[skip:].clone())
        return len(node.key)

    def _node_at(self, key: tuple[int, ...]) -> TreeNode | None:
        node, matched = self.tree.match_node(key)
        return node if matched == len(key) and node is not self.tree.root_node else None

    @staticmethod
    def _protect_host(node: TreeNode) -> None:
        node.host_ref += 1

    @staticmethod
    def _release_host(node: TreeNode) -> None:
        if node.host_ref <= 0:
            raise AssertionError(f"release_host on unprotected {node!r}")
        node.host_ref -= 1
