"""BasePrefixCache: the interface every prefix cache implements (RadixCache, ChunkCache,
HiRadixCache), and the records it returns.

The abstract methods are the core every cache has: match, insert, cache a request's KV, evict,
lock, sizes. The other methods are optional capabilities (host tier, L3 prefetch and backup,
layer-wise load back, background copy checks) with neutral defaults: a cache without the
capability answers as if the tier were empty and nothing were in flight. Callers (scheduler,
admin, engine) call these methods; they never probe a cache for attributes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hicache.stats import L1Stats, Moves, TierSet
from hicache.tier import Tier

if TYPE_CHECKING:
    from hicache.allocator import TokenToKVPoolAllocator
    from hicache.events import CacheEventLog
    from hicache.radix_cache import TreeNode


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


class PrefetchStart(NamedTuple):
    tokens: int  # tokens the prefetch will add beyond the L1 + L2 match (0: none started)
    in_l3: int  # tokens of the request's prefix L3 holds (whole objects from the root)


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
    prefetch_threshold: int = 0  # fewest new tokens an L3 prefetch is started for
    object_size: int = 0  # tokens per L3 object; 0 without L3

    # ---- core --------------------------------------------------------------------------------
    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (device slots: clear the allocator alongside)."""

    @abstractmethod
    def match_prefix(self, key: list[int] | tuple[int, ...], namespace: str | None = None,
                     touch: bool = True) -> MatchResult:
        """Longest cached page-aligned prefix of ``key``; ``touch`` counts it as a hit."""

    @abstractmethod
    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor) -> int:
        """Insert ``key`` -> ``value`` slots; returns the prefix length already present."""

    @abstractmethod
    def cache_finished_req(self, req: Any) -> None:
        """Keep a finished request's KV (or free it), release its lock and its row."""

    @abstractmethod
    def cache_unfinished_req(self, req: Any) -> None:
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
    def key_of(self, token_ids: list[int] | tuple[int, ...], namespace: str | None = None
               ) -> tuple[int, ...]:
        """The key the cache stores for ``token_ids`` of ``namespace`` (a cache that shares
        nothing needs no namespace salt)."""
        return tuple(token_ids)

    def split_key(self, key: tuple[int, ...]) -> tuple[str | None, list[int]]:
        """(namespace, token ids) of a stored key."""
        return None, list(key)

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
    def attach_storage(self, storage: Any, object_size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no L3 tier")

    def detach_storage(self, timeout: float) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no L3 tier")

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

    # ---- L3 prefetch (a waiting request's L3 hit read into L2) ---------------------------------
    def prefetch_keys(self, token_ids: list[int], namespace: str | None) -> list[str]:
        return []

    def start_prefetch(self, req_id: str, token_ids: list[int], namespace: str | None,
                       match: MatchResult, keys: list[str] | None = None) -> PrefetchStart:
        return PrefetchStart(0, 0)

    def poll_prefetch(self, req_id: str) -> int | None:
        """None while the request should wait for its prefetch; else the tokens it added."""
        return 0

    def has_prefetch(self, req_id: str) -> bool:
        """Does the request have prefetch state (in flight or landed, not yet admitted)?"""
        return False

    def finish_prefetch(self, req_id: str) -> None:
        """The request was admitted."""

    def cancel_prefetch(self, req_id: str) -> None:
        """The request went away."""

    def yield_prefetch(self, req_id: str) -> int:
        """Give up a landed prefetch's protection; returns its tokens (0: nothing done)."""
        return 0

    def prefetch_deadline(self) -> float | None:
        """Earliest time.monotonic() at which a waiting prefetch times out; None: none."""
        return None

    # ---- load back (L2 -> L1) ----------------------------------------------------------------
    def init_load_back(self, last_node: TreeNode, match_result: MatchResult | None = None,
                       wait: bool = True, hold: bool = False) -> tuple[torch.Tensor, TreeNode]:
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
