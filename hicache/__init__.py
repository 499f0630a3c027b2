"""hicache: the hierarchical KV-cache library (allocators, pools, prefix caches).

NOTE: this package never imports ``engine``. The names below load their modules on first use,
so that the torch-free modules (tier, stats, events, errors, kv_blocks' records) can be imported
by a process that never loads torch (the daemon's API server process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.memory.allocator import TokenToKVPoolAllocator
    from hicache.memory.kv_pool import MHATokenToKVPool
    from hicache.memory.req_to_token import ReqToTokenPool
    from hicache.tree.chunk import ChunkCache
    from hicache.tree.node import TreeNode
    from hicache.tree.radix import MatchResult, RadixCache

_HOMES = {
    "ChunkCache": "hicache.tree.chunk",
    "MHATokenToKVPool": "hicache.memory.kv_pool",
    "MatchResult": "hicache.tree.radix",
    "RadixCache": "hicache.tree.radix",
    "ReqToTokenPool": "hicache.memory.req_to_token",
    "TokenToKVPoolAllocator": "hicache.memory.allocator",
    "TreeNode": "hicache.tree.radix",
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
