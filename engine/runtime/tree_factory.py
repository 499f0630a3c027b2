"""Picks the prefix cache the options ask for: ChunkCache, RadixCache or HiRadixCache."""

from __future__ import annotations

from typing import Any

from engine.config import ServerArgs
from hicache.tree.base import BasePrefixCache


def build_tree_cache(args: ServerArgs, runner: Any) -> BasePrefixCache:
    if args.disable_radix_cache:
        from hicache.tree.chunk import ChunkCache

        return ChunkCache(runner.req_to_token_pool, runner.allocator, args.page_size)
    if args.enable_hierarchical_cache:
        from engine.runtime.hicache_setup import build_hiradix_cache

        return build_hiradix_cache(args, runner)
    from hicache.tree.radix import RadixCache

    return RadixCache(
        runner.req_to_token_pool,
        runner.allocator,
        args.page_size,
        eviction_policy=args.radix_eviction_policy,
    )
