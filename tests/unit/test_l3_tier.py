"""L3Tier on its own (no model): a real HiRadixCache + controller on CPU, L3 a file backend in
a tmp dir, behind GatedStorage where the test holds reads or writes back. Backup acks, deferral
under the backups' share of L2, repair, prefetch policies, yield, cancel, attach / detach
refusals, drain at shutdown; and the L3 admission decisions the scheduler asks the cache for
(``l3_*``), with requests as the cache sees them (``CacheRequest``)."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import pytest
import torch

from hicache.l3.tier import MAX_BACKUP_HOST_SHARE, StorageBusyError
from hicache.storage.file.backend import FileStorageBackend
from hicache.tree.base import MatchResult
from hicache.tree.hiradix import HiRadixCache
from hicache.tree.node import TreeNode
from tests.storage_fakes import GatedStorage, gate_writes
from tests.unit.test_hiradix_cache import Rig


@pytest.fixture
def gated(tmp_path):
    """make(**rig options) -> (rig, store) with L3 a GatedStorage over a file backend."""
    made: list[tuple[Rig, GatedStorage]] = []

    def make(store_dir: str = "kv", **kw) -> tuple[Rig, GatedStorage]:
        store = GatedStorage(FileStorageBackend(tmp_path / store_dir, 1 << 26))
        rig = Rig(storage=store, **kw)
        made.append((rig, store))
        return rig, store

    yield make
    for rig, store in made:
        store.release_all()
        rig.close()


def _land_writes(r: Rig) -> None:
    """Device->host writes landed and acknowledged (their backups queued, not waited for)."""
    r.controller.start_writing()
    r.controller.wait_idle()
    r.tree.check()


def _node(r: Rig, key: list[int]) -> TreeNode:
    res = r.tree.match_prefix(key, touch=False)
    assert len(res.device_indices) + res.host_hit_length == len(key)
    return res.last_host_node


# ---- backup ----------------------------------------------------------------------------------
def test_backup_protects_host_slots_until_its_ack(gated):
    r, store = gated(object_size=4, host_size=64)
    l3 = r.tree.l3
    store.writes.close()
    key = list(range(100, 116))
    r.insert(key)
    _land_writes(r)
    assert store.writes.wait_blocked(1)
    node = _node(r, key)
    assert len(l3.ongoing_backup) == 1 and l3.backup_host_tokens == 16
    assert not node.in_storage and not l3.node_in_storage(node)
    assert l3.storage_busy() and l3.storage_info()["pending"] == 1
    r.tree.flush_tier("l2")  # its host copy goes; the slots wait for the backup's ack
    assert r.host_pool.pending_free_size() == 16
    store.writes.open()
    r.settle()
    assert not l3.ongoing_backup and l3.backup_host_tokens == 0
    assert r.host_pool.pending_free_size() == 0 and not l3.storage_busy()
    assert store.inner.batch_exists(l3.storage_keys(tuple(key))) == 4
    r.check_invariants()


def test_a_stored_node_is_in_storage_and_not_backed_up_twice(gated):
    r, store = gated(object_size=4)
    key = list(range(100, 116))
    r.insert(key)
    r.settle()
    node = _node(r, key)
    assert node.in_storage and r.tree.l3.node_in_storage(node)
    assert not r.tree.l3.backup_to_storage(node) and store.set_calls == 1


def test_backups_beyond_their_share_of_l2_wait_and_go_as_earlier_ones_land(gated):
    r, store = gated(object_size=4, device_size=64, host_size=64)
    l3 = r.tree.l3
    share = MAX_BACKUP_HOST_SHARE * r.host_pool.size  # 32 tokens
    store.writes.close()
    keys = [list(range(100 * i, 100 * i + 16)) for i in range(1, 4)]
    for key in keys:
        r.insert(key)
        _land_writes(r)
    assert l3.backup_host_tokens == 32 <= share
    assert len(l3.ongoing_backup) == 2 and list(l3.deferred_backups) == [_node(r, keys[2]).id]
    assert l3.storage_stats(0)[0].backup_deferred == 1
    assert l3.storage_stats(0)[0].deferred_backups == 1
    store.writes.open()
    r.settle()  # the first two land, the deferred one is submitted ...
    r.settle()  # ... and lands
    assert not l3.deferred_backups and not l3.ongoing_backup
    for key in keys:
        assert store.inner.batch_exists(l3.storage_keys(tuple(key))) == 4
    r.check_invariants()


def test_a_deferred_node_that_leaves_l2_before_its_turn_is_dropped(gated):
    r, store = gated(object_size=4, device_size=64, host_size=64)
    l3 = r.tree.l3
    store.writes.close()
    keys = [list(range(100 * i, 100 * i + 16)) for i in range(1, 4)]
    for key in keys:
        r.insert(key)
        _land_writes(r)
    assert len(l3.deferred_backups) == 1
    r.tree.flush_tier("l2")  # every unlocked host copy goes, the deferred node's too
    store.writes.open()
    r.settle()
    assert not l3.deferred_backups and l3.l3_counters["backup_dropped_nodes"] == 1
    assert store.inner.batch_exists(l3.storage_keys(tuple(keys[2]))) == 0
    r.check_invariants()


def test_backup_gate_says_no(gated):
    r, store = gated(object_size=4)
    seen: list[int] = []

    def gate(node: TreeNode) -> bool:
        seen.append(node.id)
        return False

    r.tree.set_backup_gate(gate)
    r.insert(list(range(100, 116)))
    r.settle()
    assert seen and store.set_calls == 0
    assert r.tree.l3.l3_counters["backup_gated_nodes"] == len(seen)


# ---- repair ----------------------------------------------------------------------------------
def test_repair_stores_again_what_l3_lost_once_per_missing_object(gated):
    r, store = gated(object_size=4, host_size=256)  # room for two repairs in flight
    l3 = r.tree.l3
    key = list(range(700, 732))
    r.insert(key)
    r.settle()
    keys = l3.storage_keys(tuple(key))
    store.inner.delete(keys[3])  # lost behind our back: it and everything after it
    assert store.inner.batch_exists(keys) == 3
    store.writes.close()
    l3.repair(tuple(key), 3, 8, keys[3])
    l3.repair(tuple(key), 3, 8, keys[3])  # a repair from that object is in flight: no-op
    assert len(l3.ongoing_backup) == 1 and l3.l3_counters["repaired_objects"] == 5
    assert not _node(r, key).in_storage  # until the repair lands
    store.writes.open()
    r.settle()
    assert store.inner.batch_exists(keys) == 8 and _node(r, key).in_storage
    r.check_invariants()


# ---- prefetch --------------------------------------------------------------------------------
def _in_l3_only(r: Rig, key: list[int]) -> None:
    r.insert(key)
    r.settle()
    r.tree.flush_tier("l1")
    r.tree.flush_tier("l2")
    assert r.tree.match_prefix(key, touch=False).host_hit_length == 0


@pytest.mark.parametrize(
    "policy,timeout,waits",
    [
        ("best_effort", 60.0, False),
        ("wait_complete", 60.0, True),
        ("timeout", 60.0, True),
        ("timeout", 0.0, False),
    ],
)
def test_prefetch_policy_decides_whether_a_request_waits_for_its_read(
    gated, policy, timeout, waits
):
    r, store = gated(object_size=4, prefetch_policy=policy, prefetch_timeout_base=timeout)
    pf = r.tree.l3.prefetch
    key = list(range(400, 432))
    _in_l3_only(r, key)
    store.reads.close()
    assert pf.start_prefetch("req", key, None, r.tree.match_prefix(key, touch=False)) == (32, 32)
    assert store.reads.wait_blocked(1)
    if policy == "timeout":
        assert r.tree.prefetch_deadline() == pf.ongoing_prefetch["req"].op.start_time + timeout
    else:
        assert r.tree.prefetch_deadline() is None
    if waits:
        assert pf.poll_prefetch("req") is None  # nothing landed, the policy waits
        store.reads.open()
        r.settle()  # the finished read is collected at its ack
        assert pf.poll_prefetch("req") == 32
    else:
        assert pf.poll_prefetch("req") == 0  # admitted now with what landed: nothing
        assert r.tree.l3.l3_counters["prefetch_partial"] == 1
        store.reads.open()
        r.settle()
    assert r.tree.prefetch_deadline() is None  # nothing is waited for any more
    pf.finish_prefetch("req")
    assert not pf.has_prefetch("req")
    assert r.tree.match_prefix(key, touch=False).host_hit_length == (32 if waits else 0)
    r.check_invariants()


def test_a_landed_prefetch_yields_its_protection_and_a_cancel_gives_back_its_slots(gated):
    r, store = gated(object_size=4)
    pf = r.tree.l3.prefetch
    a, b = list(range(100, 116)), list(range(200, 216))
    _in_l3_only(r, a)
    _in_l3_only(r, b)
    store.reads.close()
    pf.start_prefetch("a", a, None, r.tree.match_prefix(a, touch=False))
    assert store.reads.wait_blocked(1)
    assert pf.yield_prefetch("a") == 0 and pf.has_prefetch("a")  # in flight: nothing done
    store.reads.open()
    r.settle()
    assert r.tree.evict_host(1 << 30) == 0  # landed, protected until admission
    assert pf.yield_prefetch("a") == 16 and not pf.has_prefetch("a")
    assert r.tree.l3.l3_counters["prefetch_yielded"] == 1
    store.reads.close()
    pf.start_prefetch("b", b, None, r.tree.match_prefix(b, touch=False))
    assert store.reads.wait_blocked(1)
    pf.cancel_prefetch("b")
    assert r.host_pool.pending_free_size() == 16  # freed once the read is done with them
    assert r.tree.evict_host(1 << 30) == 16  # a's objects: evictable now
    store.reads.open()
    r.settle()
    assert r.host_pool.available_size() == r.host_pool.size
    assert r.tree.l3.l3_counters["prefetch_cancelled"] == 1
    r.check_invariants()


# ---- attach / detach -------------------------------------------------------------------------
def test_attach_and_detach_refuse_and_change_nothing(gated, tmp_path):
    r, store = gated(object_size=4, page_size=4)
    l3 = r.tree.l3
    with pytest.raises(StorageBusyError, match="already attached"):
        l3.attach_storage(FileStorageBackend(tmp_path / "other", 1 << 26), 4)
    store.writes.close()
    key = list(range(100, 116))
    r.insert(key)
    _land_writes(r)
    assert store.writes.wait_blocked(1)
    with pytest.raises(StorageBusyError, match="nothing was detached"):
        l3.detach_storage(timeout=0.1)
    assert l3.storage is store and l3.has_storage() and len(l3.ongoing_backup) == 1
    store.writes.open()
    assert l3.detach_storage(timeout=10) is store
    assert not l3.has_storage()
    assert l3.storage_info() == {"attached": False} and l3.storage_keys(tuple(key)) == []
    assert l3.storage_prefix_len(key) == 0 and not l3.node_in_storage(_node(r, key))
    assert l3.detach_storage() is None
    with pytest.raises(ValueError, match="not a multiple of the page size"):
        l3.attach_storage(store, 6)
    assert not l3.has_storage()
    l3.attach_storage(store, 8)
    assert l3.object_size == r.tree.object_size == 8 and l3.storage_info()["object_tokens"] == 8
    r.check_invariants()


# ---- drain at shutdown -----------------------------------------------------------------------
def test_drain_lands_every_queued_and_deferred_backup(gated):
    r, store = gated(object_size=4, device_size=64, host_size=64)
    store.writes.close()
    keys = [list(range(100 * i, 100 * i + 16)) for i in range(1, 4)]
    for key in keys:
        r.insert(key)
        _land_writes(r)
    assert len(r.tree.l3.deferred_backups) == 1
    store.writes.open()
    assert r.tree.drain_storage(30) == 0
    for key in keys:
        assert store.inner.batch_exists(r.tree.l3.storage_keys(tuple(key))) == 4


def test_drain_counts_what_a_hung_store_never_got(gated, caplog):
    r, store = gated(object_size=4, device_size=64, host_size=64)
    hung = gate_writes(store.inner)
    keys = [list(range(100 * i, 100 * i + 16)) for i in range(1, 4)]
    for key in keys:
        r.insert(key)
        _land_writes(r)
    assert hung.wait_blocked(1)
    with caplog.at_level(logging.WARNING, logger="hicache.l3.tier"):
        assert r.tree.drain_storage(0.1) == 12  # 2 backups running, 1 deferred: 4 objects each
    assert "12 objects not stored at shutdown" in caplog.text
    hung.open()


# ---- admission (what the scheduler asks the cache: l3_*) -------------------------------------
@dataclass
class WaitingKV:
    """A waiting request's KV as the caches see it (hicache.tree.request.CacheKV)."""

    req_pool_idx: int | None = None
    fill_ids: list[int] = field(default_factory=list)
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None
    match_result: MatchResult | None = None
    host_hit_length: int = 0
    kv_committed_len: int | None = None


