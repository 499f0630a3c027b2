"""The L3 pipeline of HiRadixCache + HiCacheController (no model): device->host writes are
acknowledged without waiting for L3, backups and prefetches run on their own threads over host
slots only, prefetch policies, cancellation, anchors, and repair of objects L3 lost."""

from __future__ import annotations

import threading
import time

import pytest

from hicache.storage.file.backend import FileStorageBackend
from hicache.tree.ops import flush_tier
from tests.storage_fakes import GatedStorage
from tests.unit.test_hiradix_cache import Rig


@pytest.fixture
def gated_rig(tmp_path):
    made: list[tuple[Rig, GatedStorage]] = []

    def make(**kw) -> tuple[Rig, GatedStorage]:
        store = GatedStorage(FileStorageBackend(tmp_path / f"kv{len(made)}", 1 << 26))
        rig = Rig(storage=store, **kw)
        made.append((rig, store))
        return rig, store

    yield make
    for rig, store in made:
        store.release_all()
        rig.close()


def _land_writes(r: Rig) -> None:
    """Device->host writes landed and acknowledged (L3 not waited for)."""
    r.controller.start_writing()
    r.controller.wait_idle()
    r.tree.host.check()


def test_blocked_l3_never_holds_device_pages(gated_rig):
    r, store = gated_rig(device_size=32, host_size=256, object_size=4)
    store.writes.close()  # L3 accepts nothing, ever (until the test ends)
    first = list(range(100, 124))
    r.insert(first)
    _land_writes(r)
    assert store.writes.wait_blocked(1)
    node = r.tree.match_prefix(first, touch=False).last_device_node
    assert node.lock_ref == 0 and r.tree.evictable_size() == 24  # unlocked once on host
    assert r.tiers().l3.pending_backups >= 1
    # device eviction and new inserts go on while the backup hangs
    for i in range(4):
        r.insert(list(range(200 + 30 * i, 224 + 30 * i)))
        _land_writes(r)
        r.check_invariants()
    assert r.tree.host.counters["demotions"] > 0
    res = r.tree.match_prefix(first)
    assert res.host_hit_length == 24  # demoted, still served from L2
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(first, indices)
    store.writes.open()
    r.settle()
    r.check_invariants()
    assert store.inner.batch_exists(r.tree.l3.storage_keys(tuple(first))) == 6


def test_one_backup_job_writes_many_objects_in_one_batch(gated_rig):
    r, store = gated_rig(object_size=4, device_size=64, host_size=128)
    r.insert(list(range(300, 332)))  # one node, 8 objects
    r.settle()
    assert store.set_calls == 1
    assert store.inner.stats()["objects"] == 8
    r.insert(list(range(300, 332)) + list(range(900, 903)))  # a tail shorter than one object
    r.settle()
    assert store.inner.stats()["objects"] == 8 and store.set_calls == 1  # nothing to store


def test_backup_of_a_node_spanning_objects_uses_its_parents_host_slots(gated_rig):
    r, store = gated_rig(object_size=8)
    a = list(range(10, 22))  # 12 tokens: object 0 ends inside it
    r.insert(a)
    r.settle()
    r.insert(a + list(range(50, 62)))  # +12 tokens: objects 1 (tokens 8..15) and 2 end inside
    r.settle()
    keys = r.tree.l3.storage_keys(tuple(a + list(range(50, 62))))
    assert len(keys) == 3 and store.inner.batch_exists(keys) == 3
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    assert r.tree.l3.prefetch.fetch_from_storage(a + list(range(50, 62))) == 24
    res = r.tree.match_prefix(a + list(range(50, 62)))
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(a + list(range(50, 62)), indices)


def _stored_then_flushed(r: Rig, key: list[int]) -> None:
    r.insert(key)
    r.settle()
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    r.check_invariants()


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
def test_prefetch_policies(gated_rig, policy):
    """12 objects of 4 tokens, read 4 per batch; the first batch lands, the rest hang."""
    r, store = gated_rig(
        object_size=4,
        prefetch_policy=policy,
        prefetch_timeout_base=0.5,
        device_size=64,
        host_size=128,
    )
    key = list(range(400, 448))
    _stored_then_flushed(r, key)
    store.reads.close()
    match = r.tree.match_prefix(key, touch=False)
    assert r.tree.l3.prefetch.start_prefetch("req", key, None, match) == (48, 48)
    if policy == "best_effort":
        assert (
            r.tree.l3.prefetch.poll_prefetch("req") == 0
        )  # admitted now, with what arrived: nothing
    else:
        store.reads.allow(1)
        assert store.reads.wait_passed(1)
        t0 = time.monotonic()
        while r.tree.l3.prefetch.ongoing_prefetch["req"].op.completed < 4:
            time.sleep(0.01)
        assert r.tree.l3.prefetch.poll_prefetch("req") is None  # neither complete nor timed out
        if policy == "wait_complete":
            store.reads.open()
            r.controller.wait_storage_idle()
            r.tree.host.check()  # the finished read is collected at once
            assert r.tree.l3.prefetch.poll_prefetch("req") == 48
        else:
            deadline = r.tree.l3.prefetch.prefetch_deadline()
            assert deadline is not None and deadline >= t0
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
            assert r.tree.l3.prefetch.poll_prefetch("req") == 16  # what landed before the timeout
    r.tree.l3.prefetch.finish_prefetch("req")
    store.reads.open()
    r.settle()
    r.check_invariants()
    got = r.tree.l3.prefetch.poll_prefetch("req")
    assert got == 0  # forgotten after admission
    res = r.tree.match_prefix(key)
    want = {"best_effort": 0, "wait_complete": 48, "timeout": 16}[policy]
    assert res.host_hit_length == want
    if want:
        indices, _ = r.tree.host.load_back(res.last_device_node, res)
        r.assert_device_kv(key[:want], indices)


