"""hicache: the hierarchical KV-cache library (allocators, pools, prefix caches).

NOTE: this package never imports ``engine``.
"""

from __future__ import annotations

from hicache.allocator import TokenToKVPoolAllocator
from hicache.chunk_cache import ChunkCache
from hicache.kv_pool import MHATokenToKVPool
from hicache.radix_cache import MatchResult, RadixCache, TreeNode
from hicache.req_to_token import ReqToTokenPool

__all__ = [
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
]
