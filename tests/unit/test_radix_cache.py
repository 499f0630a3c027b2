"""RadixCache / ChunkCache: behaviour tests, request lifecycle, and a hypothesis state machine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hicache import ChunkCache, RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from hicache.tree.eviction_plan import StalePlanError
from hicache.tree.ops import (
    lock_prefix,
    namespace_nodes,
    namespace_roots,
    plan_eviction,
    radix_tree,
    subtree,
    unlock_prefix,
    walk,
)


class Sim:
    """A tiny scheduler stand-in: pools, a cache, live requests, and the prefix each slot's KV
    belongs to (``content``) so that matches can be checked for correctness."""

    def __init__(
        self, page_size: int, num_pages: int = 64, policy: str = "lru", chunk: bool = False
    ) -> None:
        self.p = page_size
        self.alloc = TokenToKVPoolAllocator(num_pages * page_size, page_size, "cpu")
        self.pool = ReqToTokenPool(8, 256, "cpu")
        cls = ChunkCache if chunk else RadixCache
        self.cache = cls(self.pool, self.alloc, page_size, eviction_policy=policy)
        self.content: dict[int, tuple[int, ...]] = {}
        self.reqs: list[SimpleNamespace] = []

    def new_req(self, tokens: list[int]) -> SimpleNamespace | None:
        rows = self.pool.alloc(1)
        if rows is None:
            return None
        m = self.cache.match_prefix(tokens)
        self.cache.inc_lock_ref(m.last_device_node)
        self.pool.write((rows[0], slice(0, len(m.device_indices))), m.device_indices)
        # the fields of hicache.tree.request.CacheRequest / CacheKV the caches use
        # (kv_committed_len None: every token but the last sampled one has KV); ``tokens`` and
        # ``kv.kv_len`` are the simulation's own
        kv = SimpleNamespace(
            req_pool_idx=rows[0],
            kv_len=len(m.device_indices),
            fill_ids=list(tokens[: len(m.device_indices)]),
            prefix_indices=m.device_indices,
            last_node=m.last_device_node,
            match_result=None,
            host_hit_length=0,
            kv_committed_len=None,
        )
        req = SimpleNamespace(
            rid=f"sim-{rows[0]}",
            tokens=list(tokens),
            origin_input_ids=[],
            output_ids=[],
            cache_namespace=None,
            kv=kv,
        )
        self.reqs.append(req)
        return req

    def extend(self, req: SimpleNamespace, n: int) -> bool:
        """Allocate and 'compute' KV for the next ``n`` tokens of ``req.tokens``."""
        start, p, row = req.kv.kv_len, self.p, self.pool.req_to_token[req.kv.req_pool_idx]
        n = min(n, len(req.tokens) - start)
        in_page = min((-start) % p, n)  # slots left in the request's partial last page
        need = -(-(n - in_page) // p) * p
        if need > self.alloc.available_size():
            self.cache.evict(need - self.alloc.available_size())
        fresh = self.alloc.alloc(need)
        if fresh is None:
            return False
        parts = [int(row[start - 1]) + 1 + torch.arange(in_page)] if in_page else []
        slots = torch.cat([*parts, fresh[: n - in_page]]).to(torch.int64)
        self.pool.write((req.kv.req_pool_idx, slice(start, start + n)), slots)
        for i, s in enumerate(slots.tolist()):
            self.content[s] = tuple(req.tokens[: start + i + 1])
        req.kv.kv_len = start + n
        req.kv.fill_ids = req.tokens[: req.kv.kv_len]
        return True

    def finish(self, req: SimpleNamespace) -> None:
        # kv_len = len(input) + len(output) - 1: the last sampled token has no KV yet
        req.origin_input_ids, req.output_ids = req.tokens[: req.kv.kv_len], [7]
        self.cache.cache_finished_req(req)
        self.reqs.remove(req)

    def owned_slots(self, req: SimpleNamespace) -> torch.Tensor:
        """Whole pages the request owns: its slots past the tree-held (page-aligned) prefix."""
        tree_len = len(req.kv.prefix_indices) // self.p * self.p
        row = self.pool.req_to_token[req.kv.req_pool_idx, tree_len : req.kv.kv_len].to(torch.int64)
        pages = torch.unique(row // self.p)
        return (pages[:, None] * self.p + torch.arange(self.p)).reshape(-1)

    def check(self, locks: tuple = ()) -> None:
        self.cache.check_integrity()
        free = self.alloc.debug_free_slots()
        parts = [free, self.cache.all_device_slots()]
        parts += [self.owned_slots(r) for r in self.reqs]
        every = torch.sort(torch.cat(parts)).values
        total = self.alloc.num_pages * self.p
        assert torch.equal(every, torch.arange(self.p, total + self.p)), "slots leaked/shared"
        for r in self.reqs:  # every request reads KV computed for its own tokens
            row = self.pool.req_to_token[r.kv.req_pool_idx, : r.kv.kv_len].tolist()
            assert [self.content[s] for s in row] == [
                tuple(r.tokens[: i + 1]) for i in range(r.kv.kv_len)
            ]
            assert not set(row) & set(free.tolist()), "a request reads freed slots"
        # every lock_ref counts exactly the holders (requests, explicit locks) in its subtree
        expected: dict[int, int] = {}
        for node in [r.kv.last_node for r in self.reqs] + list(locks):
            while node is not self.cache.root_node:
                expected[node.id] = expected.get(node.id, 0) + 1
                node = node.parent
        for node in self.cache.all_nodes()[1:]:
            assert node.lock_ref == expected.get(node.id, 0), f"{node!r} lock_ref"

    def check_match(self, key: list[int]) -> torch.Tensor:
        m = self.cache.match_prefix(key)
        n = len(m.device_indices)
        assert n % self.p == 0 and n <= len(key)
        assert [self.content[s] for s in m.device_indices.tolist()] == [
            tuple(key[: i + 1]) for i in range(n)
        ]
        return m.device_indices


def _insert(sim: Sim, tokens: list[int]) -> int:
    """A request that computes all of ``tokens`` from scratch, then finishes."""
    req = sim.new_req([])
    assert req is not None
    req.tokens = list(tokens) + [0]
    assert sim.extend(req, len(tokens))
    sim.finish(req)
    return len(tokens)


def test_insert_match_split_page1() -> None:
    sim = Sim(1)
    _insert(sim, [1, 2, 3, 4])
    slots = sim.check_match([1, 2, 3, 4, 5])
    assert len(slots) == 4
    assert len(sim.cache.root_node.children) == 1
    half = sim.check_match([1, 2, 9])  # ends inside the node: split it
    assert torch.equal(half, slots[:2])
    node = sim.cache.root_node.children[(1,)]
    assert node.key == (1, 2) and list(node.children) == [(3,)]
    assert sim.cache.insert([1, 2, 3, 4], slots) == 4
    sim.check()


def test_page_alignment_and_children_keys() -> None:
    sim = Sim(4)
    _insert(sim, list(range(10)))  # only 8 tokens (2 pages) are cached
    assert sim.cache.total_size() == 8
    assert len(sim.check_match(list(range(10)))) == 8
    assert len(sim.check_match([0, 1, 2, 3, 4, 5, 99, 7])) == 4  # mismatch in page 2
    assert set(sim.cache.root_node.children) == {(0, 1, 2, 3)}
    assert len(sim.check_match([0, 1, 2])) == 0
    sim.check()


def test_lock_sizes_and_evict_lru() -> None:
    sim = Sim(1)
    for key in ([1, 2, 3], [1, 2, 4, 5], [6, 7]):
        _insert(sim, key)
    c = sim.cache
    assert (c.evictable_size(), c.protected_size(), c.total_size()) == (7, 0, 7)
    m = c.match_prefix([1, 2, 4, 5])
    assert c.inc_lock_ref(m.last_device_node) == -4
    assert (c.evictable_size(), c.protected_size()) == (3, 4)
    sim.check(locks=(m.last_device_node,))
    assert c.evict(100) == 3  # [3] and [6, 7] only: [1, 2] + [4, 5] are locked
    assert c.dec_lock_ref(m.last_device_node) == 4
    sim.check_match([6, 7])
    _insert(sim, [6, 7])
    sim.check_match([1, 2, 4, 5])  # most recently used now; [6, 7] older
    assert c.evict(1) == 2 and len(c.match_prefix([6, 7]).device_indices) == 0
    assert c.evict(4) == 4 and c.total_size() == 0
    sim.check()


def test_evict_lfu_prefers_rarely_hit() -> None:
    sim = Sim(1, policy="lfu")
    _insert(sim, [1, 1])
    _insert(sim, [2, 2])
    for _ in range(3):
        sim.check_match([1, 1])
    sim.check_match([2, 2])  # the most recent, but hit less often
    assert sim.cache.evict(1) == 2
    assert len(sim.cache.match_prefix([1, 1]).device_indices) == 2
    assert len(sim.cache.match_prefix([2, 2]).device_indices) == 0


def _state(cache: RadixCache) -> list[tuple]:
    """Every node's key, slots, lock, access time and hit count: what a read must not change."""
    return sorted(
        (
            n.id,
            n.key,
            None if n.value is None else tuple(n.value.tolist()),
            n.lock_ref,
            n.last_access_time,
            n.hit_count,
        )
        for n in cache.all_nodes()
    )


