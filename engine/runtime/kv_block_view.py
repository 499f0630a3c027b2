"""The scheduler side of KV events: the cache's blocks per tier, on the scheduler thread
(Engine.kv_block_changes; in the scheduler process of a split daemon). L1 and L2 come from the tree (hicache.observe.blocks), L3
from the objects the cache knows are stored (hicache.l3.index); one pair of views per tree
keeps their hash caches between calls."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

from hicache.l3.index import L3BlockView, L3Index
from hicache.observe.blocks import TIERS, Block, BlockChanges, BlockView
from hicache.tree.base import BasePrefixCache

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler

_VIEWS: weakref.WeakKeyDictionary[Any, tuple[BlockView, L3BlockView]] = weakref.WeakKeyDictionary()


def _views(scheduler: Scheduler, block_size: int, salt_key: bytes) -> tuple[BlockView, L3BlockView]:
    tree = scheduler.tree_cache
    views = _VIEWS.get(tree)
    if views is None or views[0].block_size != block_size or views[0].salt_key != salt_key:
        views = _VIEWS[tree] = (BlockView(block_size, salt_key), L3BlockView(block_size, salt_key))
    return views


def _l3_objects(tree: BasePrefixCache) -> L3Index | None:
    """The L3 objects the cache knows are stored; None without L3 attached."""
    return tree.l3.l3_index if tree.l3 is not None else None


def kv_blocks(scheduler: Scheduler, block_size: int, salt_key: bytes) -> dict[str, list[Block]]:
    """tier -> the cache's full blocks in that tier now, parents before children."""
    tree = scheduler.tree_cache
    return {
        **BlockView(block_size, salt_key).snapshot(tree),
        **L3BlockView(block_size, salt_key).snapshot(_l3_objects(tree)),
    }


def kv_block_changes(
    scheduler: Scheduler, block_size: int, salt_key: bytes, reset: bool = False
) -> BlockChanges:
    """The blocks stored / removed per tier since the last call (reset: the whole state).
    NOTE: one caller per daemon (its KvEventPublisher): the views remember what they gave."""
    tree_view, l3_view = _views(scheduler, block_size, salt_key)
    reset = reset or tree_view.fresh or l3_view.fresh  # both whole, or both changes
    ch = tree_view.changes(scheduler.tree_cache, reset)
    l3_stored, l3_removed = l3_view.changes(_l3_objects(scheduler.tree_cache), reset)
    stored, removed = {**ch.stored, **l3_stored}, {**ch.removed, **l3_removed}
    assert set(stored) == set(removed) == set(TIERS)
    return BlockChanges(stored, removed, reset)
