"""FileStorageBackend and page key hashing."""

from __future__ import annotations

import glob
import os

import torch

from hicache.storage import FileStorageBackend, page_hashes, prefix_hash_seed


def page(seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, 4, 2, 8, generator=g).to(dtype)  # [2, L, page, H, D]


def files(d) -> list[str]:
    return sorted(glob.glob(os.path.join(d, "*", "*.kv")))


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


def test_roundtrip_and_leading_exists(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    vals = [page(i) for i in range(3)] + [page(9, torch.bfloat16)]
    assert s.batch_set(["k0", "k1", "k2", "k3"], vals) == [True] * 4
    got = s.batch_get(["k0", "k1", "nope", "k3"])
    assert torch.equal(got[0], vals[0]) and torch.equal(got[1], vals[1]) and got[2] is None
    assert got[3].dtype == torch.bfloat16 and torch.equal(got[3], vals[3])
    assert s.batch_exists(["k0", "k1", "nope", "k2"]) == 2
    assert s.batch_exists(["k0", "k1", "k2"]) == 3 and s.batch_exists(["x", "k0"]) == 0
    assert s.set("raw/key with spaces", b"hello") and s.get("raw/key with spaces") == b"hello"
    st = s.stats()
    assert st["objects"] == 5 and st["hits"] == 4 and st["misses"] == 1
    assert st["bytes"] == sum(os.path.getsize(f) for f in files(tmp_path))
    s.delete("k1")
    assert s.batch_exists(["k0", "k1"]) == 1 and s.get("k1") is None


def test_restart_rebuilds_index(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    s.batch_set(["a1", "b2"], [page(1), page(2)])
    open(os.path.join(files(tmp_path)[0] + ".tmp.1.abc"), "wb").close()  # a dead write
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.batch_exists(["a1", "b2"]) == 2
    assert torch.equal(s2.get("b2"), page(2))
    assert s2.stats()["objects"] == 2 and not glob.glob(os.path.join(tmp_path, "*", "*.tmp.*"))


def test_corrupt_and_truncated_read_as_miss(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    s.batch_set(["aa", "bb", "cc"], [page(1), page(2), page(3)])
    path_a, path_b = s._path("aa"), s._path("bb")
    with open(path_a, "r+b") as f:  # flip one payload byte
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(path_b, "r+b") as f:
        f.truncate(os.path.getsize(path_b) - 10)
    assert s.batch_get(["aa", "bb", "cc"])[:2] == [None, None]
    assert not os.path.exists(path_a) and not os.path.exists(path_b)
    st = s.stats()
    assert st["misses"] == 2 and st["corrupt"] == 2 and st["hits"] == 1 and st["objects"] == 1
    with open(s._path("cc"), "r+b") as f:  # a bad header is dropped at restart
        f.write(b"JUNK")
    s2 = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    assert s2.stats()["objects"] == 0 and s2.stats()["corrupt"] == 1 and files(tmp_path) == []


def test_capacity_lru_eviction(tmp_path):
    one = FileStorageBackend(tmp_path / "probe", 1 << 20)
    one.set("k0", page(0))  # same key length as below: same file size
    size = one.stats()["bytes"]
    s = FileStorageBackend(tmp_path / "lru", capacity_bytes=3 * size)
    assert s.batch_set(["k1", "k2", "k3"], [page(1), page(2), page(3)]) == [True] * 3
    assert s.get("k1") is not None  # k1 is now most recently used
    assert s.set("k4", page(4))
    assert s.batch_exists(["k1"]) == 1 and s.batch_exists(["k2"]) == 0
    assert s.batch_exists(["k3", "k4"]) == 2
    st = s.stats()
    assert st["evictions"] == 1 and st["bytes"] <= 3 * size and len(files(tmp_path / "lru")) == 3
    assert s.set("huge", torch.zeros(4 * size)) is False and s.stats()["errors"] == 1
    s2 = FileStorageBackend(tmp_path / "lru", capacity_bytes=size)  # restart with a smaller cap
    assert s2.stats()["objects"] == 1 and s2.stats()["evictions"] == 2


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


def test_clear(tmp_path):
    s = FileStorageBackend(tmp_path, capacity_bytes=1 << 20)
    s.batch_set(["k1", "k2"], [page(1), page(2)])
    s.clear()
    assert s.batch_exists(["k1"]) == 0 and files(tmp_path) == []
    assert s.stats()["objects"] == 0 and s.stats()["bytes"] == 0
    assert s.set("k1", page(1)) and torch.equal(s.get("k1"), page(1))
