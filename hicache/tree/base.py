"""BasePrefixCache: what every prefix cache does (RadixCache, ChunkCache, HiRadixCache), and
the match it returns.

The interface is the core every cache implements for real: match a key, insert one, keep a
request's KV when it finishes or after a chunk, count a hit, lock a prefix against eviction,
evict, report its sizes, reset, check its own bookkeeping. A tier that only some caches have is
a part the cache holds, declared here and ``None`` where absent:

    cache.host   hicache.l2.tier.HostTier   L2: the host pool, the copies between L1 and L2
                                            (load back, host reads, their acks), L2 eviction
    cache.l3     hicache.l3.tier.L3Tier     L3: attach / detach a backend, backups, prefetches,
                                            what it holds

Callers check ``cache.host is not None`` / ``cache.l3 is not None`` and use the part directly;
the tree operations only a radix tree has (walk, plan and evict, lock a prefix) are in
``hicache.tree.ops``. The requests the caches take are ``hicache.tree.request.CacheRequest``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hicache.l2.tier import HostTier
    from hicache.l3.tier import L3Tier
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.observe.events import CacheEventLog
    from hicache.tree.node import TreeNode
    from hicache.tree.request import CacheRequest


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
    host: HostTier | None = None  # L2, a part of HiRadixCache
    l3: L3Tier | None = None  # L3 (a backend attached or not), a part of HiRadixCache

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
    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors; returns the change of evictable_size (<= 0)."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock ``node`` and its ancestors; returns the change of evictable_size (>= 0)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` device tokens if possible; returns the tokens freed."""

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