def test_walk_reads_the_path_without_splitting_or_touching() -> None:
    sim = Sim(1)
    _insert(sim, [1, 2, 3, 4])
    _insert(sim, [1, 2, 5, 6])
    c, before = sim.cache, _state(sim.cache)
    steps = walk(c, [1, 2, 3, 9])  # ends inside the [3, 4] node
    assert [(s.node.key, s.tokens, s.tier) for s in steps] == [((1, 2), 2, "l1"), ((3, 4), 1, "l1")]
    assert walk(c, [9, 9]) == [] and walk(c, []) == []
    assert _state(c) == before
    paged = Sim(4)
    _insert(paged, list(range(12)))
    steps = walk(paged.cache, list(range(10)))  # 2 whole pages of the 3-page node
    assert [(len(s.node.key), s.tokens) for s in steps] == [(12, 8)]


def test_plan_follows_the_tree_order_and_evict_plan_frees_exactly_it() -> None:
    sim = Sim(1)
    for key in ([1, 2, 3], [1, 2, 4, 5], [6, 7]):
        _insert(sim, key)
    c = sim.cache
    sim.check_match([6, 7])  # the most recent: evicted last
    before = _state(c)
    plan = plan_eviction(c, "l1", 2)
    assert [n.key for n in plan.nodes] == [(3,), (4, 5)] and plan.tokens == 3
    assert [n.key for n in plan_eviction(c, "l1").nodes] == [(3,), (4, 5), (1, 2), (6, 7)]
    assert plan_eviction(c, "l2").nodes == () and plan_eviction(c, "l1", 0).nodes == ()
    assert _state(c) == before  # planning changes nothing
    free0 = sim.alloc.available_size()
    assert c.evict_plan(plan) == 3
    assert sim.alloc.available_size() == free0 + 3 and c.total_size() == 4
    assert [n.key for n in c.root_node.children[(1,)].children.values()] == []
    sim.check()


