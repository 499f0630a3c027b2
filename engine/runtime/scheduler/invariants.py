"""The KV accounting invariant the scheduler checks after every step in debug mode
(``debug_check_invariants``).

NOTE: every KV page of the device pool is exactly one of: free (the allocator's free list), in
the tree (``tree.all_device_slots()``), held by an active request (its req_to_token row up to
``kv_alloc``, minus the tree's slots); and the tree itself is consistent (``check_integrity``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from engine.runtime.request import Req
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.tree.base import BasePrefixCache

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler


def scheduler_held_slots(s: Scheduler) -> torch.Tensor:
    """Slots the scheduler's active requests hold that the tree does not ([n] int64 on CPU)."""
    active = s.running + ([s.chunked_req] if s.chunked_req else []) + s.deferred
    active += [r for j in s.launched for r in j.reqs]
    return held_slots(s.runner.req_to_token_pool.req_to_token, active, s.tree_cache)


def check(s: Scheduler) -> None:
    """Every KV page is free, in the tree or held by one of the scheduler's requests, exactly
    once (after every step with ``debug_check_invariants``)."""
    check_kv_invariant(s.runner.allocator, s.tree_cache, scheduler_held_slots(s), s.page_size)


def held_slots(
    req_to_token: torch.Tensor, active: Iterable[Req], tree: BasePrefixCache
) -> torch.Tensor:
    """Slots the ``active`` requests hold that the tree does not ([n] int64 on CPU).
    ``req_to_token``: [rows, max_context_len] slots; a request may appear more than once."""
    parts = [torch.empty(0, dtype=torch.int64)]
    for r in {id(r): r for r in active}.values():
        if r.kv.req_pool_idx is not None:  # launched steps' slots included (kv_alloc)
            parts.append(req_to_token[r.kv.req_pool_idx, : r.kv.kv_alloc].to(torch.int64).cpu())
    held = torch.cat(parts).unique()
    in_tree = tree.all_device_slots().to(torch.int64).cpu()
    return held[~torch.isin(held, in_tree)]


def check_kv_invariant(
    allocator: TokenToKVPoolAllocator, tree: BasePrefixCache, held: torch.Tensor, page_size: int
) -> None:
    """Raise AssertionError unless every page is free, in the tree or in ``held`` exactly once
    and the tree passes its own integrity check."""
    tree.check_integrity()
    ps = page_size
    free = allocator.debug_free_pages().to(torch.int64).cpu()
    in_tree = (tree.all_device_slots().to(torch.int64).cpu() // ps).unique()
    held_pages = (held.cpu() // ps).unique()
    total = allocator.size // ps
    counts = torch.zeros(total + 1, dtype=torch.int64)  # page 0 is the padding page
    for group in (free, in_tree, held_pages):
        counts.index_add_(0, group, torch.ones_like(group))
    bad = (counts[1:] != 1).nonzero().flatten() + 1
    if len(bad):
        raise AssertionError(
            f"KV accounting broken for pages {bad[:10].tolist()}: free={len(free)} "
            f"tree={len(in_tree)} held={len(held_pages)} total={total}"
        )
