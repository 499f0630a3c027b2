"""Picks the prefix cache the options ask for: ChunkCache, RadixCache or HiRadixCache; and stops
it once its scheduler stopped (its tiers' threads, L3's queued backups)."""

from __future__ import annotations

from typing import Any

from engine.config import ServerArgs
from engine.front import L3_DRAIN_S
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


def stop_tree_cache(tree: BasePrefixCache, drain: bool) -> None:
    """The scheduler stopped: with ``drain`` (the tree is no longer used by a step), the queued
    L3 backups land (at most ``L3_DRAIN_S``; the objects left are logged); then the copy
    threads stop after flushing queued writes."""
    if drain and tree.l3 is not None and tree.l3.has_storage():
        tree.l3.backup.drain(L3_DRAIN_S)
    if tree.host is not None:
        tree.host.shutdown()