def test_evict_plan_refuses_a_stale_plan_and_changes_nothing() -> None:
    sim = Sim(1)
    _insert(sim, [1, 2, 3])
    plan = plan_eviction(sim.cache, "l1")
    _insert(sim, [1, 2, 4])  # splits [1, 2, 3]: the plan's node is not a leaf any more
    before = _state(sim.cache)
    with pytest.raises(StalePlanError):
        sim.cache.evict_plan(plan)
    assert _state(sim.cache) == before
    sim.check()


def test_plan_within_a_subtree_and_locked_nodes() -> None:
    sim = Sim(1)
    for key in ([1, 2, 3], [1, 2, 4], [6, 7]):
        _insert(sim, key)
    c = sim.cache
    prefix_node = walk(c, [1, 2])[-1].node
    within = subtree(prefix_node)
    assert {n.key for n in within} == {(1, 2), (3,), (4,)}
    lock = lock_prefix(c, [1, 2, 4, 9])
    assert lock is not None and lock.tokens == 3 and lock.node.key == (4,)
    plan = plan_eviction(c, "l1", None, within)
    assert [n.key for n in plan.nodes] == [(3,)]  # [1, 2] + [4] are locked
    assert c.evict_plan(plan) == 1 and c.total_size() == 5
    sim.check(locks=(lock.node,))
    unlock_prefix(c, lock)
    assert {n.key for n in plan_eviction(c, "l1", None, subtree(prefix_node)).nodes} == {
        (1, 2),
        (4,),
    }
    sim.check()