def test_cancel_gives_back_every_host_slot(gated_rig):
    r, store = gated_rig(object_size=4)
    key = list(range(500, 532))
    _stored_then_flushed(r, key)
    store.reads.close()
    r.tree.l3.prefetch.start_prefetch("req", key, None, r.tree.match_prefix(key, touch=False))
    assert store.reads.wait_blocked(1)
    assert r.host_pool.available_size() == r.host_pool.size - 32
    r.tree.l3.prefetch.cancel_prefetch("req")
    store.reads.open()
    r.settle()
    r.check_invariants()
    assert r.host_pool.available_size() == r.host_pool.size  # nothing leaked
    assert r.tree.match_prefix(key).host_hit_length == 0
    assert r.tiers().l3.prefetch_cancelled == 1


def test_prefetch_anchor_survives_host_eviction(gated_rig):
    r, store = gated_rig(object_size=4, device_size=32, host_size=64)
    key = list(range(600, 632))
    _stored_then_flushed(r, key)
    r.tree.l3.prefetch.fetch_from_storage(key[:8])  # the first 8 tokens are back in L2
    store.reads.close()
    match = r.tree.match_prefix(key, touch=False)
    assert match.host_hit_length == 8
    assert r.tree.l3.prefetch.start_prefetch("req", key, None, match) == (24, 32)
    assert (
        r.tree.host.eviction.evict_host(1 << 30) == 0
    )  # the anchor (and so its path) is protected
    store.reads.open()
    r.controller.wait_storage_idle()
    r.tree.host.check()
    assert r.tree.l3.prefetch.poll_prefetch("req") == 24
    assert r.tree.host.eviction.evict_host(1 << 30) == 0  # protected until admission
    r.tree.l3.prefetch.finish_prefetch("req")
    res = r.tree.match_prefix(key)
    assert res.host_hit_length == 32
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)
    r.check_invariants()


def test_l2_repairs_objects_l3_lost(gated_rig):
    r, store = gated_rig(object_size=4)
    key = list(range(700, 732))
    r.insert(key)
    r.settle()
    keys = r.tree.l3.storage_keys(tuple(key))
    assert store.inner.batch_exists(keys) == 8
    store.inner.delete(keys[3])  # lost behind our back: it and everything after it
    assert store.inner.batch_exists(keys) == 3
    r.tree.l3.prefetch.start_prefetch(
        "req", key + [1], None, r.tree.match_prefix(key + [1], touch=False)
    )
    r.settle()
    assert store.inner.batch_exists(keys) == 8  # written again from L2
    assert r.tiers().l3.repaired_objects == 5
    r.tree.l3.prefetch.cancel_prefetch("req")


def test_waiting_matches_do_not_count_hits(gated_rig):
    r, _ = gated_rig()
    key = list(range(800, 816))
    r.insert(key)
    r.settle()
    node = r.tree.match_prefix(key, touch=False).last_device_node
    before = (node.hit_count, node.last_access_time)
    for _ in range(5):
        r.tree.match_prefix(key, touch=False)
    assert (node.hit_count, node.last_access_time) == before
    r.tree.record_hit(node)
    assert node.hit_count == before[0] + 1 and node.last_access_time > before[1]


def test_version_changes_only_with_the_cached_tokens(gated_rig):
    r, _ = gated_rig()
    key = list(range(850, 866))
    v0 = r.tree.version
    r.insert(key)
    r.settle()
    v1 = r.tree.version
    assert v1 > v0
    r.tree.match_prefix(key, touch=False)
    node = r.tree.match_prefix(key, touch=False).last_device_node
    r.tree.inc_lock_ref(node)
    r.tree.dec_lock_ref(node)
    assert r.tree.version == v1  # matching and locking change nothing cached
    r.tree.evict(16)
    assert r.tree.version > v1


