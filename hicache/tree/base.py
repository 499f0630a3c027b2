"""BasePrefixCache: the interface every prefix cache implements (RadixCache, ChunkCache,
HiRadixCache), and the records it returns.

The abstract methods are the core every cache has: match, insert, cache a request's KV, evict,
lock, sizes. The other methods are optional capabilities (host tier, L3 backup, the L3
admission of waiting requests, layer-wise load back, background copy checks) with neutral
defaults: a cache without the capability answers as if the tier were empty and nothing were in
flight. The tree operations admin and quotas use (walk a key, a subtree or a namespace's nodes,
plan an eviction and evict exactly that plan, lock a prefix) are methods too, so that nothing
outside the tree re-derives its order or steers it. Callers (scheduler, admin, engine) call
these methods; they never probe a cache for attributes. The requests they pass are
``hicache.tree.request.CacheRequest``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from hicache.observe.stats import L1Stats, Moves, TierSet
from hicache.tier import Tier
from hicache.tree.eviction_plan import EvictionPlan, StalePlanError, eviction_order
from hicache.tree.request import CacheRequest

if TYPE_CHECKING:
    from hicache.l3.index import L3Index
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.observe.events import CacheEventLog
    from hicache.tree.node import TreeNode

R = TypeVar("R", bound=CacheRequest)


@dataclass(frozen=True)
class MatchResult:
    """A prefix match (``BasePrefixCache.match_prefix``)."""

    device_indices: torch.Tensor  # [matched device tokens] int64 slots on device
    last_device_node: TreeNode  # deepest matched node whose KV is on device
    last_host_node: TreeNode  # HiRadixCache: deepest matched node; == last_device_node otherwise
    host_hit_length: int = 0  # HiRadixCache: tokens after last_device_node held on host
    # tokens of the match per tier {"l1", "l2", "l3"}; None: a cache with one tier, whose hit
    # is the request's device prefix
    tier_tokens: dict[str, int] | None = None


@dataclass
class HostReads:
    """Device slots whose KV is still loading, and the host slots that hold it meanwhile (a CPU
    forward reads those in place: ``BasePrefixCache.host_reads``)."""

    device_indices: torch.Tensor  # [n] int64
    host_indices: torch.Tensor  # [n] int64, pairwise with device_indices
    layer_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # host K, V [size, H, D]


class PathStep(NamedTuple):
    """One node of a walked path (``BasePrefixCache.walk``)."""

    node: TreeNode
    tokens: int  # tokens of node.key the key matches (page-aligned; only the last step < all)
    tier: str  # the fastest memory tier holding the node's KV: "l1" or "l2"


@dataclass(frozen=True)
class PrefixLock:
    """A lock on the device-cached prefix of a key (``BasePrefixCache.lock_prefix``)."""

    node: TreeNode  # locked with its ancestors until ``unlock_prefix``
    tokens: int  # tree-key tokens the lock keeps on device


class BasePrefixCache(ABC):
    """A prefix cache over ``token_to_kv_pool_allocator`` slots.

    NOTE: every method runs on the scheduler thread (the one owner of trees and allocators).
    """

    page_size: int
    disable: bool  # True: nothing is shared between requests (ChunkCache)
    token_to_kv_pool_allocator: TokenToKVPoolAllocator  # L1: the device slots
    device: torch.device
    root_node: TreeNode
    version: int  # changes whenever the cached tokens or their tiers change
    event_log: CacheEventLog | None = None
    evicted_tokens: int = 0  # cumulative L1 tokens freed by evict()

    # ---- core --------------------------------------------------------------------------------
    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (device slots: clear the allocator alongside)."""

    @abstractmethod
    def match_prefix(
        self, key: list[int] | tuple[int, ...], namespace: str | None = None, touch: bool = True
    ) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; ``touch`` counts it as a hit."""

    @abstractmethod
    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor) -> int:
        """Insert ``key`` -> ``value`` slots; returns the prefix length already present."""

    @abstractmethod
    def cache_finished_req(self, req: CacheRequest) -> None:
        """Keep a finished request's KV (or free it), release its lock and its row."""

    @abstractmethod
    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """Keep the KV of a chunk; re-point the request at the cached slots."""

    @abstractmethod
    def record_hit(self, node: TreeNode) -> None:
        """One admission used the prefix ending at ``node``."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` device tokens if possible; returns the tokens freed."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors; returns the change of evictable_size (<= 0)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock ``node`` and its ancestors; returns the change of evictable_size (>= 0)."""

    @abstractmethod
    def evictable_size(self) -> int:
        """Device tokens held by the cache and not locked."""

    @abstractmethod
    def protected_size(self) -> int:
        """Device tokens held by the cache and locked."""

    @abstractmethod
    def total_size(self) -> int:
        """Device tokens held by the cache."""

    @abstractmethod
    def all_device_slots(self) -> torch.Tensor:
        """Every device slot the cache holds ([total_size] int64 on device)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise AssertionError unless the cache's own bookkeeping is consistent."""

    def eviction_priority(self, node: TreeNode) -> tuple[int, ...]:
        """Sort key of eviction candidates: the smallest goes first."""
        return (node.last_access_time,)

    def pretty_print(self) -> None:
        print(f"{type(self).__name__}: total={self.total_size()}")

    # ---- keys and namespaces -----------------------------------------------------------------
    def key_of(
        self, token_ids: list[int] | tuple[int, ...], namespace: str | None = None
    ) -> tuple[int, ...]:
        """The key the cache stores for ``token_ids`` of ``namespace`` (a cache that shares
        nothing needs no namespace salt)."""
        return tuple(token_ids)

    def split_key(self, key: tuple[int, ...]) -> tuple[str | None, list[int]]:
        """(namespace, token ids) of a stored key."""
        return None, list(key)

    # ---- tree operations: walk, scope, plan and evict, lock a prefix ----------------------------
    # NOTE: read-only walks and plans never split a node or touch access times / hit counts, so
    # looking at the cache (admin, quotas) never changes what it evicts next.
    def holds(self, node: TreeNode, tier: str) -> bool:
        """Does ``node`` hold its KV in memory tier ``tier`` ("l1" device, "l2" host)?"""
        return tier == "l1" and node.value is not None

    def walk(self, key: Sequence[int]) -> list[PathStep]:
        """The cached path of a tree key (``key_of``: the namespace folded in), page-aligned,
        without side effects; it ends at the first node with its KV in no memory tier."""
        return []

    def subtree(self, node: TreeNode) -> list[TreeNode]:
        """``node`` and its descendants, parents first."""
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def namespace_roots(self, namespaces: frozenset[str] | None) -> list[TreeNode]:
        """The root's children whose keys are in one of ``namespaces`` (None: all of them). A
        namespace is folded into every token of a key, so each subtree has one namespace."""
        children = list(self.root_node.children.values())
        if namespaces is None:
            return children
        return [c for c in children if self.split_key(tuple(c.key[:1]))[0] in namespaces]

    def namespace_nodes(self, namespaces: frozenset[str] | None) -> list[TreeNode]:
        """Every node of ``namespaces`` (None: the whole tree, the root included)."""
        if namespaces is None:
            return self.subtree(self.root_node)
        return [n for c in self.namespace_roots(namespaces) for n in self.subtree(c)]

    def plan_eviction(
        self, tier: str, num_tokens: int | None = None, within: Sequence[TreeNode] | None = None
    ) -> EvictionPlan:
        """What evicting ``num_tokens`` (None: everything evictable) from ``tier`` would free,
        among ``within`` (None: the whole tree), in the tree's order; changes nothing."""
        nodes = self.subtree(self.root_node) if within is None else within
        order = eviction_order(
            self._eviction_candidates(tier, nodes),
            lambda n: self.holds(n, tier),
            self.eviction_priority,
            num_tokens,
        )
        return EvictionPlan(tier, tuple(order), sum(len(n.key) for n in order), self.version)

    def _eviction_candidates(self, tier: str, nodes: Sequence[TreeNode]) -> list[TreeNode]:
        """Those of ``nodes`` that ``evict`` / ``evict_host`` may take from ``tier`` once
        they are leaves of it (unlocked, holding the tier); none without such a tier."""
        return []

    def evict_plan(self, plan: EvictionPlan) -> int:
        """Evict exactly ``plan``'s nodes, in its order, the way ``evict`` / ``evict_host``
        evict a node; returns the tokens freed (``plan.tokens``). StalePlanError, before
        anything changes, when the tree changed since the plan was made."""
        self._check_plan(plan)
        return 0

    def _check_plan(self, plan: EvictionPlan) -> None:
        if plan.version != self.version:
            raise StalePlanError(
                f"the tree changed since the plan (version {plan.version} "
                f"!= {self.version}); nothing was evicted"
            )

    def lock_prefix(self, key: Sequence[int], min_tokens: int = 1) -> PrefixLock | None:
        """Lock the device-cached prefix of a tree key, split so that the lock covers exactly
        it; None (nothing locked) when fewer than ``min_tokens`` of it are on device."""
        return None

    def unlock_prefix(self, lock: PrefixLock) -> None:
        """Release ``lock_prefix``'s lock."""
        self.dec_lock_ref(lock.node)

    # ---- the engine's loop ---------------------------------------------------------------------
    def check(self) -> None:
        """Take the acknowledgements of finished background copies (every step)."""

    def settle(self, timeout: float) -> None:
        """Let in-flight tier copies finish (at most ``timeout`` s) and take their acks, so
        nodes locked only by a copy become evictable."""
        self.check()

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` is called from copy threads when a copy is acknowledged."""

    def shutdown(self) -> None:
        """Stop background workers after flushing queued writes."""

    def release_host_memory(self) -> None:
        """The engine is gone: give host pool memory back if nothing reads it any more."""

    # ---- tiers -------------------------------------------------------------------------------
    def has_host_tier(self) -> bool:
        """Is there an L2 (host) tier?"""
        return False

    def has_storage(self) -> bool:
        """Is an L3 backend attached now?"""
        return False

    def can_attach_storage(self) -> bool:
        """Can an L3 backend be attached at run time (``attach_storage``)?"""
        return False

    def evict_host(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` host tokens if possible; returns the tokens freed."""
        return 0

    def flush_tier(self, tier: str) -> int:
        """Empty one tier of unlocked KV; returns the tokens freed."""
        if tier == "l1":
            return self.evict(1 << 62)
        raise ValueError(f"tier {tier!r} is not enabled")

    def tier_stats(self, hit_tokens: Mapping[str, int], held_tokens: int) -> TierSet:
        """Each tier's record. ``hit_tokens`` (prompt tokens each tier served, by tier name) and
        ``held_tokens`` (device tokens running requests hold outside the tree) are the
        scheduler's figures."""
        return TierSet(self.l1_stats(hit_tokens[Tier.L1], held_tokens, Moves()))

    def l1_stats(self, hit_tokens: int, held_tokens: int, moves: Moves) -> L1Stats:
        """L1's record; ``moves``: the L1 <-> L2 traffic (none without a host tier)."""
        alloc = self.token_to_kv_pool_allocator
        return L1Stats(
            capacity_tokens=alloc.size,
            used_tokens=alloc.size - alloc.available_size(),
            evictable_tokens=self.evictable_size(),
            pinned_tokens=self.protected_size(),
            hit_tokens=hit_tokens,
            evicted_tokens=self.evicted_tokens,
            promoted_tokens=moves.promoted_tokens,
            demoted_tokens=moves.demoted_tokens,
            bytes_in=moves.bytes_in,
            bytes_out=moves.bytes_out,
            errors=0,
            cached_tokens=self.total_size(),
            held_by_requests_tokens=held_tokens,
        )

    # ---- L3 ----------------------------------------------------------------------------------
    @property
    def object_size(self) -> int:
        """Tokens per L3 object; 0 without L3."""
        return 0

    def attach_storage(self, storage: Any, object_size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no L3 tier")

    def detach_storage(self, timeout: float) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no L3 tier")

    def l3_objects(self) -> L3Index | None:
        """The L3 objects this cache knows are stored (routers' KV events); None without L3."""
        return None

    def storage_info(self) -> dict[str, Any]:
        """What L3 the cache uses: {"attached": False} or the backend's describe() plus
        "attached", "object_tokens", "pending" (backups + prefetches in flight)."""
        return {"attached": False}

    def storage_prefix_len(self, key: list[int], namespace: str | None = None) -> int:
        """Tokens of ``key``'s prefix that L3 holds (whole objects from the root)."""
        return 0

    def node_in_storage(self, node: TreeNode) -> bool:
        """Are the L3 objects ending inside ``node`` stored?"""
        return False

    def storage_busy(self) -> bool:
        """Is L3 work in flight (a flush of L3 would have to wait)?"""
        return False

    def delete_from_storage(self, nodes: list[TreeNode]) -> int:
        """Delete the L3 objects ending inside each of ``nodes``; returns how many."""
        return 0

    def drain_storage(self, timeout: float) -> int:
        """Land the queued L3 backups (shutdown); returns the objects not stored."""
        return 0

    def backup_in_flight_tokens(self, namespaces: frozenset[str]) -> int:
        """Tokens of ``namespaces`` whose L3 backup is in flight."""
        return 0

    def set_backup_gate(self, gate: Callable[[TreeNode], bool] | None) -> None:
        """A policy hook: ``gate(node)`` False = do not back this node up to L3 now."""

    # ---- L3 admission (a waiting request's L3 hit read into L2 before it is admitted) --------
    # The scheduler tells the cache where a waiting request is; the cache decides when its L3
    # prefetch starts and whether the request may be admitted. A cache without L3 admits at once.
    def l3_start(self, req: CacheRequest) -> int:
        """A request arrived (``req.kv.match_result`` set): start reading what L3 holds beyond its
        match into L2; returns the tokens that read will add."""
        return 0

    def l3_matched(self, req: CacheRequest) -> None:
        """The request was matched again (the tree changed): its prefetch starts again if its
        prefix was evicted while it waited."""

    def l3_ready(self, req: R, behind: Sequence[R], rematch: Callable[[R], None]) -> bool:
        """At its turn: may ``req`` be admitted now (the prefetch policy)? ``behind``: the
        waiting requests that go after it (their landed prefetches may give L2 room);
        ``rematch``: the scheduler's (re)match of a waiting request."""
        return True

    def l3_admitted(self, req: CacheRequest) -> int:
        """The request was admitted; returns the tokens its own L3 prefetch put in the tree
        (its match counts them as L2: they came from L3)."""
        return 0

    def admit(self, req: CacheRequest) -> dict[str, int]:
        """The request was admitted (call once): its hit counts (``record_hit``) and its L3
        prefetch is done with (``l3_admitted``). Returns its prefix tokens per tier, the tokens
        its own prefetch put in the tree counted as L3, not as the L2 its match saw."""
        kv = req.kv
        from_l3 = self.l3_admitted(req)
        if kv.last_node is not None:
            self.record_hit(kv.last_node)
        res = kv.match_result
        if res is None or res.tier_tokens is None:
            return {Tier.L1.value: len(kv.prefix_indices)}
        tiers = dict(res.tier_tokens)
        moved = min(from_l3, tiers.get(Tier.L2.value, 0))
        tiers[Tier.L2.value] = tiers.get(Tier.L2.value, 0) - moved
        tiers[Tier.L3.value] = tiers.get(Tier.L3.value, 0) + moved
        return tiers

    def l3_forget(self, req: CacheRequest) -> None:
        """The request went away (finished, aborted, failed): stop its prefetch, drop what the
        cache knows of it."""

    def l3_hit(self, req: CacheRequest) -> int:
        """Tokens of the request's prefix L3 held when last asked (0: none, or never asked)."""
        return 0

    def prefetch_deadline(self) -> float | None:
        """Earliest time.monotonic() at which a waiting prefetch times out; None: none."""
        return None

    # ---- load back (L2 -> L1) ----------------------------------------------------------------
    def init_load_back(
        self,
        last_node: TreeNode,
        match_result: MatchResult | None = None,
        wait: bool = True,
        hold: bool = False,
    ) -> tuple[torch.Tensor, TreeNode]:
        """Bring the host part of a match to the device; returns the device slots of the whole
        prefix and its last device node. Without a host tier the match is all on device."""
        if match_result is None:
            return torch.empty((0,), dtype=torch.int64, device=self.device), last_node
        return match_result.device_indices, last_node

    def pending_layer_wait(self) -> Callable[[int], None] | None:
        """Per-layer wait for the next forward while a load is in flight; None: no load."""
        return None

    def wait_pending_loads(self) -> None:
        """Block until every started load landed."""

    def release_loads(self) -> None:
        """Let loads held for in-place host reads copy."""

    def host_reads(self) -> HostReads | None:
        """The device slots still loading and their host copies (``HostReads``), or None."""
        return None