def test_lock_prefix_splits_to_the_device_prefix_or_locks_nothing() -> None:
    sim = Sim(4)
    _insert(sim, list(range(16)))
    c = sim.cache
    assert lock_prefix(c, [99] * 8) is None and lock_prefix(c, list(range(3))) is None
    assert lock_prefix(c, list(range(8)), min_tokens=9) is None
    assert c.protected_size() == 0 and len(c.root_node.children[(0, 1, 2, 3)].key) == 16
    lock = lock_prefix(c, list(range(6)) + [99, 99])  # one whole page matches
    assert lock is not None and lock.tokens == 4 and lock.node.key == (0, 1, 2, 3)
    assert c.protected_size() == 4 and c.evictable_size() == 12
    sim.check(locks=(lock.node,))
    unlock_prefix(c, lock)
    assert c.protected_size() == 0
    sim.check()


def test_namespace_roots_and_nodes() -> None:
    sim = Sim(1)
    c = sim.cache
    for ns, key in (("a", [1, 2]), ("a", [1, 3]), ("b", [1, 2]), (None, [1, 2])):
        _insert(sim, list(c.keys.key_of(key, ns)))
    assert {c.keys.split_key(n.key)[0] for n in namespace_roots(c, frozenset({"a"}))} == {"a"}
    assert len(namespace_nodes(c, frozenset({"a"}))) == 3  # [1] -> [2], [3]
    assert len(namespace_nodes(c, frozenset({"a", "b"}))) == 4
    assert len(namespace_nodes(c, None)) == len(c.all_nodes())
    plan = plan_eviction(c, "l1", None, namespace_nodes(c, frozenset({"b"})))
    assert c.evict_plan(plan) == 2
    assert len(c.match_prefix([1, 2], "a").device_indices) == 2
    assert len(c.match_prefix([1, 2], "b").device_indices) == 0
    sim.check()


def test_chunk_cache_has_nothing_to_walk_plan_or_lock() -> None:
    """A ChunkCache is no tree for the tree operations; the admin operations over it find
    nothing to match, evict or pin (a disabled radix tree neither)."""
    from engine.admin_records import EvictInfo
    from engine.runtime import cache_admin

    sim = Sim(1, chunk=True)
    _insert(sim, [1, 2])  # kept by nothing: a ChunkCache shares no prefix
    assert radix_tree(sim.cache) is None and sim.cache.total_size() == 0
    disabled = RadixCache(None, TokenToKVPoolAllocator(8, 1, "cpu"), 1, disable=True)
    assert radix_tree(disabled) is None and radix_tree(Sim(1).cache) is not None
    s = SimpleNamespace(
        tree_cache=sim.cache,
        page_size=1,
        admin_pins=cache_admin.PinTable(),
        event_log=None,
        is_idle=lambda: True,
    )
    assert cache_admin.match_prefix(s, [1, 2]).matched_tokens == 0
    assert cache_admin.evict(s, "l1", dry_run=True) == EvictInfo(0, 0)
    assert cache_admin.evict(s, "l1") == EvictInfo(0, 0)
    assert cache_admin.pin(s, [1, 2]) is None
    assert cache_admin.inspect_tree(s) == ([], 0)


