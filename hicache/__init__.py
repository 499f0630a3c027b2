"""hicache: the hierarchical KV-cache library (allocators, pools, prefix caches).

NOTE: this package never imports ``engine``. The names below load their modules on first use,
so that the torch-free modules (tier, stats, events, errors, kv_blocks' records) can be imported
by a process that never loads torch (the daemon's API server process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.allocator import TokenToKVPoolAllocator
    from hicache.chunk_cache import ChunkCache
    from hicache.kv_pool import MHATokenToKVPool
    from hicache.radix_cache import MatchResult, RadixCache, TreeNode
    from hicache.req_to_token import ReqToTokenPool

_HOMES = {
    "ChunkCache": "hicache.chunk_cache",
    "MHATokenToKVPool": "hicache.kv_pool",
    "MatchResult": "hicache.radix_cache",
    "RadixCache": "hicache.radix_cache",
    "ReqToTokenPool": "hicache.req_to_token",
    "TokenToKVPoolAllocator": "hicache.allocator",
    "TreeNode": "hicache.radix_cache",
}
__all__ = [
    "ChunkCache",
    "MHATokenToKVPool",
    "MatchResult",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hicache' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
