"""engine/cache_admin over a real RadixCache: match without side effects, evict by count /
prefix / all (and dry runs), pins with TTL, flush, inspection."""

from __future__ import annotations

import pytest

from engine.runtime import cache_admin
from hicache.allocator import TokenToKVPoolAllocator
from hicache.events import CacheEventLog
from hicache.radix_cache import RadixCache


class FakeScheduler:
    def __init__(self, page_size: int = 1, idle: bool = True):
        self.page_size = page_size
        self.alloc = TokenToKVPoolAllocator(256, page_size, "cpu")
        self.tree_cache = RadixCache(None, self.alloc, page_size)
        self.event_log = CacheEventLog()
        self.admin_pins = cache_admin.PinTable()
        self.idle = idle

    def is_idle(self) -> bool:
        return self.idle

    def insert(self, key: list[int]) -> None:
        n = len(key) // self.page_size * self.page_size
        value = self.alloc.alloc(n)
        dup = self.tree_cache.insert(key, value)
        self.alloc.free(value[:dup // self.page_size * self.page_size]) if dup else None


@pytest.fixture(params=[1, 4])
def sched(request) -> FakeScheduler:
    s = FakeScheduler(page_size=request.param)
    s.insert(list(range(1, 17)))  # a 16-token sequence
    s.insert(list(range(1, 9)) + [50 + i for i in range(8)])  # shares 8 tokens
    s.insert([90 + i for i in range(8)])  # unrelated
    return s


def _snapshot(tree: RadixCache) -> list[tuple]:
    return sorted((n.id, tuple(n.key), n.last_access_time, n.hit_count)
                  for n in tree._all_nodes())


def test_match_prefix_has_no_side_effects(sched):
    before = _snapshot(sched.tree_cache)
    m = cache_admin.match_prefix(sched, list(range(1, 13)) + [7, 7, 7, 7])
    assert m.matched_tokens == 12 and m.per_tier == {"l1": 12, "l2": 0, "l3": 0}
    assert cache_admin.match_prefix(sched, [999] * 8).matched_tokens == 0
    assert _snapshot(sched.tree_cache) == before  # no split, no access-time update


def test_evict_dry_run_then_count(sched):
    tree, free0 = sched.tree_cache, sched.alloc.available_size()
    total = tree.total_size()
    dry = cache_admin.evict(sched, "l1", num_tokens=1, dry_run=True)
    assert dry.evicted_tokens >= 1 and tree.total_size() == total
    real = cache_admin.evict(sched, "l1", num_tokens=1)
    assert real.evicted_tokens == dry.evicted_tokens
    assert tree.total_size() == total - real.evicted_tokens
    assert sched.alloc.available_size() == free0 + real.evicted_tokens
    tree.check_integrity()


def test_evict_prefix_only_touches_that_subtree(sched):
    tree = sched.tree_cache
    info = cache_admin.evict(sched, "l1", prefix=list(range(1, 9)))
    assert info.evicted_tokens == 24  # the shared 8 + two 8-token tails
    assert cache_admin.match_prefix(sched, list(range(1, 17))).matched_tokens == 0
    assert cache_admin.match_prefix(sched, [90 + i for i in range(8)]).matched_tokens == 8
    assert cache_admin.evict(sched, "l1", prefix=[1, 2, 3, 4, 77, 78, 79, 80]).evicted_tokens == 0
    tree.check_integrity()


def test_pins_block_eviction_and_expire(sched):
    tree = sched.tree_cache
    p = cache_admin.pin(sched, list(range(1, 17)), ttl_s=10.0, now=100.0)
    assert p is not None and p.tokens == 16
    assert cache_admin.pin_table(sched).pinned_tokens() == 16
    cache_admin.evict(sched, "l1", num_tokens=10_000)
    assert cache_admin.match_prefix(sched, list(range(1, 17))).matched_tokens == 16
    assert tree.total_size() == 16
    assert cache_admin.expire_pins(sched, now=105.0) == 0
    assert cache_admin.expire_pins(sched, now=110.0) == 1
    assert tree.protected_size() == 0 and cache_admin.unpin(sched, p.pin_id) == (0, 0)
    assert cache_admin.pin(sched, [999] * 8) is None
    tree.check_integrity()


def test_pin_splits_to_the_exact_prefix_and_unpin_all(sched):
    tree = sched.tree_cache
    p = cache_admin.pin(sched, list(range(1, 5)) + [0] * 4)  # 4 of the shared 8 tokens
    assert p.tokens == 4 and tree.protected_size() == 4
    assert cache_admin.unpin(sched) == (1, 4)
    assert tree.protected_size() == 0


def test_flush_needs_idle_and_empties(sched):
    tree = sched.tree_cache
    cache_admin.pin(sched, list(range(1, 17)))
    sched.idle = False
    with pytest.raises(cache_admin.NotIdleError):
        cache_admin.flush(sched)
    assert tree.total_size() == 32 and len(cache_admin.pin_table(sched).pins) == 1
    sched.idle = True
    with pytest.raises(cache_admin.TierUnavailableError):
        cache_admin.flush(sched, ["l2"])
    info = cache_admin.flush(sched)
    assert info.flushed == ["l1"] and info.freed_tokens == 32 and info.unpinned == 1
    assert tree.total_size() == 0 and sched.alloc.available_size() == sched.alloc.size
    assert [e.kind for e in sched.event_log.since(0)] == ["cleared"]


def test_inspect_tree_pages_in_depth_first_order(sched):
    nodes, total = cache_admin.inspect_tree(sched, 0, 100, preview_tokens=3)
    assert total == len(nodes) == 4
    ids = {n.node_id: n for n in nodes}
    for n in nodes:  # parents come before their children
        assert n.parent_id == sched.tree_cache.root_node.id or \
            nodes.index(ids[n.parent_id]) < nodes.index(n)
        assert n.residency == ["l1"] and len(n.preview_ids) <= 3
    assert sorted(n.prefix_length for n in nodes) == [8, 8, 16, 16]
    page1, _ = cache_admin.inspect_tree(sched, 0, 3)
    page2, _ = cache_admin.inspect_tree(sched, 3, 3)
    assert [n.node_id for n in page1 + page2] == [n.node_id for n in nodes]


def test_inspect_tree_previews_token_ids_of_namespaced_nodes():
    s = FakeScheduler()
    s.insert(list(s.tree_cache.key_of([5, 6, 7, 8], "warmup")))  # ids + (ns_id << 32)
    (node,), total = cache_admin.inspect_tree(s, 0, 100, preview_tokens=3)
    assert total == 1 and node.preview_ids == [5, 6, 7] and node.token_length == 4


def test_namespace_key_hook_isolates_and_is_not_counted():
    s = FakeScheduler(page_size=1)
    s.namespace_key = lambda key, ns: ([200 + len(ns or "")] if ns else []) + list(key)
    s.insert([203] + list(range(1, 9)))  # namespace "abc" -> prefix token 203
    assert cache_admin.match_prefix(s, list(range(1, 9)), "abc").matched_tokens == 8
    assert cache_admin.match_prefix(s, list(range(1, 9)), "xy").matched_tokens == 0
    assert cache_admin.match_prefix(s, list(range(1, 9)), None).matched_tokens == 0
    p = cache_admin.pin(s, list(range(1, 5)), "abc")
    assert p is not None and p.tokens == 4
    assert cache_admin.evict(s, "l1", prefix=[1, 2], namespace="abc").evicted_tokens == 4


def test_pin_with_a_namespace_pins_that_namespace_prefix():
    s = FakeScheduler(page_size=1)
    key = list(range(1, 9))
    s.insert(list(s.tree_cache.key_of(key, "tenant-a")))
    p = cache_admin.pin(s, key, "tenant-a")
    assert p is not None and p.tokens == 8
    assert s.tree_cache.protected_size() == 8
    cache_admin.evict(s, "l1", num_tokens=10_000)
    assert cache_admin.match_prefix(s, key, "tenant-a").matched_tokens == 8
    assert cache_admin.pin(s, key, "tenant-b") is None  # another namespace has nothing cached
    assert cache_admin.unpin(s) == (1, 8)
    s.tree_cache.check_integrity()


def test_evict_by_prefix_keeps_the_order_of_what_it_does_not_evict(sched):
    """Evict(prefix, num_tokens) frees the least valuable nodes under the prefix; the nodes it
    leaves keep their access time and hit count (no -1 left behind)."""
    tree = sched.tree_cache
    before = {n.id: (n.last_access_time, n.hit_count) for n in tree._all_nodes()}
    info = cache_admin.evict(sched, "l1", num_tokens=1, prefix=list(range(1, 9)))
    assert 1 <= info.evicted_tokens < 24
    after = {n.id: (n.last_access_time, n.hit_count) for n in tree._all_nodes()}
    assert after and all(after[i] == before[i] for i in after), (before, after)
    tree.check_integrity()
