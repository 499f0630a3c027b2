"""The typed stats records (hicache/observe/stats.py): their fields are the proto's, GetCacheStats and
Prometheus copy every field, and the figures only faults, locks or contention produce are
produced (on the tree, without a model)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading

import pytest
from prometheus_client import generate_latest

from engine.client import cli_args
from engine.server.admin_pb import stats_message, tier_message
from engine.server.metrics import Metrics
from engine.server.pb import admin_pb2
from hicache.observe.stats import CacheStats, L1Stats, L2Stats, L3Stats, TierStats, l3_stats
from hicache.storage.file.backend import FileStorageBackend
from hicache.tier import TIERS, Tier
from hicache.tree.ops import flush_tier
from tests import stats_records as rec
from tests.storage_fakes import GatedStorage
from tests.unit.test_hiradix_cache import Rig

TIER_RECORDS = (L1Stats, L2Stats, L3Stats)


def _names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_tier_records_mirror_the_proto():
    """TierStats' fields are the proto's typed fields, in its order; a tier's own fields are
    none of them (they travel in extra / info)."""
    proto = [
        f.name
        for f in sorted(admin_pb2.TierStats.DESCRIPTOR.fields, key=lambda f: f.number)
        if f.name not in ("tier", "enabled", "extra", "info")
    ]
    assert sorted(_names(TierStats)) == sorted(proto)
    assert _names(TierStats) == [n for n in proto if n != "errors"] + ["errors"]
    for cls in TIER_RECORDS:
        assert _names(cls)[: len(proto)] == _names(TierStats), cls
        assert not set(_names(cls)[len(proto) :]) & {
            f.name for f in admin_pb2.TierStats.DESCRIPTOR.fields
        }, cls


def test_the_cache_record_mirrors_the_response():
    response = {f.name for f in admin_pb2.GetCacheStatsResponse.DESCRIPTOR.fields}
    engine = set(_names(CacheStats)) - set(TIERS)
    assert engine <= response
    # what the response has beyond the record: the daemon's (pins) and the answer's time
    assert response - engine == {"tiers", "admin_pinned_tokens", "num_pins", "timestamp"}


def _distinct(cls: type, start: int) -> object:
    """A record whose every number differs (and no field is 0), so a mix-up shows."""
    kw: dict[str, object] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.type == "str":
            kw[f.name] = f"{f.name}-value"
        elif f.name == "backend_figures":
            kw[f.name] = {"connected": 1, "rtt_us": 85}
        elif f.name == "backend_details":
            kw[f.name] = {"key_prefix": "hicache"}
        else:
            kw[f.name] = start + i
    return cls(**kw)


def _full_record() -> CacheStats:
    tiers = {
        "l1": _distinct(L1Stats, 100),
        "l2": _distinct(L2Stats, 200),
        "l3": _distinct(L3Stats, 300),
    }
    return rec.cache_stats(
        **tiers,
        prompt_tokens=9000,
        miss_tokens=1000,
        requests=7,
        finished_requests=6,
        retractions=2,
        running_requests=1,
        waiting_requests=3,
    )


def test_get_cache_stats_copies_every_field():
    stats = _full_record()
    msg = stats_message(stats, admin_pinned_tokens=5, num_pins=1)
    rec.assert_message_equals(msg, stats)
    assert msg.admin_pinned_tokens == 5 and msg.num_pins == 1
    l3 = msg.tiers[2]
    assert l3.extra["connected"] == 1 and l3.info["key_prefix"] == "hicache"
    assert l3.info["backend"] == "backend-value" and "backend_figures" not in l3.extra
    off = tier_message(Tier.L2, None)
    assert not off.enabled and off.used_tokens == 0 and not off.extra
    partial = rec.cache_stats(l1=stats.l1)
    rec.assert_message_equals(stats_message(partial, 0, 0), partial)


def test_prometheus_exports_every_figure_of_the_record():
    stats = _full_record()
    text = generate_latest(Metrics(lambda: stats).registry).decode()
    rec.assert_metrics_equal(rec.samples(text), stats)
    assert "hicache_l3_connected 1.0" in text


def test_l3_record_counts_objects_in_tokens_once():
    backend = {
        "objects": 5,
        "bytes": 5000,
        "capacity_bytes": 10 * 64 * 10 + 5,
        "hits": 2,
        "misses": 1,
        "errors": 1,
        "evictions": 3,
        "corrupt": 0,
        "vanished": 0,
        "bytes_read": 640,
        "bytes_written": 1280,
        "refused": 4,
    }
    io = {
        "backup_objects": 2,
        "backup_skipped_present": 1,
        "backup_failed_objects": 0,
        "backup_errors": 2,
        "prefetch_objects": 1,
        "prefetch_errors": 3,
        "prefetch_misses": 0,
    }
    counters = dict.fromkeys(
        (
            "prefetch_started",
            "prefetch_skipped",
            "prefetch_cancelled",
            "prefetch_discarded_tokens",
            "prefetch_partial",
            "backup_deferred",
            "backup_dropped_nodes",
            "repaired_objects",
            "backup_gated_nodes",
            "prefetch_yielded",
        ),
        0,
    ) | {"prefetch_tokens": 48}
    l3, moves = l3_stats(
        hit_tokens=7,
        backend=backend,
        describe={"backend": "file"},
        object_tokens=64,
        bytes_per_token=10,
        prefetch_policy="timeout",
        io=io,
        counters=counters,
        pending_backups=1,
        deferred_backups=0,
        pending_prefetches=0,
    )
    assert (l3.used_tokens, l3.evicted_tokens, l3.capacity_tokens) == (5 * 64, 3 * 64, 10 * 64)
    assert l3.errors == 1 + 2 + 3  # the backend's, failed backup jobs, failed prefetches
    assert (l3.hit_tokens, l3.address, l3.backend_figures) == (7, "", {"refused": 4})
    assert moves == (48, 2 * 64, 640, 1280)  # L2's: read from / written to L3
    figures = l3.figures()
    for duplicate in (
        "objects",
        "evictions",
        "backup_objects",
        "prefetch_tokens",
        "bytes_read",
        "bytes_written",
        "backup_errors",
        "prefetch_errors",
        "used_tokens",
    ):
        assert duplicate not in figures, duplicate


def test_the_clients_tiers_are_the_cache_library_s_and_it_loads_no_torch():
    assert cli_args.TIERS == TIERS
    code = (
        "import sys, engine.client.cli, engine.client.cli_output, engine.client.cli_args; "
        "sys.exit('torch' in sys.modules or 'hicache' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0


# ---- figures the e2e traffic (tests/unit/test_metrics.py) leaves at 0 ----------------------------
def test_locked_nodes_are_pinned_in_l1_and_l2():
    r = Rig()
    key = list(range(40, 56))
    r.insert(key)
    r.settle()
    assert r.tiers().l2.pinned_tokens == 0 and r.tiers().l2.cached_tokens == 16
    node = r.tree.match_prefix(key, touch=False).last_device_node
    r.tree.inc_lock_ref(node)
    assert r.tiers().l1.pinned_tokens == r.tiers().l2.pinned_tokens == 16
    r.tree.dec_lock_ref(node)
    assert r.tiers().l1.pinned_tokens == r.tiers().l2.pinned_tokens == 0
    r.close()


def test_copies_in_flight_and_failed_copies_show_on_l2():
    r = Rig()
    copy = r.host_pool.backup_from_device_all_layer
    go = threading.Event()

    def failing(*args, **kw):
        assert go.wait(timeout=30)
        raise RuntimeError("copy failed")

    r.host_pool.backup_from_device_all_layer = failing
    r.insert(list(range(10, 26)))
    r.controller.start_writing()
    assert r.tiers().l2.ongoing_writes == 1  # queued, not acknowledged
    go.set()
    r.settle()
    r.host_pool.backup_from_device_all_layer = copy
    l2 = r.tiers().l2
    assert (l2.ongoing_writes, l2.errors, l2.cached_tokens) == (0, 1, 0)
    r.close()


def test_backups_gated_present_deferred_and_dropped(tmp_path):
    d = str(tmp_path / "kv")
    a = Rig(storage_dir=d, object_size=4)
    key = list(range(100, 116))
    a.insert(key)
    a.settle()
    a.close()
    b = Rig(storage_dir=d, object_size=4)  # the same L3: a's objects are there
    b.insert(key)
    b.settle()
    # found stored: none written again (L2's demoted tokens count what is written)
    assert b.tiers().l3.backup_skipped_present == 4 and b.tiers().l2.demoted_tokens == 0
    b.tree.l3.backup.gate = lambda node: False  # e.g. a tenant at its L3 quota
    b.insert(list(range(200, 216)))
    b.settle()
    assert b.tiers().l3.backup_gated_nodes == 1
    b.close()

    store = GatedStorage(FileStorageBackend(tmp_path / "gated", 1 << 26))
    c = Rig(storage=store, object_size=4, device_size=64, host_size=64)
    store.writes.close()
    for i in range(3):  # 16 tokens each: the third passes the backups' share (half of 64)
        c.insert(list(range(300 + 20 * i, 316 + 20 * i)))
        c.controller.start_writing()
        c.controller.wait_idle()
        c.tree.host.check()
    l3 = c.tiers().l3
    assert (l3.backup_deferred, l3.deferred_backups) == (1, 1) and l3.pending_backups == 2
    flush_tier(c.tree, "l1")
    c.tree.host.eviction.evict_host(1 << 30)  # the deferred node leaves L2 before its turn
    store.writes.open()
    c.settle()
    l3 = c.tiers().l3
    assert (l3.backup_dropped_nodes, l3.deferred_backups, l3.pending_backups) == (1, 0, 0)
    store.release_all()
    c.close()


@pytest.mark.parametrize("damage", ["corrupt", "delete"])
def test_damaged_objects_count_as_corrupt_or_vanished_misses(tmp_path, damage):
    import glob
    import os

    d = str(tmp_path / "kv")
    a = Rig(storage_dir=d, object_size=4)
    key = list(range(500, 516))
    a.insert(key)
    a.settle()
    a.close()
    files = sorted(glob.glob(os.path.join(d, "**", "*.kv"), recursive=True))
    assert len(files) == 4
    b = Rig(storage_dir=d, object_size=4)
    keys = b.tree.l3.storage_keys(tuple(key))
    victim = b.controller.storage._path(keys[2])
    if damage == "delete":
        os.remove(victim)
    else:
        with open(victim, "r+b") as fh:
            fh.seek(-4, os.SEEK_END)
            fh.write(b"\xff\x00\xff\x00")
    assert b.tree.l3.prefetch.fetch_from_storage(key) == 8  # the objects before the damaged one
    l3 = b.tiers().l3
    assert l3.misses >= 1 and l3.prefetch_misses == 1 and l3.prefetch_partial == 1
    assert (l3.corrupt >= 1) if damage == "corrupt" else (l3.vanished >= 1)
    b.close()


def test_prefetches_without_room_in_l2_are_skipped(tmp_path):
    r = Rig(storage_dir=str(tmp_path / "kv"), object_size=4, host_size=16)
    key = list(range(600, 616))
    r.insert(key)
    r.settle()
    flush_tier(r.tree, "l1")
    flush_tier(r.tree, "l2")
    r.insert(list(range(700, 716)))  # fills L2 with a copy of device KV (not evictable there)
    r.settle()
    res = r.tree.match_prefix(key + [1], touch=False)
    assert r.tree.l3.prefetch.start_prefetch("req", key + [1], None, res).tokens == 0
    assert r.tiers().l3.prefetch_skipped == 1 and r.tiers().l3.prefetch_started == 0
    r.close()
