"""HiRadixCache + HiCacheController with small real pools (no model): demotion to host, load
back with identical bytes, write policies, host eviction, L3 roundtrip / restart / corruption,
a random-operation soak asserting every tier's slot accounting, and layer-wise load overlap."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.observe.events import CacheEventLog
from hicache.observe.stats import TierSet, tier_stats
from hicache.storage.file.backend import FileStorageBackend
from hicache.tier import TIERS
from hicache.transfer.controller import HiCacheController, LayerDoneCounter
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.ops import flush_tier, lock_prefix, plan_eviction, subtree, unlock_prefix, walk

L, H, D = 3, 2, 4


class Rig:
    """Device pool + allocator + host pool + controller + tree, and the reference KV bytes."""

    def __init__(
        self,
        page_size: int = 1,
        device_size: int = 32,
        host_size: int = 64,
        policy: str = "write_through",
        layout: str = "layer_first",
        storage_dir: str | None = None,
        layer_hook=None,
        storage=None,
        object_size: int | None = None,
        prefetch_policy: str = "wait_complete",
        prefetch_timeout_base: float = 1.0,
    ) -> None:
        self.page_size = page_size
        self.allocator = TokenToKVPoolAllocator(device_size, page_size, "cpu")
        self.kv_pool = MHATokenToKVPool(device_size, page_size, torch.float32, H, D, L, "cpu")
        self.host_pool = MHATokenToKVPoolHost(
            host_size, page_size, torch.float32, H, D, L, layout=layout
        )
        if storage is None and storage_dir:
            storage = FileStorageBackend(storage_dir, 1 << 26)
        self.object_size = object_size or page_size * 4
        self.controller = HiCacheController(
            self.kv_pool,
            self.host_pool,
            self.allocator,
            storage=storage,
            model_fingerprint="test-model",
            layer_hook=layer_hook,
            storage_object_size=self.object_size,
        )
        self.tree = HiRadixCache(
            None,
            self.allocator,
            page_size,
            self.host_pool,
            self.controller,
            write_policy=policy,
            prefetch_threshold=0,
            prefetch_policy=prefetch_policy,
            prefetch_timeout_base=prefetch_timeout_base,
            prefetch_timeout_per_ki_token=0.0,
        )
        self.kv: dict[int, torch.Tensor] = {}  # token id -> [2, L, H, D] bytes written for it

    def tiers(self) -> TierSet:
        """The tree's tier records (no scheduler: no hits, nothing held by requests)."""
        return tier_stats(self.tree, dict.fromkeys(TIERS, 0), 0)

    def token_kv(self, token: int) -> torch.Tensor:
        if token not in self.kv:
            g = torch.Generator().manual_seed(token)
            self.kv[token] = torch.randn(2, L, H, D, generator=g)
        return self.kv[token]

    def insert(self, key: list[int]) -> int:
        """Allocate slots, write the reference KV of ``key`` there, insert; frees duplicates."""
        slots = self.allocator.alloc(len(key))
        if slots is None:
            self.tree.evict(len(key) - self.allocator.available_size())
            slots = self.allocator.alloc(len(key))
        assert slots is not None
        for layer in range(L):
            k = torch.stack([self.token_kv(t)[0, layer] for t in key])
            v = torch.stack([self.token_kv(t)[1, layer] for t in key])
            self.kv_pool.set_kv_buffer(layer, slots, k, v)
        prefix = self.tree.insert(key, slots)
        self.allocator.free(slots[:prefix])
        return prefix

    def assert_device_kv(self, key: list[int], indices: torch.Tensor) -> None:
        assert len(indices) == len(key)
        if not key:
            return
        for layer in range(L):
            want_k = torch.stack([self.token_kv(t)[0, layer] for t in key])
            want_v = torch.stack([self.token_kv(t)[1, layer] for t in key])
            assert torch.equal(self.kv_pool.k_buffer[layer][indices], want_k)
            assert torch.equal(self.kv_pool.v_buffer[layer][indices], want_v)

    def settle(self) -> None:
        """Every write, load and L3 backup landed and acknowledged."""
        self.controller.start_writing()
        self.controller.wait_idle()
        self.tree.host.check()
        self.controller.wait_storage_idle()
        self.tree.host.check()

    def check_invariants(self, held: torch.Tensor | None = None) -> None:
        self.tree.check_integrity()
        free = self.allocator.debug_free_slots()
        tree = self.tree.all_device_slots()
        held = torch.empty(0, dtype=torch.int64) if held is None else held
        every = torch.cat([free, tree, held])
        assert every.numel() == torch.unique(every).numel() == self.allocator.size
        host = self.tree.all_host_slots()
        hp = self.host_pool
        assert hp.available_size() + hp.pending_free_size() + host.numel() == hp.size
        free_host = set(hp.debug_free_pages().tolist())
        assert not free_host & set((host // self.page_size).tolist())

    def close(self) -> None:
        self.tree.host.shutdown()


@pytest.fixture
def rigs():
    made: list[Rig] = []

    def make(**kw) -> Rig:
        made.append(Rig(**kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize(
    "page_size,layout", [(1, "layer_first"), (4, "page_first"), (4, "layer_first")]
)
def test_demote_then_load_back_identical_bytes(rigs, page_size, layout):
    r = rigs(page_size=page_size, layout=layout)
    key = list(range(100, 124))
    r.insert(key)
    r.settle()
    assert r.tree.evict(r.allocator.size) == 24
    r.check_invariants()
    assert r.tree.total_size() == 0 and r.tree.host.counters["demotions"] == 24
    res = r.tree.match_prefix(key + [1, 2, 3])
    assert len(res.device_indices) == 0 and res.host_hit_length == 24
    assert res.tier_tokens == {"l1": 0, "l2": 24, "l3": 0}
    assert res.last_device_node is r.tree.root_node
    indices, node = r.tree.host.load_back(res.last_device_node, res)
    r.check_invariants()
    r.assert_device_kv(key, indices)
    assert node.value is not None and node.lock_ref == 0
    again = r.tree.match_prefix(key)
    assert again.host_hit_length == 0 and torch.equal(again.device_indices, indices)


def test_partial_device_hit_then_host_tail(rigs):
    r = rigs(page_size=2, device_size=16)
    a, b = list(range(10, 18)), list(range(10, 14)) + list(range(50, 58))
    r.insert(a)
    r.insert(
        b
    )  # needs eviction while a's write-through may still be in flight  # shares 4 tokens with a
    r.settle()
    r.tree.match_prefix(b)  # b is the most recent: a's tail is the LRU leaf
    r.tree.evict(4)
    r.check_invariants()
    res = r.tree.match_prefix(a)
    assert len(res.device_indices) == 4 and res.host_hit_length == 4
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(a, indices)
    r.check_invariants()


def test_load_back_evicts_device_to_make_room(rigs):
    r = rigs(device_size=16, host_size=64)
    first, second = list(range(200, 212)), list(range(300, 312))
    r.insert(first)
    r.settle()
    r.insert(second)  # evicts (demotes) first
    r.settle()
    res = r.tree.match_prefix(first)
    assert res.host_hit_length == 12
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(first, indices)
    r.check_invariants()
    res2 = r.tree.match_prefix(second)
    assert res2.host_hit_length > 0  # second was demoted to make room
    indices2, _ = r.tree.host.load_back(res2.last_device_node, res2)
    r.assert_device_kv(second, indices2)


def test_load_back_that_cannot_start_changes_nothing(rigs, monkeypatch):
    """start_loading raising before the worker got the load (here: the copy stream's event)
    leaves no node pointing at unwritten slots, no slot allocated, no host page protected; the
    next load-back works."""
    r = rigs(device_size=16)
    key = list(range(400, 412))
    r.insert(key)
    r.settle()
    r.tree.evict(12)
    res = r.tree.match_prefix(key)
    free = r.allocator.available_size()

    def lost(*a, **k):
        raise RuntimeError("stream lost")

    monkeypatch.setattr(r.controller.load_stream, "mark_compute", lost)
    with pytest.raises(RuntimeError, match="stream lost"):
        r.tree.host.load_back(res.last_device_node, res, wait=False)
    monkeypatch.undo()
    r.check_invariants()
    assert r.allocator.available_size() == free and r.host_pool.protected_size() == 0
    assert r.controller.load_queue == [] and r.tree.protected_size() == 0
    res = r.tree.match_prefix(key)
    assert res.tier_tokens == {"l1": 0, "l2": 12, "l3": 0}
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)
    r.check_invariants()


def test_write_that_cannot_start_is_started_by_the_next_call(rigs, monkeypatch):
    """start_writing raising before the worker got the writes keeps them queued: the next call
    starts them, and the node's host copy holds its bytes (demote + load back)."""
    r = rigs(device_size=16)
    key = list(range(500, 510))

    def lost(*a, **k):
        raise RuntimeError("stream lost")

    monkeypatch.setattr(r.controller.write_stream, "mark_compute", lost)
    with pytest.raises(RuntimeError, match="stream lost"):
        r.insert(key)
        r.controller.start_writing()
    monkeypatch.undo()
    assert len(r.controller.write_queue) == 1
    r.settle()
    r.check_invariants()
    assert r.tree.evict(10) == 10 and r.tree.host.counters["demotions"] == 10
    res = r.tree.match_prefix(key)
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)


def test_write_through_selective_backs_up_after_second_hit(rigs):
    r = rigs(policy="write_through_selective")
    key = list(range(20))
    r.insert(key)
    r.settle()
    assert r.tree.all_host_slots().numel() == 0  # one use: the request that computed it
    for _ in range(3):
        r.tree.match_prefix(key, touch=False)  # waiting requests' matches are not hits
    r.settle()
    assert r.tree.all_host_slots().numel() == 0
    r.tree.match_prefix(key)  # the second use
    r.settle()
    assert r.tree.all_host_slots().numel() == 20
    r.check_invariants()


def test_unbacked_leaf_is_deleted_not_demoted(rigs):
    r = rigs(policy="write_through_selective")
    r.insert(list(range(10)))
    r.tree.evict(10)
    assert r.tree.match_prefix(list(range(10))).host_hit_length == 0
    r.check_invariants()


def test_write_back_backs_up_on_eviction(rigs):
    r = rigs(policy="write_back")
    key = list(range(40, 56))
    r.insert(key)
    r.settle()
    assert r.tree.all_host_slots().numel() == 0
    assert r.tree.evict(16) == 16
    r.check_invariants()
    res = r.tree.match_prefix(key)
    assert res.host_hit_length == 16
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)


def test_host_eviction_when_host_full(rigs):
    r = rigs(device_size=16, host_size=16)
    old, new = list(range(500, 516)), list(range(600, 616))
    r.insert(old)
    r.settle()
    r.tree.evict(16)  # old: host only, filling the host pool
    assert r.host_pool.available_size() == 0
    r.insert(new)  # its write-through needs host room: old is evicted from host
    r.settle()
    r.check_invariants()
    assert r.tree.host.counters["host_evictions"] == 16
    assert r.tree.match_prefix(old).host_hit_length == 0
    assert r.tree.all_host_slots().numel() == 16


def test_inserting_over_host_only_nodes_revives_them(rigs):
    r = rigs()
    key = list(range(70, 80))
    r.insert(key)
    r.settle()
    r.tree.evict(10)
    prefix = r.insert(key + [1, 2])  # the caller recomputed: the tree takes its slots
    assert prefix == 0
    r.check_invariants()
    res = r.tree.match_prefix(key + [1, 2])
    assert len(res.device_indices) == 12 and res.host_hit_length == 0
    r.assert_device_kv(key + [1, 2], res.device_indices)


@pytest.mark.parametrize("page_size", [1, 4])
def test_l3_roundtrip_restart_and_corruption(rigs, tmp_path, page_size):
    d = str(tmp_path / "kv")
    r = rigs(page_size=page_size, storage_dir=d)
    key = list(range(1000, 1032))
    r.insert(key)
    r.settle()
    S = r.object_size
    assert r.tiers().l2.demoted_tokens == 32  # backed up L2 -> L3: whole objects
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    r.check_invariants()
    assert r.tree.total_size() == 0 and r.tree.all_host_slots().numel() == 0
    assert r.tree.match_prefix(key).host_hit_length == 0  # a match does no L3 I/O
    assert r.tree.l3.prefetch.fetch_from_storage(key) == 32
    res = r.tree.match_prefix(key)
    assert res.host_hit_length == 32
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)
    r.check_invariants()
    l2, l3 = r.tiers().l2, r.tiers().l3
    assert l3.prefetch_objects == 32 // S and l2.promoted_tokens == 32
    # tokens, like the other tiers: 32 tokens stored, capacity whole objects of the byte cap
    assert l3.used_tokens == 32
    assert l3.capacity_tokens > 32 and l3.capacity_tokens % S == 0

    r2 = rigs(page_size=page_size, storage_dir=d)  # restart: a new cache on the same dir
    r2.kv = r.kv
    assert r2.tree.l3.prefetch.fetch_from_storage(key[:16] + [7] * 8) == 16
    res = r2.tree.match_prefix(key[:16] + [7] * 8)
    assert res.host_hit_length == 16
    indices, _ = r2.tree.host.load_back(res.last_device_node, res)
    r2.assert_device_kv(key[:16], indices)
    assert r2.tree.l3.prefetch.fetch_from_storage(key, namespace="other") == 0

    r3 = rigs(page_size=page_size, storage_dir=d)
    files = sorted(glob.glob(os.path.join(d, "**", "*.kv"), recursive=True))
    assert files
    for f in files:  # corrupt every object: a miss, never wrong bytes
        with open(f, "r+b") as fh:
            fh.seek(-4, os.SEEK_END)
            fh.write(b"\xff\x00\xff\x00")
    assert r3.tree.l3.prefetch.fetch_from_storage(key) == 0
    assert r3.tree.match_prefix(key).host_hit_length == 0
    r3.check_invariants()