@pytest.mark.parametrize("p", [1, 16])
def test_finished_req_tail_and_duplicates(p: int) -> None:
    sim = Sim(p, num_pages=16 if p == 16 else 256)
    total = sim.alloc.available_size()
    tokens = list(range(2 * p + 8 if p > 1 else 40))
    aligned = len(tokens) // p * p
    a, b = sim.new_req(tokens + [0]), sim.new_req(tokens + [0])  # concurrent: no shared prefix
    assert sim.extend(a, len(tokens)) and sim.extend(b, len(tokens))
    sim.finish(a)
    assert sim.cache.total_size() == aligned  # the partial tail page was freed
    tree_slots = sim.cache.all_device_slots().clone()
    sim.finish(b)  # b's copy of the same prefix is a duplicate: freed, tree unchanged
    assert torch.equal(sim.cache.all_device_slots(), tree_slots)
    assert sim.alloc.available_size() == total - aligned
    assert sim.pool.available_size() == sim.pool.size
    sim.check()


@pytest.mark.parametrize("p", [1, 16])
def test_unfinished_req_chunks(p: int) -> None:
    sim = Sim(p, num_pages=16 if p == 16 else 256)
    total = sim.alloc.available_size()
    first = 2 * p + 8 if p > 1 else 40
    tokens = list(range(first + p))
    _insert(sim, tokens[:first])  # the tree holds 2 pages (or 40 tokens)
    c = sim.new_req(tokens)
    d = sim.new_req(tokens)
    d.kv.prefix_indices, d.kv.kv_len = d.kv.prefix_indices[:0], 0  # started before the insert
    sim.cache.dec_lock_ref(d.kv.last_node)
    d.kv.last_node = sim.cache.root_node
    for req in (c, d):  # chunk 1: up to the first insert's length, then chunk 2: the rest
        assert sim.extend(req, first - req.kv.kv_len)
        sim.cache.cache_unfinished_req(req)
        sim.check()
        assert len(req.kv.prefix_indices) == req.kv.kv_len
        assert req.kv.last_node.lock_ref >= 1
        assert sim.extend(req, len(tokens))
        sim.cache.cache_unfinished_req(req)
        sim.check()
    # d's pages duplicate c's (inserted first): d's row now reads c's tree slots
    aligned = len(tokens) // p * p
    row_c = sim.pool.req_to_token[c.kv.req_pool_idx, :aligned]
    assert torch.equal(sim.pool.req_to_token[d.kv.req_pool_idx, :aligned], row_c)
    assert sim.cache.total_size() == aligned and c.kv.last_node is d.kv.last_node
    assert c.kv.last_node.lock_ref == 2
    sim.finish(c)
    sim.finish(d)
    assert sim.cache.protected_size() == 0
    assert sim.alloc.available_size() == total - aligned
    sim.check()


@pytest.mark.parametrize("p", [1, 4])
def test_chunk_cache(p: int) -> None:
    sim = Sim(p, chunk=True)
    total = sim.alloc.available_size()
    req = sim.new_req(list(range(11)) + [0])
    assert len(req.kv.prefix_indices) == 0
    assert sim.extend(req, 6)
    sim.cache.cache_unfinished_req(req)
    assert len(req.kv.prefix_indices) == 6 and sim.cache.total_size() == 0
    assert sim.extend(req, 5)
    sim.finish(req)
    assert sim.alloc.available_size() == total and sim.pool.available_size() == sim.pool.size
    assert sim.cache.match_prefix(list(range(11))).device_indices.numel() == 0


def test_reset_and_pretty_print(capsys: pytest.CaptureFixture[str]) -> None:
    sim = Sim(1)
    _insert(sim, [1, 2, 3])
    sim.cache.pretty_print()
    assert "lock=0" in capsys.readouterr().out
    sim.cache.reset()
    assert sim.cache.total_size() == 0 and sim.cache.evictable_size() == 0


# keys share long prefixes that diverge mid-page, so that splits and duplicates are common
BASES = ([i % 3 for i in range(24)], [i % 3 for i in range(10)] + [2] * 14, [1] * 24)
TOKENS = st.builds(
    lambda b, n, tail: BASES[b][:n] + tail,
    st.integers(0, 2),
    st.integers(0, 24),
    st.lists(st.integers(0, 2), max_size=6),
).filter(bool)


