"""L3Tier on its own (no model): a real HiRadixCache + controller on CPU, L3 a file backend in
a tmp dir, behind GatedStorage where the test holds reads or writes back. Backup acks, deferral
under the backups' share of L2, repair, prefetch policies, yield, cancel, attach / detach
refusals, drain at shutdown. (What the scheduler's cache manager decides over these, the L3
admission of waiting requests: tests/unit/test_cache_manager.py.)"""

from __future__ import annotations

import logging

import pytest

from hicache.l3.backup import MAX_BACKUP_HOST_SHARE
from hicache.l3.tier import StorageBusyError
from hicache.storage.file.backend import FileStorageBackend
from hicache.tree.node import TreeNode
from hicache.tree.ops import flush_tier
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
    r.tree.host.check()


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
    assert len(l3.backup.ongoing_backup) == 1 and l3.backup.backup_host_tokens == 16
    assert not node.in_storage and not l3.node_in_storage(node)
    assert l3.storage_busy() and l3.storage_info()["pending"] == 1
    flush_tier(r.tree, "l2")  # its host copy goes; the slots wait for the backup's ack
    assert r.host_pool.pending_free_size() == 16
    store.writes.open()
    r.settle()
    assert not l3.backup.ongoing_backup and l3.backup.backup_host_tokens == 0
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
    assert not r.tree.l3.backup.backup_to_storage(node) and store.set_calls == 1


def test_backups_beyond_their_share_of_l2_wait_and_go_as_earlier_ones_land(gated):
    r, store = gated(object_size=4, device_size=64, host_size=64)
    l3 = r.tree.l3
    share = MAX_BACKUP_HOST_SHARE * r.host_pool.size  # 32 tokens
    store.writes.close()
    keys = [list(range(100 * i, 100 * i + 16)) for i in range(1, 4)]
    for key in keys:
        r.insert(key)
        _land_writes(r)
    assert l3.backup.backup_host_tokens == 32 <= share
    assert len(l3.backup.ongoing_backup) == 2 and list(l3.backup.deferred_backups) == [
        _node(r, keys[2]).id
    ]
    assert l3.storage_stats(0)[0].backup_deferred == 1
    assert l3.storage_stats(0)[0].deferred_backups == 1
    store.writes.open()
    r.settle()  # the first two land, the deferred one is submitted ...
    r.settle()  # ... and lands
    assert not l3.backup.deferred_backups and not l3.backup.ongoing_backup
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
    assert len(l3.backup.deferred_backups) == 1
    flush_tier(r.tree, "l2")  # every unlocked host copy goes, the deferred node's too
    store.writes.open()
    r.settle()
    assert not l3.backup.deferred_backups and l3.l3_counters["backup_dropped_nodes"] == 1
    assert store.inner.batch_exists(l3.storage_keys(tuple(keys[2]))) == 0
    r.check_invariants()


def test_backup_gate_says_no(gated):
    r, store = gated(object_size=4)
    seen: list[int] = []

    def gate(node: TreeNode) -> bool:
        seen.append(node.id)
        return False

    r.tree.l3.backup.gate = gate
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
    l3.backup.repair(tuple(key), 3, 8, keys[3])
    l3.backup.repair(tuple(key), 3, 8, keys[3])  # a repair from that object is in flight: no-op
    assert len(l3.backup.ongoing_backup) == 1 and l3.l3_counters["repaired_objects"] == 5
    assert not _node(r, key).in_storage  # until the repair lands
    store.writes.open()
    r.settle()
    assert store.inner.batch_exists(keys) == 8 and _node(r, key).in_storage
    r.check_invariants()


# ---- prefetch --------------------------------------------------------------------------------
def _in_l3_only(r: Rig, key: list[int]) -> None:
    r.insert(key)
    r.settle()
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
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
        assert (
            r.tree.l3.prefetch.prefetch_deadline()
            == pf.ongoing_prefetch["req"].op.start_time + timeout
        )
    else:
        assert r.tree.l3.prefetch.prefetch_deadline() is None
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
    assert r.tree.l3.prefetch.prefetch_deadline() is None  # nothing is waited for any more
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
    assert r.tree.host.eviction.evict_host(1 << 30) == 0  # landed, protected until admission
    assert pf.yield_prefetch("a") == 16 and not pf.has_prefetch("a")
    assert r.tree.l3.l3_counters["prefetch_yielded"] == 1
    store.reads.close()
    pf.start_prefetch("b", b, None, r.tree.match_prefix(b, touch=False))
    assert store.reads.wait_blocked(1)
    pf.cancel_prefetch("b")
    assert r.host_pool.pending_free_size() == 16  # freed once the read is done with them
    assert r.tree.host.eviction.evict_host(1 << 30) == 16  # a's objects: evictable now
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
    assert l3.storage is store and l3.has_storage() and len(l3.backup.ongoing_backup) == 1
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
    assert l3.object_size == r.tree.l3.object_size == 8 and l3.storage_info()["object_tokens"] == 8
    r.check_invariants()


# ---- drain at shutdown -----------------------------------------------------------------------
def test_drain_lands_every_queued_and_deferred_backup(gated):
    r, store = gated(object_size=4, device_size=64, host_size=64)
    store.writes.close()
    keys = [list(range(100 * i, 100 * i + 16)) for i in range(1, 4)]
    for key in keys:
        r.insert(key)
        _land_writes(r)
    assert len(r.tree.l3.backup.deferred_backups) == 1
    store.writes.open()
    assert r.tree.l3.backup.drain(30) == 0
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
    with caplog.at_level(logging.WARNING, logger="hicache.l3.backup"):
        assert r.tree.l3.backup.drain(0.1) == 12  # 2 backups running, 1 deferred: 4 objects each
    assert "12 objects not stored at shutdown" in caplog.text
    hung.open()