def test_events_and_stats(rigs):
    from hicache.observe.events import CacheEventLog

    r = rigs()
    r.tree.event_log = log = CacheEventLog()
    key = list(range(30))
    r.insert(key)
    r.settle()
    r.tree.evict(30)
    res = r.tree.match_prefix(key)
    r.tree.host.load_back(res.last_device_node, res)
    kinds = [(e.kind, e.tier) for e in log.since(0)]
    assert kinds == [("stored", "l1"), ("demoted", "l2"), ("promoted", "l1")]
    l1 = r.tiers().l1  # L1 <-> L2 traffic is counted on L1
    assert l1.demoted_tokens == 30 and l1.promoted_tokens == 30
    assert l1.bytes_out == l1.bytes_in == 30 * r.kv_pool.bytes_per_token()
    assert r.tiers().l3 is None


def _tiers(tree: HiRadixCache) -> dict[int, tuple[bool, bool]]:
    """node id -> (holds l1, holds l2), for every node in the tree."""
    return {
        n.id: (n.value is not None, n.host_value is not None)
        for n in tree.all_nodes()
        if n is not tree.root_node
    }


def test_admin_l1_plan_demotes_to_host_like_evict(rigs):
    """An admin eviction of one prefix takes its nodes through evict's own path: backed-up
    nodes are demoted to L2 (events, counters), the other prefix keeps its place in L1."""
    r = rigs()
    a, b = list(range(100, 112)), list(range(200, 208))
    r.insert(a)
    r.insert(b)
    r.settle()
    r.tree.event_log = log = CacheEventLog()
    within = subtree(walk(r.tree, a[:4])[-1].node)
    plan = plan_eviction(r.tree, "l1", None, within)
    assert plan.tokens == 12 and r.tree.host.counters["demotions"] == 0
    free0 = r.allocator.available_size()
    assert r.tree.evict_plan(plan) == 12
    assert r.allocator.available_size() == free0 + 12
    assert r.tree.host.counters["demotions"] == r.tree.host.counters["evictions"] == 12
    assert [(e.kind, e.tier) for e in log.since(0)] == [("demoted", "l2")]
    steps = walk(r.tree, a)
    assert [(s.tokens, s.tier) for s in steps] == [(12, "l2")]
    assert r.tree.match_prefix(b).tier_tokens == {"l1": 8, "l2": 0, "l3": 0}
    r.check_invariants()