@dataclass
class Waiting:
    """A waiting request as the caches see it (hicache.tree.request.CacheRequest)."""

    rid: str
    origin_input_ids: list[int]
    cache_namespace: str | None = None
    output_ids: list[int] = field(default_factory=list)
    kv: WaitingKV = field(default_factory=WaitingKV)


def rematch(tree: HiRadixCache, req: Waiting) -> None:
    """The scheduler's match of a waiting request (all its tokens but the last)."""
    kv = req.kv
    kv.fill_ids = req.origin_input_ids + req.output_ids
    res = tree.match_prefix(kv.fill_ids[:-1], namespace=req.cache_namespace, touch=False)
    kv.prefix_indices, kv.last_node = res.device_indices, res.last_device_node
    kv.host_hit_length, kv.match_result = res.host_hit_length, res
    tree.l3_matched(req)


def arrive(tree: HiRadixCache, rid: str, tokens: list[int]) -> Waiting:
    req = Waiting(rid, tokens + [1])
    rematch(tree, req)
    tree.l3_start(req)
    return req


def test_admission_waits_for_the_prefetch_and_counts_its_tokens_as_l3(gated):
    r, store = gated(object_size=4)
    tree = r.tree
    key = list(range(100, 132))
    _in_l3_only(r, key)
    store.reads.close()
    calls: list[int] = []
    keys_of = tree.l3.prefetch.prefetch_keys
    tree.l3.prefetch.prefetch_keys = lambda *a: calls.append(1) or keys_of(*a)
    req = arrive(tree, "a", key)
    assert tree.l3.prefetch.has_prefetch("a") and tree.l3_hit(req) == 32
    assert not tree.l3_ready(req, [], lambda q: rematch(tree, q))  # wait_complete: read hangs
    store.reads.open()
    r.settle()
    rematch(tree, req)
    assert req.kv.host_hit_length == 32  # the read landed in L2
    assert tree.l3_ready(req, [], lambda q: pytest.fail("no re-match needed"))
    assert req.kv.match_result.tier_tokens == {"l1": 0, "l2": 32, "l3": 0}
    # the 32 tokens its match sees in L2 came from L3: admission counts them there
    assert tree.admit(req) == {"l1": 0, "l2": 0, "l3": 32}
    assert not tree.l3.prefetch.has_prefetch("a")
    assert calls == [1]  # its object keys were hashed once
    assert tree.l3_hit(req) == 32  # kept (a retracted request comes back with it) ...
    tree.l3_forget(req)
    assert tree.l3_hit(req) == 0 and tree.l3.admission.progress == {}  # ... until it goes


