"""FileStorageBackend (chain-aware index that agrees with the disk) and object key hashing."""

from __future__ import annotations

import errno
import glob
import logging
import os
import random
import shutil
import struct
import tempfile
import threading
import time
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.storage import FileStorageBackend, object_keys, page_hashes, prefix_hash_seed
from hicache.storage.file import backend as file_mod
from hicache.storage.file import scan as file_scan
from hicache.tree.ops import flush_tier

SEED = prefix_hash_seed("test-model", None)


def page(seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 4, 2, 8, generator=g).to(dtype)  # [2, L, page, H, D]


def files(d) -> list[str]:
    return sorted(glob.glob(os.path.join(d, "*", "*.kv")))


def chain(tag: int, n: int) -> list[str]:
    """``n`` chained object keys (4-token objects)."""
    return object_keys([tag] * 4 + list(range(4 * n - 4)), 4, SEED)


def parents(keys: list[str], first_parent: str | None = None) -> list[str | None]:
    return [first_parent] + keys[:-1]


def store_chain(
    s: FileStorageBackend, keys: list[str], base: int = 0, first_parent: str | None = None
) -> None:
    vals = [page(base + i) for i in range(len(keys))]
    assert s.batch_set(keys, vals, parents(keys, first_parent)) == [True] * len(keys)


def flip_payload_byte(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))


def on_disk_bytes(d) -> int:
    return sum(os.path.getsize(f) for f in files(d))


def test_page_hashes_chain():
    seed = prefix_hash_seed("smollm2:layer_first", "ns")
    a = page_hashes(list(range(10)), 4, seed)
    assert len(a) == 2 and all(len(h) == 64 for h in a)
    assert page_hashes(list(range(8)), 4, seed) == a  # the tail page has no key
    b = page_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4, seed)
    assert b[0] == a[0] and b[1] != a[1]
    c = page_hashes([7, 1, 2, 3, 4, 5, 6, 7], 4, seed)
    assert c[1] != a[1]  # a key depends on every earlier page
    assert page_hashes(list(range(8)), 4, prefix_hash_seed("smollm2:layer_first", "other")) != a
    assert page_hashes(list(range(8)), 4, prefix_hash_seed("other-model", "ns")) != a
    assert object_keys(list(range(12)), 4, seed, start=4, prev=a[0])[0] == a[1]


