"""BasePrefixCache: every concrete cache implements the whole interface (every method it
declares is abstract: no do-nothing defaults), and a tier only some caches have is a part the
cache holds (``host``, ``l3``; None where absent), which the scheduler's cache manager, the
figures and the tree operations check instead of probing for attributes."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from engine.runtime import cache_admin
from engine.runtime.request import Req
from engine.runtime.scheduler.cache import CacheManager
from engine.runtime.scheduler.stats import CacheCounters
from engine.sampling_params import SamplingParams
from hicache.l2.tier import HostTier
from hicache.l3.tier import L3Tier
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.req_to_token import ReqToTokenPool
from hicache.observe.stats import tier_stats
from hicache.tier import TIERS
from hicache.tree.base import BasePrefixCache, MatchResult
from hicache.tree.chunk import ChunkCache
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.ops import flush_tier, radix_tree
from hicache.tree.radix import RadixCache
from tests.unit.test_hiradix_cache import Rig

NO_HITS = dict.fromkeys(TIERS, 0)


@pytest.mark.parametrize("cls", [RadixCache, ChunkCache, HiRadixCache])
def test_concrete_caches_implement_the_core(cls):
    assert issubclass(cls, BasePrefixCache)
    assert not inspect.isabstract(cls)
    assert not cls.__abstractmethods__


def test_the_core_is_abstract_and_is_all_the_interface_declares():
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
    declared = {n for n, v in vars(BasePrefixCache).items() if inspect.isfunction(v)}
    assert declared == core  # no default a cache without some tier would answer with
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
def test_single_tier_caches_have_no_tier_parts_and_the_manager_asks_nothing_of_them(make):
    tree = make()
    assert tree.host is None and tree.l3 is None
    res = tree.match_prefix([1, 2, 3, 4, 5], touch=False)
    assert res.tier_tokens is None and res.host_hit_length == 0
    tiers = tier_stats(tree, NO_HITS, 0)
    assert (tiers.l2, tiers.l3) == (None, None)
    assert tiers.l1.cached_tokens == tree.total_size()
    mgr = CacheManager(tree, CacheCounters(), True, lambda: pytest.fail("no load back"))
    woken: list[int] = []
    mgr.set_wake(lambda: woken.append(1))
    mgr.check(), mgr.settle(1.0), mgr.wait_pending_loads(), mgr.release_loads()
    assert mgr.deadline() is None
    params = SamplingParams(max_new_tokens=1)
    req = Req.new("r", [1, 2, 3, 4, 5], params, None, set(), 64, torch.device("cpu"))
    mgr.arrive(req)
    assert req.kv.match_result is not None and req.kv.host_hit_length == 0
    assert mgr.ready(req, []) and mgr.l3_hit(req) == 0 and mgr.l3_admitted(req) == 0
    mgr.load_back(req)  # nothing on host: no load, no wait for forwards
    mgr.count_hit(req)
    assert req.admission.cached_tokens_per_tier == {
        "l1": len(res.device_indices),
        "l2": 0,
        "l3": 0,
    }
    mgr.forget(req)
    assert mgr.l3_progress == {}
    fb = SimpleNamespace(wait_layer=None, host_reads=None)  # the fields a forward's waits use
    mgr.before_forward(fb, is_extend=True)
    assert fb.wait_layer is None and fb.host_reads is None
    assert not cache_admin.tier_enabled(tree, "l2") and not cache_admin.tier_enabled(tree, "l3")
    radix = radix_tree(tree)
    assert (radix is None) == isinstance(tree, ChunkCache)
    if radix is not None:
        with pytest.raises(ValueError):
            flush_tier(radix, "l2")
    assert woken == []  # nothing is copied in the background


def test_radix_flush_l1_evicts_every_unlocked_token():
    tree = _radix()
    assert flush_tier(tree, "l1") == 4 and tree.total_size() == 0


def test_match_result_is_frozen_and_hierarchical_match_counts_tiers():
    rig = Rig()
    rig.insert([1, 2, 3, 4])
    res = rig.tree.match_prefix([1, 2, 3, 4, 5])
    assert isinstance(res, MatchResult)
    assert res.tier_tokens == {"l1": 4, "l2": 0, "l3": 0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.host_hit_length = 3  # type: ignore[misc]
    assert isinstance(rig.tree.host, HostTier) and isinstance(rig.tree.l3, L3Tier)
    tiers = tier_stats(rig.tree, NO_HITS, 0)
    assert not rig.tree.l3.has_storage() and tiers.l2 is not None and tiers.l3 is None
    rig.tree.host.shutdown()


def test_tiers_are_named_once():
    from hicache.observe import events
    from hicache.tier import MEMORY_TIERS, TIERS, Tier

    assert TIERS == ("l1", "l2", "l3") == tuple(Tier) and MEMORY_TIERS == TIERS[:2]
    assert events.TIERS is TIERS and Tier.L2 == "l2"