def test_a_prefix_evicted_while_waiting_is_prefetched_again(gated):
    r, _ = gated(object_size=4)
    tree = r.tree
    key = list(range(100, 132))
    r.insert(key)
    r.settle()  # in L1, L2 and L3
    req = arrive(tree, "a", key)
    assert not tree.l3.prefetch.has_prefetch("a") and tree.l3_hit(req) == 32
    tree.flush_tier("l1")
    tree.flush_tier("l2")
    rematch(tree, req)  # matched 0 < 32 seen before: L3 still holds it
    assert tree.l3.prefetch.has_prefetch("a")
    tree.l3_forget(req)  # aborted while waiting: its read stops, its slots come back
    r.settle()
    assert not tree.l3.prefetch.has_prefetch("a") and tree.l3.admission.progress == {}
    assert r.host_pool.available_size() + r.tree.all_host_slots().numel() == r.host_pool.size
    r.check_invariants()


def test_a_request_without_l2_room_takes_it_from_the_landed_prefetches_behind_it(gated, tmp_path):
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
        tree = r.tree
        rb = arrive(tree, "b", b)  # arrived first, its read lands: L2 holds 24 of 26 slots
        r.settle()
        ra = arrive(tree, "a", a)  # no room left for a whole object: nothing read
        assert not tree.l3.prefetch.has_prefetch("a") and tree.l3_hit(ra) == 24
        assert tree.l3.l3_counters["prefetch_skipped"] == 1
        # a goes first: b's landed prefetch gives its room, a's read starts, a waits for it
        assert not tree.l3_ready(ra, [rb], lambda q: rematch(tree, q))
        assert tree.l3.l3_counters["prefetch_yielded"] == 1
        assert tree.l3.prefetch.has_prefetch("a") and not tree.l3.prefetch.has_prefetch("b")
        r.settle()
        assert tree.l3_ready(ra, [rb], lambda q: rematch(tree, q))
        assert tree.l3_admitted(ra) == 24
        # b's read still counts as L3's when b is admitted (L2 dropped it meanwhile)
        assert tree.l3_admitted(rb) == 24
        for q in (ra, rb):
            tree.l3_forget(q)
        assert tree.l3.admission.progress == {}
        r.check_invariants()
    finally:
        r.close()


def test_the_scheduler_tells_the_cache_when_each_request_goes(tiny_llama_dir, tmp_path):
    """Engine wiring of the l3_* calls: requests served from L3 after a restart count their
    prefetched tokens as L3's, and once they finished (or were aborted while waiting) the
    tier knows nothing of them."""
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
        l3 = s.tree_cache.l3
        return dict(l3.admission.progress), dict(l3.prefetch.ongoing_prefetch)

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