def test_roundtrip_and_leading_exists(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    vals = [page(i) for i in range(3)] + [page(9, torch.bfloat16)]
    assert s.batch_set(["k0", "k1", "k2", "k3"], vals) == [True] * 4
    got = s.batch_get(["k0", "k1", "nope", "k3"])
    assert torch.equal(got[0], vals[0]) and torch.equal(got[1], vals[1]) and got[2] is None
    assert got[3].dtype == torch.bfloat16 and torch.equal(got[3], vals[3])
    assert s.batch_exists(["k0", "k1", "nope", "k2"]) == 2
    assert s.batch_exists(["k0", "k1", "k2"]) == 3 and s.batch_exists(["x", "k0"]) == 0
    assert s.exists_mask(["x", "k0", "k2"]) == [False, True, True]
    assert s.set("raw/key with spaces", b"hello") and s.get("raw/key with spaces") == b"hello"
    st_ = s.stats()
    assert st_["objects"] == 5 and st_["hits"] == 4 and st_["misses"] == 1
    assert st_["bytes"] == on_disk_bytes(tmp_path)
    s.delete("k1")
    assert s.batch_exists(["k0", "k1"]) == 1 and s.get("k1") is None
    with pytest.raises(ValueError):
        s.batch_set(["a", "b"], [page(1)])


def test_present_key_not_rewritten_unless_its_file_vanished(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s.set("key1", page(1))
    written = s.stats()["bytes_written"]
    assert s.set("key1", page(1)) and s.stats()["bytes_written"] == written  # not rewritten
    os.remove(s._path("key1"))
    assert s.set("key1", page(1)) and os.path.exists(s._path("key1"))  # written again
    assert s.stats()["bytes_written"] == 2 * written and torch.equal(s.get("key1"), page(1))
    assert s.stats()["objects"] == 1 and s.stats()["bytes"] == on_disk_bytes(tmp_path)


def test_child_written_before_its_parent_waits_for_it(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    keys = chain(1, 3)
    assert s.batch_set(keys[1:], [page(1), page(2)], parents(keys[1:], keys[0])) == [True] * 2
    assert s.batch_exists(keys) == 0 and s.exists_mask(keys) == [False, True, True]
    assert s.set(keys[0], page(0))  # the parent lands: the chain is whole
    assert s.batch_exists(keys) == 3
    os.remove(s._path(keys[0]))  # and the links made while it was missing hold
    assert s.batch_get(keys) == [None] * 3 and files(tmp_path) == []
    assert s.stats()["vanished"] == 3 and s.stats()["refused"] == 0


def test_child_of_a_parent_failed_in_the_same_batch_is_refused(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    keys = chain(1, 3)
    assert s.batch_set(keys, [page(0), object(), page(2)], parents(keys)) == [True, False, False]
    assert s.batch_exists(keys) == 1 and len(files(tmp_path)) == 1
    assert s.stats()["errors"] == 1 and s.stats()["refused"] == 1


def test_chain_drop_on_missing_middle_object(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    keys = chain(1, 5)
    store_chain(s, keys)
    os.remove(s._path(keys[2]))  # behind the backend's back
    got = s.batch_get(keys)
    assert torch.equal(got[0], page(0)) and torch.equal(got[1], page(1))
    assert got[2:] == [None, None, None]
    assert s.batch_exists(keys) == 2 and s.exists_mask(keys) == [True, True] + [False] * 3
    assert files(tmp_path) == sorted(s._path(k) for k in keys[:2])  # the tail's files are gone
    st_ = s.stats()
    assert st_["objects"] == 2 and st_["vanished"] == 3 and st_["corrupt"] == 0
    assert st_["hits"] == 2 and st_["misses"] == 3 and st_["bytes"] == on_disk_bytes(tmp_path)


def test_chain_drop_on_corrupt_middle_object(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    keys = chain(2, 5)
    store_chain(s, keys)
    flip_payload_byte(s._path(keys[2]))
    assert s.reconcile() == 0  # same size: only a read can tell
    got = s.batch_get(keys)
    assert got[2:] == [None] * 3 and torch.equal(got[1], page(1))
    assert s.batch_exists(keys) == 2 and len(files(tmp_path)) == 2
    st_ = s.stats()
    assert st_["corrupt"] == 1 and st_["vanished"] == 2 and st_["objects"] == 2


def test_unreadable_object_is_forgotten_but_kept_on_disk(tmp_path, monkeypatch, caplog):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    keys = chain(22, 3)
    store_chain(s, keys)
    real = file_mod.read_object

    def flaky(key, path):
        if key == keys[1]:
            raise OSError(errno.EIO, "I/O error")
        return real(key, path)

    monkeypatch.setattr(file_mod, "read_object", flaky)
    with caplog.at_level(logging.WARNING, logger="hicache.storage.file.backend"):
        assert s.batch_get(keys)[1:] == [None, None]
        assert s.batch_get(keys)[1:] == [None, None]
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    assert s.batch_exists(keys) == 1 and len(files(tmp_path)) == 3  # maybe passing trouble
    assert s.stats()["errors"] == 1 and s.stats()["corrupt"] == 0
    monkeypatch.setattr(file_mod, "read_object", real)
    assert s.reconcile() == 0 and s.batch_exists(keys) == 3  # the files were fine: adopted
    assert torch.equal(s.get(keys[2]), page(2))


def test_truncated_and_corrupt_read_as_miss(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    s.batch_set(["aa", "bb", "cc"], [page(1), page(2), page(3)])
    path_a, path_b = s._path("aa"), s._path("bb")
    flip_payload_byte(path_a)
    with open(path_b, "r+b") as f:
        f.truncate(os.path.getsize(path_b) - 10)
    assert s.batch_get(["aa", "bb", "cc"])[:2] == [None, None]
    assert not os.path.exists(path_a) and not os.path.exists(path_b)
    st_ = s.stats()
    assert st_["misses"] == 2 and st_["corrupt"] == 2 and st_["hits"] == 1 and st_["objects"] == 1
    with open(s._path("cc"), "r+b") as f:  # a bad header is dropped at restart
        f.write(b"JUNK")
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.stats()["objects"] == 0 and s2.stats()["corrupt"] == 1 and files(tmp_path) == []


def test_branching_chain_dropped_with_its_lost_parent(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    trunk = chain(3, 2)  # a -> b
    left, right = ["left1", "left2"], ["right1"]  # b -> left1 -> left2, b -> right1
    store_chain(s, trunk)
    store_chain(s, left, first_parent=trunk[1])
    store_chain(s, right, first_parent=trunk[1])
    other = chain(4, 2)
    store_chain(s, other)
    os.remove(s._path(trunk[1]))
    assert s.batch_get(trunk)[1] is None
    assert s.exists_mask(trunk + left + right + other) == [True] + [False] * 4 + [True] * 2
    assert s.stats()["vanished"] == 4 and len(files(tmp_path)) == 3
    s.delete(other[0])  # delete cascades too
    assert s.exists_mask(other) == [False, False] and len(files(tmp_path)) == 1
    assert s.stats()["objects"] == 1 and s.stats()["bytes"] == on_disk_bytes(tmp_path)


def test_reconcile_after_the_directory_is_removed(tmp_path):
    d = tmp_path / "l3"
    s = FileStorageBackend(d, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    keys = chain(5, 4)
    store_chain(s, keys)
    shutil.rmtree(d)
    assert s.reconcile() == 4
    st_ = s.stats()
    assert st_["objects"] == 0 and st_["bytes"] == 0 and st_["vanished"] == 4
    assert s.batch_exists(keys) == 0
    store_chain(s, keys[:2])  # writes recreate the directory
    assert s.batch_exists(keys) == 2 and len(files(d)) == 2
    assert torch.equal(s.get(keys[1]), page(1)) and s.stats()["bytes"] == on_disk_bytes(d)


def test_reconcile_adopts_objects_written_by_another_process(tmp_path):
    s1 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    head = chain(6, 3)
    store_chain(s1, head[:1])
    store_chain(s2, head, base=0)  # head[0] already on disk: s2 did not know it, writes again
    tail = ["tail-of-head2"]
    store_chain(s2, tail, base=7, first_parent=head[2])
    assert s1.batch_exists(head) == 1
    assert s1.reconcile() == 0
    assert s1.batch_exists(head + tail) == 4 and torch.equal(s1.get(tail[0]), page(7))
    assert s1.stats()["objects"] == 4 and s1.stats()["bytes"] == on_disk_bytes(tmp_path)
    s2.delete(head[1])  # the other process drops a chain: this one follows on its next rescan
    assert s1.reconcile() == 3 and s1.batch_exists(head + tail) == 1
    assert s1.stats()["vanished"] == 3 and s1.stats()["bytes"] == on_disk_bytes(tmp_path)


def test_stats_agree_with_the_disk_without_reads(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=0)
    a, b = chain(7, 4), chain(8, 3)
    store_chain(s, a)
    store_chain(s, b)
    os.remove(s._path(a[1]))  # deleted: a[2], a[3] become unreachable
    with open(s._path(b[2]), "r+b") as f:  # damaged: its size no longer matches its header
        f.truncate(100)
    st_ = s.stats()
    assert st_["objects"] == len(files(tmp_path)) == 3 and st_["bytes"] == on_disk_bytes(tmp_path)
    assert st_["vanished"] == 3 and st_["corrupt"] == 1 and st_["hits"] + st_["misses"] == 0
    assert s.exists_mask(a + b) == [True, False, False, False, True, True, False]


def test_stats_rescan_is_throttled(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20, reconcile_interval_s=3600)
    keys = chain(9, 2)
    store_chain(s, keys)
    os.remove(s._path(keys[1]))
    assert s.stats()["objects"] == 2  # no rescan yet: polling stats stays cheap
    s.reconcile_interval_s = 0.05
    time.sleep(0.06)
    assert s.stats()["objects"] == 1 == len(files(tmp_path))


def test_restart_rebuilds_parent_links(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    keys = chain(10, 4)
    store_chain(s, keys)
    open(files(tmp_path)[0] + ".tmp.1.abc", "wb").close()  # a write that never finished
    old = time.time() - 2 * file_scan.TMP_MAX_AGE_S
    os.utime(files(tmp_path)[0] + ".tmp.1.abc", (old, old))
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.batch_exists(keys) == 4 and torch.equal(s2.get(keys[3]), page(3))
    assert not glob.glob(os.path.join(tmp_path, "*", "*.tmp.*"))
    os.remove(s2._path(keys[1]))
    assert s2.batch_get(keys[1:2]) == [None]  # the drop still cascades
    assert s2.batch_exists(keys) == 1 and len(files(tmp_path)) == 1
    assert s2.stats()["vanished"] == 3


def test_restart_removes_objects_whose_parent_is_gone(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    keys = chain(11, 4)
    store_chain(s, keys)
    os.remove(s._path(keys[1]))
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.batch_exists(keys) == 1 and files(tmp_path) == [s2._path(keys[0])]
    assert s2.stats()["objects"] == 1 and s2.stats()["vanished"] == 2


def test_version1_files_are_dropped_at_start(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    store_chain(s, chain(12, 2))
    for path in files(tmp_path):
        with open(path, "r+b") as f:
            f.seek(4)
            f.write(struct.pack("<H", 1))
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.stats()["objects"] == 0 and s2.stats()["corrupt"] == 2 and files(tmp_path) == []


def test_version2_files_with_crc32_are_still_read(tmp_path):
    """Objects written before the xxh3 checksums (VERSION 2, crc32) are read and verified; a
    VERSION 2 payload that does not match its crc32 is corrupt."""
    from hicache.storage.file import format as fmod

    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    keys = chain(5, 2)
    store_chain(s, keys)
    for path in files(tmp_path):  # rewrite each file's header the old way
        with open(path, "rb") as f:
            h = fmod.read_header(f)
            f.seek(h.header_len)
            payload = f.read()
        head = fmod.FIXED_V2.pack(
            fmod.MAGIC,
            2,
            len(h.shape),
            h.kind,
            len(h.key.encode()),
            fmod.NO_PARENT if h.parent is None else len(h.parent.encode()),
            h.payload_len,
            zlib.crc32(payload),
            h.dtype.encode(),
        )
        var = (
            h.key.encode() + (h.parent or "").encode() + struct.pack(f"<{len(h.shape)}Q", *h.shape)
        )
        with open(path, "wb") as f:
            f.write(head + var + payload)
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.stats()["objects"] == 2 and s2.stats()["corrupt"] == 0
    got = s2.batch_get(keys)
    want = s.batch_get(keys)
    assert all(g is not None and torch.equal(g, w) for g, w in zip(got, want))
    path = s2._path(keys[1])
    with open(path, "r+b") as f:  # one payload byte changed: crc32 catches it
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert s2.batch_get(keys)[1] is None and s2.stats()["corrupt"] == 1


def _sizes() -> tuple[int, int]:
    """File sizes of a root object and of a child object (a child stores its parent key)."""
    with tempfile.TemporaryDirectory() as d:
        probe = FileStorageBackend(d, 1 << 20)
        keys = chain(0, 2)
        store_chain(probe, keys)
        return os.path.getsize(probe._path(keys[0])), os.path.getsize(probe._path(keys[1]))


def test_capacity_lru_eviction(tmp_path):
    root, _ = _sizes()
    s = FileStorageBackend(tmp_path / "lru", capacity_bytes=3 * root)
    k1, k2, k3, k4 = (f"k{i}".ljust(64, "-") for i in range(1, 5))  # the probe's key length
    for i, k in enumerate([k1, k2, k3]):
        assert s.set(k, page(i))
    assert s.get(k1) is not None  # k1 is now most recently used
    assert s.set(k4, page(4))
    assert s.exists_mask([k1, k2, k3, k4]) == [True, False, True, True]
    st_ = s.stats()
    assert st_["evictions"] == 1 and st_["bytes"] <= 3 * root
    assert len(files(tmp_path / "lru")) == 3
    assert s.set("huge", torch.zeros(4 * root)) is False and s.stats()["errors"] == 1
    s2 = FileStorageBackend(tmp_path / "lru", capacity_bytes=root)  # restart with a smaller cap
    assert s2.stats()["objects"] == 1 and s2.stats()["evictions"] == 2


def test_lru_evicts_chain_tails_first(tmp_path):
    root, child = _sizes()
    s = FileStorageBackend(tmp_path, capacity_bytes=2 * root + 2 * child)
    keys, x = chain(13, 3), chain(14, 1)
    store_chain(s, keys)
    store_chain(s, x, base=10)
    s.batch_get(keys)  # the chain is used: x is least recent
    store_chain(s, chain(15, 1), base=20)
    assert s.exists_mask(keys + x) == [True, True, True, False]
    store_chain(s, chain(16, 1), base=30)  # room for a root: the chain's tail goes, not its head
    assert s.exists_mask(keys) == [True, True, False]
    s.batch_get(keys[1:2])  # reading a tail also refreshes its ancestors
    store_chain(s, chain(17, 1), base=40)
    assert s.exists_mask(keys[:2]) == [True, True]
    assert s.stats()["evictions"] == 3 and s.stats()["bytes"] == on_disk_bytes(tmp_path)


def test_evicting_a_chain_head_takes_its_tail(tmp_path):
    root, child = _sizes()
    s = FileStorageBackend(tmp_path, capacity_bytes=2 * root + 2 * child)
    keys, x = chain(18, 3), chain(19, 1)
    store_chain(s, keys)
    store_chain(s, x)
    # NOTE: reads and writes keep a head more recent than its tail; a head can only become
    # the LRU entry by other means (e.g. objects adopted from another process): force it.
    s._index._entries.move_to_end(keys[0], last=False)
    store_chain(s, chain(20, 1))
    assert s.exists_mask(keys + x) == [False, False, False, True]
    assert files(tmp_path) == sorted(s._path(k) for k in x + chain(20, 1))
    assert s.stats()["evictions"] == 3


def test_a_chain_longer_than_the_cap_keeps_its_head(tmp_path):
    root, child = _sizes()
    s = FileStorageBackend(tmp_path, capacity_bytes=root + 2 * child)
    keys = chain(21, 5)
    ok = s.batch_set(keys, [page(i) for i in range(5)], parents(keys))
    assert ok == [True, True, True, False, False] and s.batch_exists(keys) == 3
    assert len(files(tmp_path)) == 3 and s.stats()["evictions"] == 0
    assert s.stats()["refused"] == 2


def test_unwritable_directory_counts_errors(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_bytes(b"x")
    s = FileStorageBackend(blocker, capacity_bytes=1 << 20)  # cannot even create the directory
    assert s.batch_set(["k1", "k2"], [page(1), page(2)]) == [False, False]
    assert s.stats()["errors"] >= 2 and s.batch_exists(["k1"]) == 0 and s.get("k1") is None
    good = FileStorageBackend(tmp_path / "d", capacity_bytes=1 << 20)
    key = "zz_page"
    (tmp_path / "d" / "zz").write_bytes(b"")  # the fan-out subdir is a file: writes fail
    assert good.batch_set([key, "ok_page"], [page(1), page(2)]) == [False, True]
    assert good.stats()["errors"] == 1 and good.batch_exists(["ok_page"]) == 1


def block_writes(d, blocked: list[str], writable: tuple[str, ...] = ()):
    """Make writes under the fan-out dirs ``blocked`` fail the way the OS fails them, with the
    fan-out dirs ``writable`` already there and still writable (chmod is not recursive): as
    a user, ``d`` becomes read-only (0o555: EACCES); as root, whom chmod does not stop, each
    blocked fan-out name is a regular file (EEXIST). Returns the undo."""
    for sub in writable:
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    if os.geteuid() != 0:
        os.chmod(d, 0o555)
        assert not os.access(d, os.W_OK)
        return lambda: os.chmod(d, 0o755)
    for sub in blocked:
        with open(os.path.join(d, sub), "wb"):
            pass

    def undo() -> None:
        for sub in blocked:
            os.remove(os.path.join(d, sub))

    return undo


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.levelno >= logging.WARNING and r.name == "hicache.storage.file.backend"
    ]


def test_unwritable_directory_logs_once_and_counts_each_failed_call(tmp_path, caplog):
    d = tmp_path / "ro"
    s = FileStorageBackend(d, capacity_bytes=1 << 20, reconcile_interval_s=None)
    roots = [f"{i:02x}_root" for i in range(6)]
    undo = block_writes(d, [r[:2] for r in roots])
    try:
        with caplog.at_level(logging.WARNING, logger="hicache.storage.file.backend"):
            assert s.batch_set(roots, [page(i) for i in range(6)]) == [False] * 6
            assert s.batch_set(roots[:2], [page(0), page(1)]) == [False] * 2
        assert len(warnings_of(caplog)) == 1
        assert "cannot write" in warnings_of(caplog)[0].getMessage()
        # one error per failed call (as the redis backend counts), not one per object
        assert s.stats()["errors"] == 2 and s.stats()["objects"] == 0
        assert s.batch_exists(roots) == 0
    finally:
        undo()
    assert s.set(roots[0], page(0)) and s.stats()["objects"] == 1  # writable again


def test_writes_failing_and_succeeding_by_turns_log_one_warning(tmp_path, caplog, monkeypatch):
    """A read-only L3 directory whose older fan-out dirs are still writable: every other write
    fails. That is one outage: one warning, not one per object."""
    d = tmp_path / "kv"
    s = FileStorageBackend(d, capacity_bytes=1 << 20, reconcile_interval_s=None)
    good, bad = ["a0", "a1", "a2"], ["b0", "b1", "b2"]
    undo = block_writes(d, bad, writable=tuple(good))
    try:
        with caplog.at_level(logging.INFO, logger="hicache.storage.file.backend"):
            for i in range(12):
                keys = [f"{good[i % 3]}_k{i}", f"{bad[i % 3]}_k{i}"]
                assert s.batch_set(keys, [page(i), page(100 + i)]) == [True, False]
            assert len(warnings_of(caplog)) == 1
            assert s.stats()["errors"] == 12 and s.stats()["objects"] == 12
            # a success after a quiet spell ends the outage: the next failure is logged again
            monkeypatch.setattr(file_mod, "REARM_QUIET_S", 0.0)
            assert s.batch_set(["a0_again"], [page(50)]) == [True]
            assert any("works again" in r.getMessage() for r in caplog.records)
            assert s.batch_set(["b0_again"], [page(51)]) == [False]
            assert len(warnings_of(caplog)) == 2
    finally:
        undo()


def test_a_vanished_object_that_cannot_be_written_again_is_forgotten(tmp_path):
    """batch_set of a key whose file vanished writes it again; when that fails, the index must
    not go on listing it (a later read would miss an object it believed stored)."""
    d = tmp_path / "kv"
    s = FileStorageBackend(d, capacity_bytes=1 << 20, reconcile_interval_s=None)
    keys = ["a0_k0", "b0_k1", "c0_k2"]
    store_chain(s, keys)
    os.remove(s._path(keys[1]))  # behind the backend's back, not yet noticed
    os.rmdir(os.path.dirname(s._path(keys[1])))
    undo = block_writes(d, ["b0"], writable=("a0", "c0"))
    try:
        assert s.batch_set([keys[1]], [page(1)], [keys[0]]) == [False]
        assert s.exists_mask(keys) == [True, False, False] and s.batch_exists(keys) == 1
        st_ = s.stats()
        assert st_["objects"] == 1 and st_["vanished"] == 2 and st_["errors"] == 1
        assert s.batch_get(keys[:1])[0] is not None and s.stats()["misses"] == 0
    finally:
        undo()
    assert not os.path.exists(s._path(keys[2]))  # unreachable: removed with its parent


def test_clear(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    s.batch_set(["k1", "k2"], [page(1), page(2)])
    s.clear()
    assert s.batch_exists(["k1"]) == 0 and files(tmp_path) == []
    assert s.stats()["objects"] == 0 and s.stats()["bytes"] == 0
    assert s.set("k1", page(1)) and torch.equal(s.get("k1"), page(1))


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("write"), st.integers(0, 5), st.integers(1, 4)),  # chain tag, length
        st.tuples(st.just("branch"), st.integers(0, 5), st.integers(0, 3)),  # a child under one
        st.tuples(
            st.sampled_from(["remove", "corrupt", "truncate", "get", "delete"]),
            st.integers(0, 5),
            st.integers(0, 3),
        ),
        st.tuples(st.just("reconcile"), st.just(0), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=100, deadline=None)
@given(ops=_ops)
def test_index_matches_disk_after_random_damage(ops):
    with tempfile.TemporaryDirectory() as d:
        s = FileStorageBackend(d, capacity_bytes=12 * 700, reconcile_interval_s=3600)
        chains: dict[int, list[str]] = {}
        for op, tag, arg in ops:
            keys = chains.get(tag, [])
            if op == "write":
                chains[tag] = keys = object_keys(list(range(arg * 2)), 2, f"seed{tag}")
                s.batch_set(keys, [bytes([tag]) * 600] * len(keys), parents(keys))
            elif op == "branch" and keys:
                parent = keys[min(arg, len(keys) - 1)]
                if s.exists(parent):  # parents first (a child may also wait for its parent)
                    s.set(f"{parent[:8]}-branch{arg}", b"b" * 600, parent)
            elif keys and op in ("remove", "corrupt", "truncate", "get", "delete"):
                key = keys[min(arg, len(keys) - 1)]
                path = s._path(key)
                if op == "get":
                    got = s.batch_get(keys)
                    assert all(v is None or v == bytes([tag]) * 600 for v in got)  # never wrong
                elif op == "delete":
                    s.delete(key)
                elif os.path.exists(path):
                    if op == "remove":
                        os.remove(path)
                    elif op == "corrupt":
                        flip_payload_byte(path)
                    else:
                        with open(path, "r+b") as f:
                            f.truncate(os.path.getsize(path) // 2)
            elif op == "reconcile":
                s.reconcile()
        s.reconcile()
        assert_index_matches_disk(s, d, 12 * 700)


def assert_index_matches_disk(s: FileStorageBackend, d, capacity: int) -> None:
    """Every indexed key's file exists with its size, its parent is indexed (or None) and
    lists it as a child; the counters equal the disk."""
    index = s._index
    index.check_integrity()  # children links both ways, the bytes
    for key, entry in index.items():
        assert os.path.getsize(s._path(key)) == entry.size
        assert entry.parent is None or entry.parent in index
    st_ = s.stats()
    assert st_["objects"] == len(index) == len(files(d))
    assert st_["bytes"] == on_disk_bytes(d) <= capacity


def test_concurrent_readers_writers_and_damage(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=40 * 800, reconcile_interval_s=0)
    chains = [object_keys(list(range(16)), 2, f"seed{i}") for i in range(6)]  # 8 objects each
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                keys = rng.choice(chains)
                op = rng.random()
                if op < 0.4:
                    s.batch_set(keys, [b"v" * 600] * 8, parents(keys))
                elif op < 0.7:
                    got = s.batch_get(keys)
                    assert all(v is None or v == b"v" * 600 for v in got)
                elif op < 0.8:
                    s.delete(rng.choice(keys))
                elif op < 0.9:
                    try:
                        os.remove(s._path(rng.choice(keys)))
                    except FileNotFoundError:
                        pass
                else:
                    s.stats()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors and not any(th.is_alive() for th in threads)
    s.reconcile()
    assert_index_matches_disk(s, tmp_path, 40 * 800)
    assert s.stats()["errors"] == 0


def test_engine_on_a_half_read_only_l3_warns_once_and_counts_each_failure_once(
    tiny_llama_dir, tmp_path, caplog
):
    """Issue 12 (9): an Engine whose L3 directory is read-only except its older fan-out dirs
    (half of the objects cannot be written) logs one warning, counts each failed write call
    once in cache_stats().l3.errors, and never believes in an object it did not store."""
    from engine import Engine

    d = tmp_path / "kv"
    os.makedirs(d)
    names = [f"{i:02x}" for i in range(256)]
    undo = block_writes(d, names[128:], writable=tuple(names[:128]))
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 380) for _ in range(70)] for _ in range(12)]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    calls: list[list[bool]] = []
    try:
        with (
            caplog.at_level(logging.WARNING, logger="hicache.storage.file.backend"),
            Engine(
                tiny_llama_dir,
                enable_hierarchical_cache=True,
                max_total_tokens=512,
                page_size=16,
                hicache_storage_backend="file",
                hicache_storage_dir=str(d),
                hicache_storage_page_size=16,
                hicache_prefetch_threshold=0,
            ) as eng,
        ):
            store = eng.scheduler.tree_cache.l3.storage
            real_set = store.batch_set

            def spy(keys, values, parents=None, contents=None):
                ok = real_set(keys, values, parents, contents)
                calls.append(ok)
                return ok

            store.batch_set = spy
            outs = eng.generate(prompts, greedy)
            _settle_l3(eng)
            stats, first = eng.cache_stats(), list(calls)
            seqs = [(p + o.token_ids)[:-1] for p, o in zip(prompts, outs)]
            chains = [eng.scheduler.tree_cache.l3.storage_io.keys(q, None) for q in seqs]
            # what L3 believes it holds is what is on disk
            for keys in chains:
                assert store.exists_mask(keys) == [os.path.exists(store._path(k)) for k in keys]
            # served again from L3 alone: only objects that were written are read
            eng.call_in_scheduler(lambda s: [flush_tier(s.tree_cache, t) for t in ("l1", "l2")])
            again = eng.generate(prompts, greedy)
            _settle_l3(eng)
            after = eng.cache_stats().l3
        warnings = warnings_of(caplog)
    finally:
        undo()
    failed_calls = sum(1 for ok in first if not all(ok))
    assert failed_calls >= 2 and any(True in ok for ok in first)  # failures among successes
    assert len(warnings) == 1 and "cannot write" in warnings[0].getMessage()
    assert stats.l3.errors == failed_calls  # once per failed call, not per layer or object
    assert stats.l3.backup_failed_objects == sum(ok.count(False) for ok in first)
    # objects backed up L2 -> L3, counted on L2 in tokens (objects of 16)
    assert stats.l2.demoted_tokens == 16 * sum(ok.count(True) for ok in first) > 0
    assert [a.token_ids for a in again] == [o.token_ids for o in outs]
    assert after.hit_tokens > 0 and after.misses == 0 and after.prefetch_misses == 0


def _settle_l3(eng) -> None:
    """Every L3 backup the engine queued (deferred ones included) landed and was acked."""

    def settle(s) -> int:
        tree = s.tree_cache
        tree.host.check()
        assert tree.host.controller.wait_storage_idle(30)
        tree.host.check()
        return len(tree.l3.backup.ongoing_backup) + len(tree.l3.backup.deferred_backups)

    for _ in range(100):
        if eng.call_in_scheduler(settle) == 0:
            return
    raise AssertionError("L3 backups never settled")


def test_daemons_with_other_object_sizes_never_read_each_others_objects(tiny_llama_dir, tmp_path):
    """The L3 object size is part of the fingerprint that seeds the key chain (and names a
    shared server's scope): an Engine with 32-token objects on the directory another filled
    with 16-token objects reads none of them, and an Engine with 16-token objects reads them
    back (the same tokens either way)."""
    from engine import Engine

    rng = random.Random(11)
    prompts = [[rng.randrange(3, 380) for _ in range(70)] for _ in range(4)]
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}

    def run(object_size: int) -> tuple[list[list[int]], int, str]:
        with Engine(
            tiny_llama_dir,
            enable_hierarchical_cache=True,
            max_total_tokens=512,
            page_size=16,
            hicache_storage_backend="file",
            hicache_storage_dir=str(tmp_path / "kv"),
            hicache_storage_page_size=object_size,
            hicache_prefetch_threshold=0,
        ) as eng:
            outs = [o.token_ids for o in eng.generate(prompts, greedy)]
            _settle_l3(eng)
            fingerprint = eng.scheduler.tree_cache.l3.storage_io.fingerprint
            return outs, eng.cache_stats().l3.hit_tokens, fingerprint

    first, first_hits, first_fp = run(16)
    other, other_hits, other_fp = run(32)
    again, again_hits, again_fp = run(16)
    assert first_fp == again_fp != other_fp
    assert first_hits == 0 and other_hits == 0
    assert again_hits >= 4 * 64  # every prompt's whole 16-token objects, read back
    assert other == first == again