def test_flat_objects_do_not_depend_on_the_device_page_size(tmp_path):
    """Objects written at page size 1 are read back at page size 4 (same object size)."""
    d = str(tmp_path / "kv")
    a = Rig(page_size=1, storage_dir=d, object_size=8)
    key = list(range(900, 932))
    try:
        a.insert(key)
        a.settle()
    finally:
        a.close()
    b = Rig(page_size=4, storage_dir=d, object_size=8)
    b.kv = a.kv
    try:
        assert b.tree.l3.prefetch.fetch_from_storage(key) == 32
        res = b.tree.match_prefix(key)
        indices, _ = b.tree.host.load_back(res.last_device_node, res)
        b.assert_device_kv(key, indices)
    finally:
        b.close()


def test_detach_waits_for_in_flight_backups_and_refuses_while_they_hang(gated_rig, tmp_path):
    from hicache.l3.tier import StorageBusyError

    r, store = gated_rig(object_size=4)
    store.writes.close()
    key = list(range(800, 832))
    keys = r.tree.l3.storage_keys(tuple(key))
    r.insert(key)
    _land_writes(r)
    assert store.writes.wait_blocked(1)
    with pytest.raises(StorageBusyError, match="nothing was detached"):
        r.tree.l3.detach_storage(timeout=0.2)
    assert r.tree.l3.storage is store and r.tiers().l3.pending_backups == 1
    store.writes.open()
    assert r.tree.l3.detach_storage(timeout=10) is store  # the hung backup landed first
    assert store.inner.batch_exists(keys) == 8
    assert r.tiers().l3 is None and r.controller.storage_io is None
    assert r.tree.l3.storage_keys(tuple(key)) == []  # no L3, no keys
    r.check_invariants()
    # serving goes on without L3: inserts, demotions, loads
    r.insert(list(range(900, 924)))
    r.settle()
    r.check_invariants()
    assert r.tree.l3.detach_storage() is None  # nothing attached: a no-op


def test_attach_at_run_time_backs_up_what_l2_holds_and_serves_it(gated_rig, tmp_path):
    from hicache.l3.tier import StorageBusyError

    r, _ = gated_rig(object_size=4)
    r.tree.l3.detach_storage()
    key = list(range(1000, 1032))
    r.insert(key)
    r.settle()
    fresh = FileStorageBackend(tmp_path / "attached", 1 << 26)
    r.tree.l3.attach_storage(fresh, 4)
    with pytest.raises(StorageBusyError, match="already attached"):
        r.tree.l3.attach_storage(fresh, 4)
    keys = r.tree.l3.storage_keys(tuple(key))
    assert fresh.batch_exists(keys) == 0
    # the next match of the prefix backs up what L2 holds (the repair path)
    r.tree.l3.prefetch.start_prefetch(
        "req", key + [1], None, r.tree.match_prefix(key + [1], touch=False)
    )
    r.settle()
    r.tree.l3.prefetch.cancel_prefetch("req")
    assert fresh.batch_exists(keys) == 8
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    assert r.tree.l3.prefetch.fetch_from_storage(key) == 32
    res = r.tree.match_prefix(key)
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)
    r.check_invariants()


class _WriteGate:
    """Holds the controller's device->host copies: each one waits for its own ``allow``."""

    def __init__(self, r: Rig) -> None:
        self.sem = threading.Semaphore(0)
        self.started = threading.Semaphore(0)
        copy = r.host_pool.backup_from_device_all_layer

        def gated(*args, **kw):
            self.started.release()
            assert self.sem.acquire(timeout=30), "write gate never opened"
            return copy(*args, **kw)

        r.host_pool.backup_from_device_all_layer = gated

    def allow(self, n: int = 1) -> None:
        for _ in range(n):
            self.sem.release()


def test_backup_waits_for_an_ancestors_host_bytes_still_in_flight(gated_rig):
    """A parent written to L2 after its child (its first write found L2 full): the child's
    object that reaches back into the parent is stored only once the parent's host bytes
    landed, never from host slots the copy has not filled yet."""
    r, store = gated_rig(object_size=8, device_size=64, host_size=64)
    a, b = list(range(10, 22)), list(range(50, 62))  # object 1 = a[8:12] + b[0:4]
    write = r.controller.write
    r.controller.write = lambda *args, **kw: None  # L2 full: a is not written
    r.insert(a)
    r.controller.write = write
    assert r.tree.match_prefix(a, touch=False).last_device_node.host_value is None
    r.host_pool.kv_buffer.fill_(float("nan"))  # what unwritten host slots hold
    gate = _WriteGate(r)
    r.insert(a + b)  # b's write (held)
    assert gate.started.acquire(timeout=10)
    r.tree.record_hit(r.tree.match_prefix(a + b, touch=False).last_device_node)  # a's write
    gate.allow(1)  # b's bytes land, a's are still in flight
    deadline = time.monotonic() + 10
    while r.controller.ack_write_queue.empty() and time.monotonic() < deadline:
        time.sleep(0.005)
    r.tree.host.check()  # b acknowledged: its backup must not read a's unwritten slots
    r.controller.wait_storage_idle()
    gate.allow(1)
    r.settle()
    keys = r.tree.l3.storage_keys(tuple(a + b))
    assert store.inner.batch_exists(keys) == 3  # all stored, none skipped for good
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    assert r.tree.l3.prefetch.fetch_from_storage(a + b) == 24
    res = r.tree.match_prefix(a + b)
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(a + b, indices)
    r.check_invariants()


