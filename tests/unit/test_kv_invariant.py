"""engine/runtime/scheduler/invariants.py over a real allocator and RadixCache: every page is
free, in the tree or held by a request, exactly once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.runtime.scheduler.invariants import check_kv_invariant, held_slots
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.tree.radix import RadixCache


@pytest.mark.parametrize("page_size", [1, 4])
def test_free_tree_and_held_pages_partition_the_pool(page_size):
    alloc = TokenToKVPoolAllocator(64, page_size, "cpu")
    tree = RadixCache(None, alloc, page_size)
    cached = alloc.alloc(8)
    tree.insert(list(range(8)), cached)
    req_to_token = torch.zeros((2, 32), dtype=torch.int32)
    own = alloc.alloc(4 * page_size)
    req_to_token[1, :8] = cached.to(torch.int32)  # its prefix: the tree's slots
    req_to_token[1, 8 : 8 + len(own)] = own.to(torch.int32)
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=1, kv_alloc=8 + len(own)))
    held = held_slots(req_to_token, [req, req], tree)  # listed twice: counted once
    assert sorted(held.tolist()) == sorted(own.tolist())
    check_kv_invariant(alloc, tree, held, page_size)
    with pytest.raises(AssertionError, match="KV accounting broken"):
        check_kv_invariant(alloc, tree, torch.empty(0, dtype=torch.int64), page_size)  # leaked
    alloc.free(own)
    with pytest.raises(AssertionError, match="KV accounting broken"):
        check_kv_invariant(alloc, tree, held, page_size)  # free and held at once
