"""CacheManager (engine/runtime/scheduler/cache.py): what the scheduler asks of the cache, over
a real HiRadixCache + controller on CPU with L3 a file backend behind GatedStorage (the test
holds reads): a waiting request's L3 admission (its read starts on arrival, again if its prefix
was evicted while it waited, whether it may be admitted while the read runs, the room of the
reads behind it), the hit admission counts per tier, and the same wiring in a real Engine."""

from __future__ import annotations

import random

import pytest
import torch

from engine.runtime.request import Req
from engine.runtime.scheduler.cache import CacheManager
from engine.runtime.scheduler.stats import CacheCounters
from engine.sampling_params import SamplingParams
from hicache.tree.ops import flush_tier
from tests.unit.test_hiradix_cache import Rig
from tests.unit.test_l3_tier import _in_l3_only, gated  # noqa: F401 - a fixture

NO_LAUNCHED_FORWARDS = lambda: None


def manager(r: Rig) -> CacheManager:
    return CacheManager(r.tree, CacheCounters(), False, NO_LAUNCHED_FORWARDS)


def arrive(mgr: CacheManager, rid: str, tokens: list[int]) -> Req:
    """A waiting request of ``tokens`` (and one to compute): its match and its L3 read."""
    params = SamplingParams(max_new_tokens=1)
    req = Req.new(rid, tokens + [1], params, None, set(), 1 << 20, torch.device("cpu"))
    mgr.arrive(req)
    return req


def test_admission_waits_for_the_prefetch_and_counts_its_tokens_as_l3(gated):  # noqa: F811
    r, store = gated(object_size=4)
    tree, mgr = r.tree, manager(r)
    key = list(range(100, 132))
    _in_l3_only(r, key)
    store.reads.close()
    calls: list[int] = []
    keys_of = tree.l3.prefetch.prefetch_keys
    tree.l3.prefetch.prefetch_keys = lambda *a: calls.append(1) or keys_of(*a)
    req = arrive(mgr, "a", key)
    assert tree.l3.prefetch.has_prefetch("a") and mgr.l3_hit(req) == 32
    assert not mgr.ready(req, [])  # wait_complete: the read hangs
    store.reads.open()
    r.settle()
    mgr.match(req)
    assert req.kv.host_hit_length == 32  # the read landed in L2
    mgr.match = lambda q: pytest.fail("no re-match needed")  # type: ignore[method-assign]
    assert mgr.ready(req, [])
    assert req.kv.match_result.tier_tokens == {"l1": 0, "l2": 32, "l3": 0}
    # the 32 tokens its match sees in L2 came from L3: admission counts them there
    mgr.count_hit(req)
    assert req.admission.cached_tokens_per_tier == {"l1": 0, "l2": 0, "l3": 32}
    assert mgr.counters.hit_tokens == {"l1": 0, "l2": 0, "l3": 32}
    assert not tree.l3.prefetch.has_prefetch("a")
    assert calls == [1]  # its object keys were hashed once
    assert mgr.l3_hit(req) == 32  # kept (a retracted request comes back with it) ...
    mgr.forget(req)
    assert mgr.l3_hit(req) == 0 and mgr.l3_progress == {}  # ... until it goes


def test_a_prefix_evicted_while_waiting_is_prefetched_again(gated):  # noqa: F811
    r, _ = gated(object_size=4)
    tree, mgr = r.tree, manager(r)
    key = list(range(100, 132))
    r.insert(key)
    r.settle()  # in L1, L2 and L3
    req = arrive(mgr, "a", key)
    assert not tree.l3.prefetch.has_prefetch("a") and mgr.l3_hit(req) == 32
    flush_tier(tree, "l1")
    flush_tier(tree, "l2")
    mgr.match(req)  # matched 0 < 32 seen before: L3 still holds it
    assert tree.l3.prefetch.has_prefetch("a")
    mgr.forget(req)  # aborted while waiting: its read stops, its slots come back
    r.settle()
    assert not tree.l3.prefetch.has_prefetch("a") and mgr.l3_progress == {}
    assert r.host_pool.available_size() + r.tree.all_host_slots().numel() == r.host_pool.size
    r.check_invariants()


def test_a_request_without_l2_room_takes_it_from_the_landed_prefetches_behind_it(tmp_path):
    d = str(tmp_path / "shared")
    first = Rig(storage_dir=d, object_size=4, device_size=64, host_size=128)
    a, b = list(range(100, 124)), list(range(500, 524))
    try:
        for key in (a, b):
            first.insert(key)
            first.settle()
    finally:
        first.close()
    r = Rig(storage_dir=d, object_size=4, device_size=32, host_size=26)  # L2: one prefix
    try:
        tree, mgr = r.tree, manager(r)
        rb = arrive(mgr, "b", b)  # arrived first, its read lands: L2 holds 24 of 26 slots
        r.settle()
        ra = arrive(mgr, "a", a)  # no room left for a whole object: nothing read
        assert not tree.l3.prefetch.has_prefetch("a") and mgr.l3_hit(ra) == 24
        assert tree.l3.l3_counters["prefetch_skipped"] == 1
        # a goes first: b's landed prefetch gives its room, a's read starts, a waits for it
        assert not mgr.ready(ra, [rb])
        assert tree.l3.l3_counters["prefetch_yielded"] == 1
        assert tree.l3.prefetch.has_prefetch("a") and not tree.l3.prefetch.has_prefetch("b")
        r.settle()
        assert mgr.ready(ra, [rb])
        assert mgr.l3_admitted(ra) == 24
        # b's read still counts as L3's when b is admitted (L2 dropped it meanwhile)
        assert mgr.l3_admitted(rb) == 24
        for q in (ra, rb):
            mgr.forget(q)
        assert mgr.l3_progress == {}
        r.check_invariants()
    finally:
        r.close()


def test_the_scheduler_tells_the_cache_when_each_request_goes(tiny_llama_dir, tmp_path):
    """Engine wiring of the cache manager: requests served from L3 after a restart count their
    prefetched tokens as L3's, and once they finished (or were aborted while waiting) neither
    the manager nor the tier knows anything of them."""
    from engine import Engine

    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(50)] for _ in range(4)]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    opts = {
        "enable_hierarchical_cache": True,
        "max_total_tokens": 512,
        "page_size": 16,
        "hicache_storage_backend": "file",
        "hicache_storage_dir": str(tmp_path / "kv"),
        "hicache_storage_page_size": 16,
        "hicache_prefetch_threshold": 0,
        "hicache_storage_prefetch_policy": "wait_complete",
        "debug_check_invariants": True,
    }

    def known(s) -> tuple[dict, dict]:
        return dict(s.cache_manager.l3_progress), dict(s.tree_cache.l3.prefetch.ongoing_prefetch)

    with Engine(tiny_llama_dir, **opts) as eng:
        first = eng.generate(prompts, greedy)
        assert eng.call_in_scheduler(known) == ({}, {})
    with Engine(tiny_llama_dir, **opts) as eng:  # L1 and L2 empty: the prefixes are in L3
        second = eng.generate(prompts, greedy)
        handle = eng.submit([rng.randrange(3, 380) for _ in range(50)], greedy)
        eng.abort(handle.rid)
        handle.result()
        assert eng.call_in_scheduler(known) == ({}, {})
    assert [s.token_ids for s in second] == [f.token_ids for f in first]
    assert [s.cached_tokens_per_tier["l3"] for s in second] == [48] * 4  # (50 - 1) // 16 * 16