def test_admin_l2_plan_drops_host_only_leaves(rigs):
    r = rigs()
    a, b = list(range(100, 112)), list(range(200, 208))
    r.insert(a)
    r.insert(b)
    r.settle()
    r.tree.evict(r.allocator.size)  # both host only now
    plan = plan_eviction(r.tree, "l2", 1)
    (node,) = plan.nodes
    assert node.key == tuple(a) and plan.tokens == 12  # the least recently used
    host0 = r.host_pool.available_size()
    assert r.tree.evict_plan(plan) == 12
    assert r.host_pool.available_size() == host0 + 12
    assert r.tree.host.counters["host_evictions"] == 12
    assert walk(r.tree, a) == [] and [s.tier for s in walk(r.tree, b)] == ["l2"]
    assert plan_eviction(r.tree, "l1").nodes == ()  # nothing on device
    r.check_invariants()


def test_walk_and_lock_prefix_see_the_device_part_only(rigs):
    r = rigs()
    key = list(range(10, 30))
    r.insert(key[:8])
    r.settle()
    r.tree.evict(8)  # [10..17] host only
    r.insert(key)  # revives the host-only part and adds [18..29] on device
    r.settle()
    r.tree.evict(12)  # the tail goes to host: [10..17] on device, [18..29] on host
    before = _tiers(r.tree)
    assert [(s.tokens, s.tier) for s in walk(r.tree, key)] == [(8, "l1"), (12, "l2")]
    assert _tiers(r.tree) == before
    lock = lock_prefix(r.tree, key)
    assert lock is not None and lock.tokens == 8 and r.tree.protected_size() == 8
    assert plan_eviction(r.tree, "l1").nodes == ()  # the device part is locked
    assert [n.key for n in plan_eviction(r.tree, "l2").nodes] == [tuple(key[8:])]
    unlock_prefix(r.tree, lock)
    assert r.tree.protected_size() == 0
    r.check_invariants()


