"""engine/cache_admin over a real RadixCache: match without side effects, evict by count /
prefix / all (and dry runs), pins with TTL, flush, inspection."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.runtime import cache_admin
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.observe.events import CacheEventLog
from hicache.tree.keys import TreeKeys
from hicache.tree.ops import namespace_nodes, subtree, walk
from hicache.tree.radix import RadixCache


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
        self.alloc.free(value[: dup // self.page_size * self.page_size]) if dup else None


@pytest.fixture(params=[1, 4])
def sched(request) -> FakeScheduler:
    s = FakeScheduler(page_size=request.param)
    s.insert(list(range(1, 17)))  # a 16-token sequence
    s.insert(list(range(1, 9)) + [50 + i for i in range(8)])  # shares 8 tokens
    s.insert([90 + i for i in range(8)])  # unrelated
    return s


def _snapshot(tree: RadixCache) -> list[tuple]:
    return sorted((n.id, tuple(n.key), n.last_access_time, n.hit_count) for n in tree.all_nodes())


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
        assert n.parent_id == sched.tree_cache.root_node.id or nodes.index(
            ids[n.parent_id]
        ) < nodes.index(n)
        assert n.residency == ["l1"] and len(n.preview_ids) <= 3
    assert sorted(n.prefix_length for n in nodes) == [8, 8, 16, 16]
    page1, _ = cache_admin.inspect_tree(sched, 0, 3)
    page2, _ = cache_admin.inspect_tree(sched, 3, 3)
    assert [n.node_id for n in page1 + page2] == [n.node_id for n in nodes]


def test_inspect_tree_previews_token_ids_of_namespaced_nodes():
    s = FakeScheduler()
    s.insert(list(s.tree_cache.keys.key_of([5, 6, 7, 8], "warmup")))  # ids + (ns_id << 32)
    (node,), total = cache_admin.inspect_tree(s, 0, 100, preview_tokens=3)
    assert total == 1 and node.preview_ids == [5, 6, 7] and node.token_length == 4


class PrependedNamespaceKeys(TreeKeys):
    """Tree keys whose key_of prepends one token per namespace (200 + len(name)) instead of
    folding it into every token."""

    def key_of(self, token_ids, namespace=None):
        return tuple(([200 + len(namespace)] if namespace else []) + list(token_ids))


def test_namespace_key_hook_isolates_and_is_not_counted():
    s = FakeScheduler(page_size=1)
    s.tree_cache = RadixCache(None, s.alloc, 1)
    s.tree_cache.keys = PrependedNamespaceKeys(1)  # the tree defines the namespace key
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
    s.insert(list(s.tree_cache.keys.key_of(key, "tenant-a")))
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
    before = {n.id: (n.last_access_time, n.hit_count) for n in tree.all_nodes()}
    info = cache_admin.evict(sched, "l1", num_tokens=1, prefix=list(range(1, 9)))
    assert 1 <= info.evicted_tokens < 24
    after = {n.id: (n.last_access_time, n.hit_count) for n in tree.all_nodes()}
    assert after and all(after[i] == before[i] for i in after), (before, after)
    tree.check_integrity()


# --- admin operations on a HiRadixCache, and as tree operations --------------------------------
class HiScheduler:
    """FakeScheduler over a HiRadixCache rig (tests/unit/test_hiradix_cache.py's Rig)."""

    def __init__(self, page_size: int = 1, policy: str = "write_through"):
        from tests.unit.test_hiradix_cache import Rig

        self.rig = Rig(page_size=page_size, device_size=32, host_size=48, policy=policy)
        self.page_size = page_size
        self.alloc = self.rig.allocator
        self.tree_cache = self.rig.tree
        self.event_log = self.tree_cache.event_log = CacheEventLog()
        self.admin_pins = cache_admin.PinTable()

    def is_idle(self) -> bool:
        return True

    def insert(self, key: list[int]) -> None:
        n = len(key) // self.page_size * self.page_size
        if 0 < n <= self.alloc.size - self.tree_cache.protected_size():
            self.rig.insert(key[:n])

    def close(self) -> None:
        self.rig.close()


@pytest.fixture
def hi():
    s = HiScheduler()
    yield s
    s.close()


def _tiers(tree) -> dict[int, tuple[bool, bool]]:
    return {
        n.id: (n.value is not None, n.host_value is not None)
        for n in tree.all_nodes()
        if n is not tree.root_node
    }


def test_admin_eviction_of_a_prefix_demotes_it_to_l2(hi):
    a, b = list(range(1, 13)), list(range(50, 58))
    hi.insert(a)
    hi.insert(b)
    dry = cache_admin.evict(hi, "l1", prefix=a[:4], dry_run=True)
    assert dry == (12, 1)
    assert cache_admin.evict(hi, "l1", prefix=a[:4]) == dry
    assert cache_admin.match_prefix(hi, a).per_tier == {"l1": 0, "l2": 12, "l3": 0}
    assert cache_admin.match_prefix(hi, b).per_tier == {"l1": 8, "l2": 0, "l3": 0}
    assert hi.tree_cache.host.counters["demotions"] == 12
    assert [(e.kind, e.tier) for e in hi.event_log.since(0)][-1] == ("demoted", "l2")
    # and from L2: what is left of it on host only
    assert cache_admin.evict(hi, "l2", prefix=a[:4], dry_run=True) == (12, 1)
    assert cache_admin.evict(hi, "l2", num_tokens=1) == (12, 1)
    assert cache_admin.match_prefix(hi, a).matched_tokens == 0
    hi.rig.check_invariants()


def test_admin_pin_keeps_the_device_part_and_blocks_its_eviction(hi):
    a = list(range(1, 17))
    hi.insert(a[:8])
    cache_admin.evict(hi, "l1")  # [1..8] host only
    hi.insert(a)  # revived, and [9..16] added
    cache_admin.evict(hi, "l1", prefix=a)  # [9..16] host only
    hi.insert(a[:8])
    p = cache_admin.pin(hi, a, ttl_s=5.0, now=10.0)
    assert p is not None and p.tokens == 8  # the device part only
    assert cache_admin.evict(hi, "l1", dry_run=True) == (0, 0)
    assert cache_admin.evict(hi, "l2", dry_run=True) == (8, 1)  # the host-only tail may go
    nodes, _ = cache_admin.inspect_tree(hi)
    assert [(n.residency, n.pinned) for n in nodes] == [(["l1", "l2"], True), (["l2"], False)]
    assert cache_admin.expire_pins(hi, now=15.0) == 1
    assert cache_admin.evict(hi, "l1") == (8, 1)
    hi.rig.check_invariants()


def test_admin_eviction_of_a_namespace_leaves_the_others(hi):
    tree = hi.tree_cache
    for ns in ("a", "b"):
        hi.insert(list(tree.keys.key_of(list(range(1, 9)), ns)))
    before = _tiers(tree)
    info = cache_admin.evict(hi, "l1", namespaces=frozenset({"a"}))
    assert info == (8, 1)
    assert cache_admin.match_prefix(hi, list(range(1, 9)), "a").per_tier["l2"] == 8
    assert cache_admin.match_prefix(hi, list(range(1, 9)), "b").per_tier["l1"] == 8
    changed = {i for i, t in _tiers(tree).items() if t != before[i]}
    assert {tree.keys.split_key(n.key)[0] for n in tree.all_nodes() if n.id in changed} == {"a"}
    with pytest.raises(cache_admin.TierUnavailableError):
        cache_admin.evict(hi, "l3")
    hi.rig.check_invariants()


def test_admin_eviction_on_a_tree_without_l2_refuses_l2(sched):
    with pytest.raises(cache_admin.TierUnavailableError):
        cache_admin.evict(sched, "l2", num_tokens=1)
    assert sched.tree_cache.total_size() == 32


KEYS = st.lists(st.integers(0, 5), min_size=1, max_size=12)
NAMESPACES = st.sampled_from([None, "a", "b"])


class AdminMachine(RuleBasedStateMachine):
    """Random trees (L1 only or L1 + L2, namespaces, pins) and random admin evictions: a dry
    run changes nothing and says what the real eviction then frees (tokens and nodes, from that
    tier, within its scope, never a pinned node), and every tier's slots stay accounted for."""

    @initialize(
        hier=st.booleans(),
        page_size=st.sampled_from([1, 2]),
        policy=st.sampled_from(["write_through", "write_back"]),
    )
    def setup(self, hier: bool, page_size: int, policy: str) -> None:
        self.s = HiScheduler(page_size, policy) if hier else FakeScheduler(page_size)
        self.pins: list[str] = []

    def teardown(self) -> None:
        if isinstance(getattr(self, "s", None), HiScheduler):
            self.s.close()

    @rule(key=KEYS, ns=NAMESPACES)
    def insert(self, key: list[int], ns: str | None) -> None:
        tree = self.s.tree_cache
        full = list(tree.keys.key_of([k + 1 for k in key], ns))
        if isinstance(self.s, FakeScheduler):
            need = len(full) // self.s.page_size * self.s.page_size
            if need > self.s.alloc.available_size():
                tree.evict(need - self.s.alloc.available_size())
            if need > self.s.alloc.available_size():
                return
        self.s.insert(full)

    @rule(key=KEYS, ns=NAMESPACES)
    def pin(self, key: list[int], ns: str | None) -> None:
        p = cache_admin.pin(self.s, [k + 1 for k in key], ns)
        if p is not None:
            self.pins.append(p.pin_id)

    @rule(i=st.integers(0, 7))
    def unpin(self, i: int) -> None:
        if self.pins:
            assert cache_admin.unpin(self.s, self.pins.pop(i % len(self.pins)))[0] == 1

    @rule(
        tier=st.sampled_from(["l1", "l2"]),
        what=st.sampled_from(["count", "prefix", "ns"]),
        n=st.one_of(st.none(), st.integers(1, 40)),
        key=KEYS,
        ns=NAMESPACES,
        scope=st.sampled_from([frozenset({"a"}), frozenset({"b", "a"})]),
    )
    def evict(
        self,
        tier: str,
        what: str,
        n: int | None,
        key: list[int],
        ns: str | None,
        scope: frozenset[str],
    ) -> None:
        tree = self.s.tree_cache
        kw: dict = {"num_tokens": n}
        if what == "prefix":
            kw.update(prefix=[k + 1 for k in key], namespace=ns)
        elif what == "ns":
            kw.update(namespaces=scope)
        if tier == "l2" and not (tree.host is not None):
            with pytest.raises(cache_admin.TierUnavailableError):
                cache_admin.evict(self.s, tier, **kw)
            return
        cache_admin.settle(tree)
        before = _tiers(tree)
        dry = cache_admin.evict(self.s, tier, dry_run=True, **kw)
        assert _tiers(tree) == before
        nodes = {x.id: x for x in tree.all_nodes()}
        pinned = set()  # the pinned nodes and their ancestors: all locked
        for i in self.s.admin_pins.pinned_node_ids():
            node = nodes[i]
            while node is not tree.root_node:
                pinned.add(node.id)
                node = node.parent
        in_scope = {x.id for x in tree.all_nodes()}
        if what == "prefix":
            path = walk(tree, tree.keys.key_of(kw["prefix"], ns))
            in_scope = {x.id for x in subtree(path[-1].node)} if path else set()
        elif what == "ns":
            in_scope = {x.id for x in namespace_nodes(tree, scope)}
        free0, host0 = self.s.alloc.available_size(), self._host_free()
        real = cache_admin.evict(self.s, tier, **kw)
        assert real == dry
        after = _tiers(tree)
        col = 0 if tier == "l1" else 1
        lost = {i for i, t in before.items() if t[col] and not after.get(i, (False, False))[col]}
        assert len(lost) == real.evicted_nodes and lost <= in_scope and not lost & pinned
        if tier == "l1":
            assert self.s.alloc.available_size() == free0 + real.evicted_tokens
        else:
            assert self._host_free() == host0 + real.evicted_tokens

    def _host_free(self) -> int:
        if not isinstance(self.s, HiScheduler):
            return 0
        hp = self.s.rig.host_pool
        return hp.available_size() + hp.pending_free_size()

    @invariant()
    def accounted(self) -> None:
        if not hasattr(self, "s"):
            return
        if isinstance(self.s, HiScheduler):
            self.s.rig.check_invariants()  # integrity; free + cached == total on L1 and L2
        else:
            self.s.tree_cache.check_integrity()
            assert (
                self.s.alloc.available_size() + self.s.tree_cache.total_size() == self.s.alloc.size
            )


AdminMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
TestAdminMachine = AdminMachine.TestCase


# --- step hooks and the quota enforcer, given to the scheduler ---------------------------------
def _real_scheduler(page_size: int = 1, step_hooks=(), hierarchical: bool = False):
    """A Scheduler with no model over a RadixCache, or (``hierarchical``) over the HiRadixCache
    of a rig (tests/unit/test_hiradix_cache.py), closed with the test."""
    import torch

    from engine.config import ServerArgs
    from engine.runtime.layers.attention import create_backend
    from engine.runtime.scheduler import Scheduler
    from tests.unit.test_hiradix_cache import Rig

    if hierarchical:
        rig = Rig(page_size=page_size, device_size=64, host_size=128)
        _RIGS.append(rig)
        alloc, tree = rig.allocator, rig.tree
    else:
        alloc = TokenToKVPoolAllocator(256, page_size, "cpu")
        tree = RadixCache(None, alloc, page_size)
    runner = SimpleNamespace(
        req_to_token_pool=None,
        allocator=alloc,
        kv_pool=None,
        attn_backend=create_backend("torch_native", None),
        device=torch.device("cpu"),
    )
    s = Scheduler(ServerArgs(page_size=page_size), runner, tree, 256, step_hooks=step_hooks)
    return s, alloc


_RIGS: list = []


@pytest.fixture(autouse=True)
def _close_rigs():
    yield
    while _RIGS:
        _RIGS.pop().close()


def _cache(s, alloc, key: list[int]) -> None:
    s.tree_cache.insert(key, alloc.alloc(len(key)))


def test_the_scheduler_expires_pins_by_its_own_step_hook():
    s, alloc = _real_scheduler()
    _cache(s, alloc, list(range(1, 9)))
    p = cache_admin.pin(s, list(range(1, 9)), ttl_s=1.0, now=time.monotonic() - 2.0)
    assert p is not None and s.tree_cache.protected_size() == 8
    kept = cache_admin.pin(s, list(range(1, 5)))  # no TTL
    assert s.step() is False  # nothing to run; the hooks ran
    assert list(s.admin_pins.pins) == [kept.pin_id] and s.tree_cache.protected_size() == 4


def test_step_hooks_run_in_order_until_removed():
    calls: list[str] = []
    s, _ = _real_scheduler(step_hooks=[lambda sch: calls.append("ctor")])
    handle = s.step_hooks.add(lambda sch: calls.append("added"))
    s.step()
    s.step_hooks.remove(handle)
    s.step()
    assert calls == ["ctor", "added", "ctor"]
    with pytest.raises(KeyError):
        s.step_hooks.remove(handle)


@pytest.mark.parametrize("hierarchical", [False, True])
def test_a_quota_enforcer_replaces_the_one_before(hierarchical):
    from engine.admin_records import TenantQuota
    from engine.runtime.tenant_cache import apply_quotas, set_quota_enforcer

    s, alloc = _real_scheduler(hierarchical=hierarchical)  # L3 part: its backups take the gate
    tree = s.tree_cache
    _cache(s, alloc, list(tree.keys.key_of(list(range(1, 9)), "a")))
    _cache(s, alloc, list(tree.keys.key_of(list(range(1, 9)), "b")))
    s.cache_manager.settle()  # write-through copies landed: no node is locked by a copy

    def quota(l1: int, l3: int = 0) -> list[TenantQuota]:
        return [TenantQuota("t", frozenset({"a"}), {"l1": l1, "l2": 0, "l3": l3})]

    def on_device(ns: str) -> int:
        return cache_admin.match_prefix(s, list(range(1, 9)), ns).per_tier["l1"]

    def gate() -> object:
        return tree.l3.backup.gate if tree.l3 is not None else None

    apply_quotas(s, quota(4))
    apply_quotas(s, quota(0, l3=64))  # no L1 quota any more: the one above must not run
    s.step()
    assert on_device("a") == 8
    if tree.l3 is not None:
        assert gate() == s.quota_enforcer.allow_backup  # an L3 quota gates backups
    apply_quotas(s, quota(4))
    s.step()
    assert on_device("a") == 0 and on_device("b") == 8
    assert gate() is None
    apply_quotas(s, quota(2))  # the evictions counted so far carry over
    assert s.quota_enforcer.by_name["t"].evicted_tokens["l1"] == 8
    set_quota_enforcer(s, None)
    assert s.quota_enforcer is None and gate() is None
    s.step()