def test_a_failed_write_leaves_no_host_copy_in_the_parts_of_a_split_node(gated_rig):
    """A device->host write fails after its node was split (a request sharing part of it):
    neither part keeps the host slots the copy never filled."""
    r, _ = gated_rig(object_size=8, device_size=64, host_size=64)
    copy = r.host_pool.backup_from_device_all_layer
    started, go = threading.Event(), threading.Event()

    def failing(*args, **kw):
        started.set()
        assert go.wait(timeout=30)
        raise RuntimeError("copy failed")

    r.host_pool.backup_from_device_all_layer = failing
    a = list(range(10, 34))
    r.insert(a)
    assert started.wait(timeout=10)
    r.insert(a[:12] + list(range(70, 74)))  # splits a's node at 12 while its write runs
    head = r.tree.match_prefix(a[:12], touch=False).last_device_node
    assert len(head.key) == 12 and head.host_value is not None
    r.host_pool.backup_from_device_all_layer = copy
    go.set()
    r.settle()
    assert r.controller.stats["errors"] == 1
    assert head.host_value is None and head.host_pending is None
    r.check_invariants()
    flush_tier(r.tree, "l1")  # a's tail leaves; its head, a parent now, is written again
    r.settle()
    assert r.tree.match_prefix(a, touch=False).host_hit_length == 12
    key = a[:12] + list(range(70, 74))
    res = r.tree.match_prefix(key)
    assert res.host_hit_length == 16
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(key, indices)  # the bytes of the second write, not the failed one's
    r.check_invariants()


def test_a_node_split_before_its_write_lands_backs_up_both_parts(gated_rig):
    """A document inserted, then split by a second question on it while the first insert's
    device->host write is still in flight: once the write lands, the objects ending in the
    split-off parent reach L3 too (before: only the child named in the write was backed up, so
    a shared document never reached L3)."""
    r, store = gated_rig(object_size=8, device_size=64, host_size=128)
    doc = list(range(100, 124))  # 24 tokens: objects 0, 1, 2
    r.insert(doc + [7, 8])
    r.insert(doc[:20] + [9, 9, 9])  # splits the pending node at 20: objects 0, 1 end above
    r.settle()
    keys = r.tree.l3.storage_keys(tuple(doc))
    assert len(keys) == 3 and store.inner.batch_exists(keys) == 3
    r.check_invariants()
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    assert r.tree.l3.prefetch.fetch_from_storage(doc) == 24


def test_a_write_that_finds_l2_room_held_by_backups_lands_once_they_do(gated_rig):
    """L2 is full of a page whose L3 backup is running (the store holds it); a new node's
    write-through evicts that page, but its room comes back only once the backup is done: the
    write waits for that room (it is not dropped), lands with the right bytes, and is backed up
    in turn."""
    r, store = gated_rig(object_size=4, device_size=64, host_size=16)
    store.writes.close()
    old, new = list(range(900, 916)), list(range(1000, 1012))
    r.insert(old)
    _land_writes(r)
    assert store.writes.wait_blocked(1, 30)  # old's backup is in the store
    r.tree.evict(64)  # old: host only
    r.insert(new)  # its write evicts old from L2; the room is held by old's backup
    node = r.tree.match_prefix(new).last_device_node
    assert node.host_value is None and node.id in r.tree.host.waiting_writes
    assert r.host_pool.pending_free_size() == 16
    store.writes.open()
    assert r.controller.wait_storage_idle(30)
    r.tree.host.check()  # room back: new's write is queued
    _land_writes(r)
    assert node.host_value is not None and not r.tree.host.waiting_writes
    r.check_invariants()
    r.tree.evict(64)  # new: host only; loaded back, its bytes are the ones computed
    res = r.tree.match_prefix(new)
    indices, _ = r.tree.host.load_back(res.last_device_node, res)
    r.assert_device_kv(new, indices)
    assert r.controller.wait_storage_idle(30)
    r.tree.host.check()
    assert store.inner.batch_exists(r.tree.l3.storage_keys(tuple(old))) == 4
    assert store.inner.batch_exists(r.tree.l3.storage_keys(tuple(new))) == 3