def test_plan_keeps_an_unbacked_node_a_prefetch_anchors_on(rigs):
    """evict keeps a device node with no host copy when a pending prefetch anchors on it (or
    below); the plan leaves it out, and an exact eviction of the plan agrees."""
    r = rigs(policy="write_through_selective")
    a, b = list(range(10)), list(range(50, 56))
    r.insert(a)
    r.insert(b)
    anchor = walk(r.tree, a)[-1].node
    anchor.host_ref += 1  # as a pending prefetch's anchor (l3_prefetch) holds it
    try:
        plan = plan_eviction(r.tree, "l1")
        assert [n.key for n in plan.nodes] == [tuple(b)]
        assert r.tree.evict_plan(plan) == 6
        assert r.tree.evict(100) == 0  # the tree's own eviction keeps it too
        assert walk(r.tree, a)[-1].tier == "l1"
    finally:
        anchor.host_ref -= 1
    assert [n.key for n in plan_eviction(r.tree, "l1").nodes] == [tuple(a)]
    r.check_invariants()


def test_layer_counter_and_overlap():
    c = LayerDoneCounter(3)
    assert not c.wait_until(0, timeout=0.01)
    c.increment()
    assert c.wait_until(0, timeout=0.01) and not c.wait_until(1, timeout=0.01)

    release = threading.Event()
    landed: list[tuple[int, float]] = []

    def hook(layer_id: int) -> None:  # instrumentation: the load stalls after layer 0
        landed.append((layer_id, time.monotonic()))
        if layer_id == 0:
            release.wait(5)

    r = Rig(layer_hook=hook)
    try:
        key = list(range(64, 80))
        r.insert(key)
        r.settle()
        r.tree.evict(16)
        host = torch.cat(
            [n.host_value for n in r.tree.path_of(r.tree.match_prefix(key).last_host_node)]
        )
        dev = r.controller.load(host, node_id=-1)
        assert dev is not None
        r.controller.start_loading()
        assert r.controller.wait_layer(0, timeout=5)
        t0 = time.monotonic()
        assert [x for x, _ in landed] == [0]  # layer 0 ready, the last layer not yet loaded
        assert not r.controller.wait_layer(L - 1, timeout=0.05)
        release.set()
        assert r.controller.wait_layer(L - 1, timeout=5)
        assert landed[-1][0] == L - 1 and landed[-1][1] >= t0
        for layer in range(L):
            assert torch.equal(
                r.kv_pool.k_buffer[layer][dev], torch.stack([r.token_kv(t)[0, layer] for t in key])
            )
        r.controller.wait_idle()
        r.controller.drain_load_acks()
        r.allocator.free(dev)
    finally:
        release.set()
        r.close()


