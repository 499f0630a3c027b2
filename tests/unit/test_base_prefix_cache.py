"""BasePrefixCache: every concrete cache implements the abstract core, and a cache without a tier
answers the optional calls neutrally (what the scheduler, admin and engine rely on instead of
probing for attributes)."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.tier import TIERS
from hicache.tree.base import BasePrefixCache, MatchResult
from hicache.tree.chunk import ChunkCache
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.radix import RadixCache
from tests.unit.test_hiradix_cache import Rig

NO_HITS = dict.fromkeys(TIERS, 0)


@pytest.mark.parametrize("cls", [RadixCache, ChunkCache, HiRadixCache])
def test_concrete_caches_implement_the_core(cls):
    assert issubclass(cls, BasePrefixCache)
    assert not inspect.isabstract(cls)
    assert not cls.__abstractmethods__


def test_the_core_is_abstract():
    core = {
        "reset",
        "match_prefix",
        "insert",
        "cache_finished_req",
        "cache_unfinished_req",
        "record_hit",
        "evict",
        "inc_lock_ref",
        "dec_lock_ref",
        "evictable_size",
        "protected_size",
        "total_size",
        "all_device_slots",
        "check_integrity",
    }
    assert BasePrefixCache.__abstractmethods__ == core
    with pytest.raises(TypeError):
        BasePrefixCache()  # type: ignore[abstract]


def _chunk() -> ChunkCache:
    return ChunkCache(ReqToTokenPool(2, 16, "cpu"), TokenToKVPoolAllocator(16, 1, "cpu"), 1)


def _radix() -> RadixCache:
    alloc = TokenToKVPoolAllocator(16, 1, "cpu")
    tree = RadixCache(None, alloc, 1)
    tree.insert([1, 2, 3, 4], alloc.alloc(4))
    return tree


@pytest.mark.parametrize("make", [_chunk, _radix])
def test_single_tier_caches_answer_optional_calls_neutrally(make):
    tree = make()
    res = tree.match_prefix([1, 2, 3, 4, 5], touch=False)
    assert res.tier_tokens is None and res.host_hit_length == 0
    assert not tree.has_host_tier() and not tree.has_storage()
    assert not tree.can_attach_storage()
    tiers = tree.tier_stats(NO_HITS, 0)
    assert (tiers.l2, tiers.l3) == (None, None) and tree.storage_info() == {"attached": False}
    assert tree.storage_prefix_len([1, 2, 3, 4]) == 0
    assert tree.node_in_storage(tree.root_node) is False and not tree.storage_busy()
    assert tree.evict_host(100) == 0 and tree.drain_storage(1.0) == 0
    kv = SimpleNamespace(
        fill_ids=[1, 2, 3], match_result=res, prefix_indices=res.device_indices, host_hit_length=0
    )
    req = SimpleNamespace(rid="r", cache_namespace=None, kv=kv)
    assert tree.l3_start(req) == 0 and tree.l3_hit(req) == 0 and tree.object_size == 0
    tree.l3_matched(req)
    assert tree.l3_ready(req, [], lambda r: pytest.fail("no re-match without L3"))
    assert tree.l3_admitted(req) == 0 and tree.prefetch_deadline() is None
    kv.last_node = res.last_device_node
    assert tree.admit(req) == {"l1": len(res.device_indices)}
    tree.l3_forget(req)
    assert tree.pending_layer_wait() is None and tree.host_reads() is None
    indices, node = tree.init_load_back(res.last_device_node, res)
    assert torch.equal(indices, res.device_indices) and node is res.last_device_node
    with pytest.raises(ValueError):
        tree.flush_tier("l2")
    with pytest.raises(NotImplementedError):
        tree.attach_storage(object(), 4)
    woken = []
    tree.set_wake(lambda: woken.append(1))
    tree.check(), tree.settle(1.0), tree.shutdown()
    assert woken == []  # nothing is copied in the background


def test_radix_flush_l1_evicts_every_unlocked_token():
    tree = _radix()
    assert tree.flush_tier("l1") == 4 and tree.total_size() == 0


def test_match_result_is_frozen_and_hierarchical_match_counts_tiers():
    rig = Rig()
    rig.insert([1, 2, 3, 4])
    res = rig.tree.match_prefix([1, 2, 3, 4, 5])
    assert isinstance(res, MatchResult)
    assert res.tier_tokens == {"l1": 4, "l2": 0, "l3": 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.host_hit_length = 3  # type: ignore[misc]
    assert rig.tree.has_host_tier() and rig.tree.can_attach_storage()
    tiers = rig.tree.tier_stats(NO_HITS, 0)
    assert not rig.tree.has_storage() and tiers.l2 is not None and tiers.l3 is None
    rig.tree.shutdown()


def test_tiers_are_named_once():
    from hicache.observe import events
    from hicache.tier import MEMORY_TIERS, TIERS, Tier

    assert TIERS == ("l1", "l2", "l3") == tuple(Tier) and MEMORY_TIERS == TIERS[:2]
    assert events.TIERS is TIERS and Tier.L2 == "l2"
