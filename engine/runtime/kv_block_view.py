"""The scheduler side of KV events: the tree's blocks per tier (hicache.kv_blocks), called as a
SchedulerCall, in the scheduler process of a split daemon; one BlockView per tree keeps its
hash cache between calls."""

from __future__ import annotations

import weakref
from typing import Any

from hicache.kv_blocks import Block, BlockChanges, BlockView

_VIEWS: weakref.WeakKeyDictionary[Any, BlockView] = weakref.WeakKeyDictionary()


def _view(scheduler: Any, block_size: int, salt_key: bytes) -> BlockView:
    tree = scheduler.tree_cache
    view = _VIEWS.get(tree)
    if view is None or view.block_size != block_size or view.salt_key != salt_key:
        view = _VIEWS[tree] = BlockView(block_size, salt_key)
    return view


def kv_blocks(scheduler: Any, block_size: int, salt_key: bytes) -> dict[str, list[Block]]:
    """tier -> the tree's full blocks in that tier now, parents before children."""
    return BlockView(block_size, salt_key).snapshot(scheduler.tree_cache)


def kv_block_changes(scheduler: Any, block_size: int, salt_key: bytes,
                     reset: bool = False) -> BlockChanges:
    """The blocks stored / removed per tier since the last call (reset: the whole state).
    NOTE: one caller per daemon (its KvEventPublisher): the view remembers what it gave."""
    view = _view(scheduler, block_size, salt_key)
    return view.changes(scheduler.tree_cache, reset)