def test_layer_wait_uses_only_its_layers_event(monkeypatch):
    """The forward's wait for layer i makes the compute stream wait on layer i's copy event and
    on nothing else (CUDA events; here stand-ins, since CPU copies have none)."""
    waited: list[object] = []
    monkeypatch.setattr(
        "hicache.transfer.copy_stream.CopyStream.compute_wait",
        staticmethod(lambda ev: waited.append(ev)),
    )
    c = LayerDoneCounter(3)
    c.increment("ev0")
    c.increment("ev1")
    assert c.wait_until(1, timeout=0.01)
    assert waited == ["ev1"]
    assert not c.wait_until(2, timeout=0.01) and waited == ["ev1"]  # not issued: no stream wait
    c.increment("ev2")
    assert c.done == 3 and not c.finished  # every copy issued is not every byte landed
    assert not c.wait_finished(timeout=0.01)
    c.finish()
    assert c.finished and c.wait_finished(timeout=0.01)


def test_pending_layer_wait_until_load_landed():
    """The forward keeps waiting per layer until the worker declared the load landed, not merely
    until every layer's copy was issued (on CUDA the copies are still in flight then)."""
    release = threading.Event()
    r = Rig(layer_hook=lambda layer: layer == L - 1 and release.wait(5))
    try:
        key = list(range(90, 100))
        r.insert(key)
        r.settle()
        r.tree.evict(10)
        res = r.tree.match_prefix(key)
        r.tree.host.load_back(res.last_device_node, res, wait=False)
        assert r.controller.wait_layer(L - 1, timeout=5)  # every layer issued ...
        assert r.tree.host.pending_layer_wait() is not None  # ... but the load has not finished
        release.set()
        r.tree.host.wait_pending_loads()
        assert r.tree.host.pending_layer_wait() is None
    finally:
        release.set()
        r.close()


