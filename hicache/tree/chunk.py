"""ChunkCache: the prefix cache used with ``--disable-radix-cache``.

The core of BasePrefixCache, but nothing is shared between requests: a match is always empty, a finished
request frees every slot it holds, an unfinished (chunked) one keeps them.
"""

from __future__ import annotations

import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.tree.base import BasePrefixCache, MatchResult
from hicache.tree.node import TreeNode
from hicache.tree.request import CacheRequest, finished_kv_len, row_of


class ChunkCache(BasePrefixCache):
    """No-op prefix cache: requests own their slots from allocation to finish."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator,
        page_size: int,
        disable: bool = True,
        eviction_policy: str = "lru",
    ) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = True
        self.eviction_policy = eviction_policy
        self.device = token_to_kv_pool_allocator.device
        self.root_node = TreeNode()
        self.root_node.value = self._empty()
        self.root_node.lock_ref = 1
        self.version = 0  # nothing is ever cached: a match never goes stale

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        pass

    def match_prefix(
        self, key: list[int] | tuple[int, ...], namespace: str | None = None, touch: bool = True
    ) -> MatchResult:
        return MatchResult(self._empty(), self.root_node, self.root_node)

    def record_hit(self, node: TreeNode) -> None:
        pass

    def insert(self, key: list[int] | tuple[int, ...], value: torch.Tensor) -> int:
        return 0

    def cache_finished_req(self, req: CacheRequest) -> None:
        """Free all ``kv_len`` slots of the request and its req_to_token row.

        positions: 0 ................................................ kv_len
        slots:     |            request's own: free (pages, tail included) |
        """
        row = row_of(req)
        kv_indices = self.req_to_token_pool.req_to_token[row, : finished_kv_len(req)].long()
        self.token_to_kv_pool_allocator.free(kv_indices)
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """The request keeps its slots: ``req.kv.prefix_indices`` = its ``len(fill_ids)`` slots."""
        kv, row = req.kv, row_of(req)
        kv.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(kv.fill_ids)].to(
            torch.int64
        )

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: TreeNode) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_device_slots(self) -> torch.Tensor:
        return self._empty()

    def check_integrity(self) -> None:
        pass