class RadixMachine(RuleBasedStateMachine):
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(self.page_size, num_pages=48 // self.page_size + 4)
        self.locks: list = []

    @rule(tokens=TOKENS)
    def insert(self, tokens: list[int]) -> None:
        req = self.sim.new_req([])
        if req is not None:
            req.tokens = tokens + [0]
            self.sim.extend(req, len(tokens))
            self.sim.finish(req)

    @rule(tokens=TOKENS, n=st.integers(1, 24))
    def start_req(self, tokens: list[int], n: int) -> None:
        req = self.sim.new_req(tokens)
        if req is not None:
            self.sim.extend(req, n)

    @rule(i=st.integers(0, 7), n=st.integers(0, 12))
    def chunk(self, i: int, n: int) -> None:
        if self.sim.reqs:
            req = self.sim.reqs[i % len(self.sim.reqs)]
            self.sim.extend(req, n)
            self.sim.cache.cache_unfinished_req(req)

    @rule(i=st.integers(0, 7))
    def finish(self, i: int) -> None:
        if self.sim.reqs:
            self.sim.finish(self.sim.reqs[i % len(self.sim.reqs)])

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens: list[int], lock: bool) -> None:
        self.sim.check_match(tokens)
        if lock:
            node = self.sim.cache.match_prefix(tokens).last_device_node
            self.sim.cache.inc_lock_ref(node)
            self.locks.append(node)

    @rule(i=st.integers(0, 7))
    def unlock(self, i: int) -> None:
        if self.locks:
            self.sim.cache.dec_lock_ref(self.locks.pop(i % len(self.locks)))

    @rule(n=st.integers(0, 30))
    def evict(self, n: int) -> None:
        evictable = self.sim.cache.evictable_size()
        freed = self.sim.cache.evict(n)
        assert min(n, evictable) <= freed <= evictable

    @invariant()
    def consistent(self) -> None:
        self.sim.check(tuple(self.locks))


class RadixMachinePaged(RadixMachine):
    page_size = 4


class RadixAdminMachine(RadixMachine):
    """The machine above plus admin evictions: a plan changes nothing, evicting it frees
    exactly its nodes, and a plan of n tokens is what ``evict(n)`` frees."""

    def _device(self) -> dict[int, tuple[int, ...]]:
        return {n.id: n.key for n in self.sim.cache.all_nodes()[1:] if n.value is not None}

    @rule(tokens=TOKENS, n=st.one_of(st.none(), st.integers(0, 30)), scoped=st.booleans())
    def admin_evict(self, tokens: list[int], n: int | None, scoped: bool) -> None:
        c = self.sim.cache
        path = walk(c, tokens)
        within = subtree(path[-1].node) if scoped and path else None
        before, device = _state(c), self._device()
        plan = plan_eviction(c, "l1", n, within)
        assert _state(c) == before
        everything = plan_eviction(c, "l1", None, within)
        assert plan.nodes == everything.nodes[: len(plan.nodes)]  # the same order
        if n == 0:
            assert plan.nodes == ()
        elif n is not None and plan.nodes != everything.nodes:
            assert plan.tokens >= n > plan.tokens - len(plan.nodes[-1].key)  # stops at n
        assert c.evict_plan(plan) == plan.tokens
        gone = set(device) - set(self._device())
        assert gone == {x.id for x in plan.nodes}
        after = {x[0]: x[4:] for x in _state(c)}
        assert all(after[x[0]] == x[4:] for x in before if x[0] in after)  # order kept

    @rule(n=st.integers(0, 30))
    def plan_is_what_evict_frees(self, n: int) -> None:
        c = self.sim.cache
        device = self._device()
        plan = plan_eviction(c, "l1", n)
        assert c.evict(n) == plan.tokens
        assert set(device) - set(self._device()) == {x.id for x in plan.nodes}


class RadixAdminMachinePaged(RadixAdminMachine):
    page_size = 4


_machine_settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestRadixMachine = RadixMachine.TestCase
TestRadixMachine.settings = _machine_settings
TestRadixMachinePaged = RadixMachinePaged.TestCase
TestRadixMachinePaged.settings = _machine_settings
TestRadixAdminMachine = RadixAdminMachine.TestCase
TestRadixAdminMachine.settings = _machine_settings
TestRadixAdminMachinePaged = RadixAdminMachinePaged.TestCase
TestRadixAdminMachinePaged.settings = _machine_settings