class HiCacheSoak(RuleBasedStateMachine):
    """Random inserts / matches / locks / evictions / load backs on tiny pools."""

    @initialize(
        page_size=st.sampled_from([1, 2]),
        policy=st.sampled_from(["write_through", "write_through_selective", "write_back"]),
    )
    def setup(self, page_size: int, policy: str) -> None:
        self.rig = Rig(page_size=page_size, device_size=24, host_size=32, policy=policy)
        self.locked: list = []

    def teardown(self) -> None:
        if hasattr(self, "rig"):
            self.rig.close()

    @rule(key=st.lists(st.integers(0, 5), min_size=1, max_size=12))
    def insert(self, key: list[int]) -> None:
        key = [k + 1 for k in key]
        n = len(key) // self.rig.page_size * self.rig.page_size
        if 0 < n <= self.rig.allocator.size - self.rig.tree.protected_size():
            self.rig.insert(key[:n])

    @rule(key=st.lists(st.integers(0, 5), min_size=1, max_size=12), lock=st.booleans())
    def match_and_load(self, key: list[int], lock: bool) -> None:
        key = [k + 1 for k in key]
        res = self.rig.tree.match_prefix(key)
        indices, node = res.device_indices, res.last_device_node
        if res.host_hit_length:
            indices, node = self.rig.tree.host.load_back(node, res)
        n = len(indices)
        self.rig.assert_device_kv(key[:n], indices)
        if lock and len(self.locked) < 2:
            self.rig.tree.inc_lock_ref(node)
            self.locked.append(node)

    @rule()
    def unlock(self) -> None:
        if self.locked:
            self.rig.tree.dec_lock_ref(self.locked.pop(0))

    @rule(n=st.integers(1, 24))
    def evict(self, n: int) -> None:
        self.rig.tree.evict(n)

    @rule(n=st.integers(1, 32))
    def evict_host(self, n: int) -> None:
        self.rig.tree.host.eviction.evict_host(n)

    @rule()
    def settle(self) -> None:
        self.rig.settle()

    @invariant()
    def slots_accounted(self) -> None:
        if hasattr(self, "rig"):
            self.rig.check_invariants()


HiCacheSoak.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
TestHiCacheSoak = HiCacheSoak.TestCase


class HiCacheAdminSoak(HiCacheSoak):
    """The soak above plus admin evictions from L1 / L2: a plan changes nothing, evicting it
    frees exactly its nodes from that tier (demoted or deleted through evict's own path), and
    with every copy landed a plan of n tokens is what ``evict(n)`` / ``evict_host(n)`` frees."""

    @rule(
        tier=st.sampled_from(["l1", "l2"]),
        n=st.one_of(st.none(), st.integers(1, 32)),
        key=st.lists(st.integers(0, 5), min_size=1, max_size=12),
        scoped=st.booleans(),
    )
    def admin_evict(self, tier: str, n: int | None, key: list[int], scoped: bool) -> None:
        tree = self.rig.tree
        path = walk(tree, [k + 1 for k in key])
        within = subtree(path[-1].node) if scoped and path else None
        before = _tiers(tree)
        plan = plan_eviction(tree, tier, n, within)
        assert _tiers(tree) == before and plan.version == tree.version
        assert tree.evict_plan(plan) == plan.tokens
        after = _tiers(tree)
        if tier == "l1":  # demoted (kept on host) or deleted
            lost = {i for i, (dev, _) in before.items() if dev and not after.get(i, (0, 0))[0]}
        else:
            lost = set(before) - set(after)
        assert lost == {x.id for x in plan.nodes}

    @rule(tier=st.sampled_from(["l1", "l2"]), n=st.integers(1, 32))
    def plan_is_what_evict_frees(self, tier: str, n: int) -> None:
        self.rig.settle()  # in-flight writes: evict() would wait for them and take more
        tree = self.rig.tree
        if tree.event_log is None:
            tree.event_log = CacheEventLog()
        log = tree.event_log
        plan = plan_eviction(tree, tier, n)
        seq = log.last_seq
        freed = tree.evict(n) if tier == "l1" else tree.host.eviction.evict_host(n)
        # the nodes evict freed from the tier, in its order (L1: demoted or deleted)
        kinds = {("demoted", "l2"), ("removed", "l1")} if tier == "l1" else {("removed", "l2")}
        order = [e.node_id for e in log.since(seq) if (e.kind, e.tier) in kinds]
        assert freed == plan.tokens and order == [x.id for x in plan.nodes]


HiCacheAdminSoak.TestCase.settings = HiCacheSoak.TestCase.settings
TestHiCacheAdminSoak = HiCacheAdminSoak.TestCase


def test_kv_block_view_follows_demotion_and_load_back(rigs):
    """hicache.observe.blocks: blocks move L1 -> L2 on demotion and are in both after load back."""
    from hicache.observe.blocks import BlockView

    r = rigs(page_size=4)
    key = list(range(100, 124))  # 24 tokens: 3 blocks of 8
    r.insert(key)
    view = BlockView(8, b"k")
    r.settle()
    both = view.snapshot(r.tree)
    assert len(both["l1"]) == 3 and both["l2"] == both["l1"]  # written through to host
    r.tree.evict(r.allocator.size)
    demoted = view.snapshot(r.tree)
    assert demoted["l1"] == [] and demoted["l2"] == both["l2"]
    res = r.tree.match_prefix(key)
    r.tree.host.load_back(res.last_device_node, res)
    assert view.snapshot(r.tree) == both


def test_an_unknown_write_policy_is_refused(rigs):
    """Checked before any part of the tree is built (the rig's controller stays unused)."""
    r = rigs()
    with pytest.raises(ValueError, match="write_policy"):
        HiRadixCache(None, r.allocator, 1, r.host_pool, r.controller, write_policy="sometimes")
    assert r.controller.notify is None
