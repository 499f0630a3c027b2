"""hicache.l3.index: the L3 objects a daemon knows are stored, cut into the KV events' blocks.
A real file backend reports its own changes (writes, the size cap's evictions, losses on read,
clear, and what it holds after a restart); a shared server's objects are what the tree's hooks
tell (a real Valkey). The blocks' hashes equal the L1/L2 view's for the same tokens."""

from __future__ import annotations

import os
from collections.abc import Sequence

import pytest

from hicache import RadixCache, TokenToKVPoolAllocator
from hicache.l3.index import L3BlockView, L3Index
from hicache.observe.blocks import BlockView, block_hash, namespace_salt
from hicache.storage import FileStorageBackend, object_keys, prefix_hash_seed
from hicache.storage.base import ObjectContent, StorageBackend, StorageValue
from hicache.storage.redis.backend import RedisStorageBackend
from tests import valkey_servers
from tests.unit.test_hiradix_cache import Rig

valkey_server = valkey_servers.valkey_server

B = 4  # tokens per block
KEY = b"k" * 16  # the salts' HMAC key
FP = "test-model|layout"  # the key chain's fingerprint


def _keys(
    tokens: Sequence[int], size: int, namespace: str | None = None, fp: str = FP
) -> list[str]:
    return object_keys(tokens, size, prefix_hash_seed(fp, namespace))


def _write(
    store: FileStorageBackend,
    tokens: Sequence[int],
    size: int,
    indices: Sequence[int] | None = None,
    namespace: str | None = None,
    fp: str = FP,
    content: bool = True,
) -> list[str]:
    """Objects ``indices`` (all) of the path ``tokens`` written as the backup thread does."""
    keys = _keys(tokens, size, namespace, fp)
    idx = list(range(len(keys))) if indices is None else list(indices)
    ok = store.batch_set(
        [keys[i] for i in idx],
        [bytes([i]) * 600 for i in idx],
        [keys[i - 1] if i else None for i in idx],
        [
            ObjectContent.of(namespace, tokens[i * size : (i + 1) * size]) if content else None
            for i in idx
        ],
    )
    assert all(ok)
    return keys


def _reference(tokens: Sequence[int], salt: str | None = None) -> list[int]:
    """The hashes of a sequence's full blocks, from the whole sequence."""
    out, parent = [], None
    for i in range(0, len(tokens) - len(tokens) % B, B):
        parent = block_hash(parent, salt, tuple(tokens[i : i + B]))
        out.append(parent)
    return out


def _hashes(index: L3Index | None) -> list[int]:
    blocks = L3BlockView(B, KEY).snapshot(index)
    return [b.block_hash for tier in blocks.values() for b in tier]


class _Shared(StorageBackend):
    """A shared server as the index sees one: it reports nothing (the hooks tell)."""

    def batch_exists(self, keys: Sequence[str]) -> int:
        return 0

    def batch_get(self, keys: Sequence[str]) -> list[StorageValue | None]:
        return [None] * len(keys)

    def batch_set(self, keys, values, parents=None, contents=None) -> list[bool]:
        return [False] * len(keys)

    def delete(self, key: str) -> None:
        pass

    def clear(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {}


@pytest.mark.parametrize("namespace", [None, "acme"])
def test_disk_blocks_equal_the_trees_blocks_for_the_same_tokens(tmp_path, namespace):
    """Objects of 6 tokens, blocks of 4 (a block straddles two objects): the published blocks
    are the L1 view's blocks of the same tokens, hash for hash, salt for salt."""
    tokens = list(range(100, 120))  # 3 objects (18 tokens) and a tail that is never stored
    store = FileStorageBackend(tmp_path, 1 << 20)
    _write(store, tokens, 6, namespace=namespace)
    index = L3Index(store, FP, 6)
    assert index.watched and index.medium == "disk"
    got = L3BlockView(B, KEY).snapshot(index)
    tree = RadixCache(None, TokenToKVPoolAllocator(64, 1, "cpu"), 1)
    key = tree.keys.key_of(tokens[:18], namespace)
    tree.insert(key, tree.token_to_kv_pool_allocator.alloc(len(key)))
    assert got["disk"] == BlockView(B, KEY).snapshot(tree)["l1"] and got["external"] == []
    assert [b.block_hash for b in got["disk"]] == _reference(
        tokens[:16], namespace_salt(KEY, namespace)
    )


def test_a_block_needs_every_object_from_the_root(tmp_path):
    tokens = list(range(40, 64))  # 4 objects of 6
    store = FileStorageBackend(tmp_path, 1 << 20)
    index = L3Index(store, FP, 6)
    _write(store, tokens, 6, [0, 2, 3])  # object 1 missing: 2 and 3 cannot be read
    assert _hashes(index) == _reference(tokens[:4])  # block 0 only (block 1 ends in object 1)
    _write(store, tokens, 6, [1])
    assert _hashes(index) == _reference(tokens)


def test_changes_follow_writes_evictions_losses_and_clear(tmp_path):
    """The view's changes between looks: a write stores blocks; the size cap's LRU eviction,
    a file lost behind the backend's back (found on read) and a clear remove them."""
    a, b, c = list(range(16)), list(range(200, 216)), list(range(300, 316))
    first = FileStorageBackend(tmp_path / "probe", 1 << 20)
    _write(first, a, 8)
    obj_bytes = first.stats()["bytes"] // 2
    store = FileStorageBackend(tmp_path / "kv", 4 * obj_bytes)  # room for two chains of two
    index = L3Index(store, FP, 8)
    view = L3BlockView(B, KEY)
    assert view.fresh and view.changes(index) == (
        {"disk": [], "external": []},
        {"disk": [], "external": []},
    )
    assert not view.fresh
    _write(store, a, 8)
    stored, removed = view.changes(index)
    assert [x.block_hash for x in stored["disk"]] == _reference(a) and removed["disk"] == []
    _write(store, b, 8)
    keys_c = _write(store, c, 8)  # the cap evicts a (least recently used) with its child
    stored, removed = view.changes(index)
    assert sorted(x.block_hash for x in stored["disk"]) == sorted(_reference(b) + _reference(c))
    assert sorted(removed["disk"]) == sorted(_reference(a)) and store.stats()["evictions"] == 2
    os.remove(store._path(keys_c[1]))  # gone behind the backend's back: found by a read
    assert store.batch_get(keys_c)[1] is None
    stored, removed = view.changes(index)
    assert stored["disk"] == [] and sorted(removed["disk"]) == sorted(_reference(c)[2:])
    store.clear()
    stored, removed = view.changes(index)
    assert stored["disk"] == [] and sorted(removed["disk"]) == sorted(
        _reference(b) + _reference(c)[:2]
    )
    assert view.changes(index, reset=True) == (
        {"disk": [], "external": []},
        {"disk": [], "external": []},
    )


def test_a_rescan_drops_what_vanished_and_adopts_what_another_process_wrote(tmp_path):
    mine, theirs = list(range(16)), list(range(400, 416))
    store = FileStorageBackend(tmp_path, 1 << 20, reconcile_interval_s=None)
    index = L3Index(store, FP, 8)
    keys = _write(store, mine, 8)
    other = FileStorageBackend(tmp_path, 1 << 20, reconcile_interval_s=None)  # same directory
    _write(other, theirs, 8)
    assert _hashes(index) == _reference(mine)  # not seen yet
    os.remove(store._path(keys[1]))
    store.reconcile()
    assert sorted(_hashes(index)) == sorted(_reference(mine)[:2] + _reference(theirs))


def test_restart_publishes_what_is_on_disk_and_nothing_else(tmp_path):
    """A new backend on the same directory (a restarted daemon) publishes the same blocks. Not
    published: another model's objects, objects written without their tokens (files older
    than VERSION 4), an object whose tokens are not what its key says, and what hangs below
    any of them."""
    mine, theirs = list(range(10, 26)), list(range(500, 516))
    store = FileStorageBackend(tmp_path, 1 << 20)
    _write(store, mine, 8, namespace="acme")
    _write(store, mine, 8)
    _write(store, theirs, 8, fp="another-model|layout")
    opaque = _write(store, list(range(600, 616)), 8, content=False)
    liar = _keys(list(range(700, 716)), 8)
    store.batch_set(
        liar,
        [b"x" * 600, b"y" * 600],
        [None, liar[0]],
        [
            ObjectContent.of(None, range(900, 908)),  # not the tokens of its key
            ObjectContent.of(None, range(708, 716)),
        ],
    )
    before = L3BlockView(B, KEY).snapshot(L3Index(store, FP, 8))
    assert sorted(x.block_hash for x in before["disk"]) == sorted(
        _reference(mine) + _reference(mine, namespace_salt(KEY, "acme"))
    )
    again = FileStorageBackend(tmp_path, 1 << 20)
    assert again.stats()["objects"] == 10
    index = L3Index(again, FP, 8)
    assert L3BlockView(B, KEY).snapshot(index) == before
    # mine (2 + 2), and the children of the liar and of another model's object, which verify
    # against their parent's key but wait for a parent that is never published
    assert len(index) == 6
    assert again.exists(opaque[0])  # an object without content is kept and read as before
    index.close()
    _write(again, list(range(30, 38)), 8)  # no longer followed
    assert len(index) == 6


def test_hooks_tell_what_a_shared_server_holds():
    tokens = list(range(20, 44))  # 3 objects of 8
    keys = _keys(tokens, 8)
    index = L3Index(_Shared(), FP, 8)
    assert not index.watched and index.medium == "external"
    index.found(None, tokens, keys, 2)  # an exists check found objects 0 and 1
    assert _hashes(index) == _reference(tokens[:16])
    index.stored(None, tokens, keys, [2])  # a backup acknowledged object 2
    assert _hashes(index) == _reference(tokens)
    index.read(keys[1:], landed=1, missed=False)  # stopped early: nothing learnt
    assert _hashes(index) == _reference(tokens)
    index.read(keys[1:], landed=1, missed=True)  # object 2 was not there
    assert _hashes(index) == _reference(tokens[:16])
    index.found(None, tokens, keys, 0)  # object 0 gone: everything chained after it
    assert _hashes(index) == [] and len(index) == 0
    index.stored(None, tokens, keys, [1, 2])  # known stored, but not reachable without 0
    assert _hashes(index) == [] and len(index) == 2
    index.stored(None, tokens, keys, [0])
    assert _hashes(index) == _reference(tokens)
    index.lost(keys[1])  # deleted (and 2 with it)
    assert _hashes(index) == _reference(tokens[:8])
    index.cleared()
    assert _hashes(index) == [] and len(index) == 0


def test_a_file_backend_is_not_told_what_it_reports(tmp_path):
    """With a watched backend the hooks change nothing: its own reports are exact (a hook's
    "stored" arriving after the backend evicted the object must not bring it back)."""
    tokens = list(range(8))
    index = L3Index(FileStorageBackend(tmp_path, 1 << 20), FP, 8)
    index.found(None, tokens, _keys(tokens, 8), 1)
    index.stored(None, tokens, _keys(tokens, 8), [0])
    assert _hashes(index) == [] and len(index) == 0


def test_changes_nobody_takes_stay_bounded(tmp_path):
    index = L3Index(_Shared(), FP, 8)
    view = L3BlockView(B, KEY)
    tokens = list(range(50, 58))
    keys = _keys(tokens, 8)
    index.found(None, tokens, keys, 1)
    assert [x.block_hash for x in view.changes(index)[0]["external"]] == _reference(tokens)
    for n in range(6000):  # churn between two looks: each path stored, then lost
        path = [n] * 16
        k = _keys(path, 8)
        index.found(None, path, k, 2)
        index.lost(k[0])
    assert len(index._dirty) <= 4 * len(index) + 10_000
    index.lost(keys[0])
    stored, removed = view.changes(index)
    assert stored["external"] == [] and removed["external"] == _reference(tokens)


def test_another_index_replaces_the_blocks_of_the_last(tmp_path):
    """L3 detached and another attached: the old index's blocks go, the new one's come."""
    a, b = list(range(8)), list(range(8, 16))
    disk = FileStorageBackend(tmp_path, 1 << 20)
    _write(disk, a, 8)
    shared = L3Index(_Shared(), FP, 8)
    shared.found(None, b, _keys(b, 8), 1)
    view = L3BlockView(B, KEY)
    first, _ = view.changes(L3Index(disk, FP, 8))
    assert [x.block_hash for x in first["disk"]] == _reference(a)
    stored, removed = view.changes(shared)
    assert removed == {"disk": _reference(a), "external": []}
    assert [x.block_hash for x in stored["external"]] == _reference(b)
    stored, removed = view.changes(None)
    assert stored == {"disk": [], "external": []} and removed["external"] == _reference(b)


# ---- the tree's hooks ---------------------------------------------------------------------------
def _tree_blocks(rig: Rig, tier: str) -> list[int]:
    return [b.block_hash for b in L3BlockView(B, KEY).snapshot(rig.tree.l3.l3_index)[tier]]


def test_tree_backups_publish_disk_blocks_and_a_flush_removes_them(tmp_path):
    rig = Rig(page_size=1, device_size=64, host_size=128, storage_dir=str(tmp_path), object_size=8)
    try:
        tokens = list(range(30, 50))  # 2 objects and a tail
        rig.insert(tokens)
        rig.settle()
        assert _tree_blocks(rig, "disk") == _reference(tokens[:16])
        l1 = BlockView(B, KEY).snapshot(rig.tree)["l1"]
        assert set(_tree_blocks(rig, "disk")) <= {b.block_hash for b in l1}
        rig.tree.l3.clear_storage()
        assert _tree_blocks(rig, "disk") == []
        assert rig.tree.l3.detach_storage() is not None and rig.tree.l3.l3_index is None
    finally:
        rig.close()


def test_tree_hooks_follow_a_shared_valkey(valkey_server):
    """Backups acknowledged, an exists check, a delete: what the daemon learns of a Redis /
    Valkey L3 (objects another daemon wrote are published once a check finds them)."""

    def rig() -> Rig:
        return Rig(
            page_size=1,
            device_size=64,
            host_size=128,
            object_size=8,
            # not about outages: a server a busy machine stalls past the 1 s / 2 s defaults
            # must not read as one (see test_storage_redis.PATIENT_TIMEOUT_S)
            storage=RedisStorageBackend(
                valkey_server.url, "l3blocks", socket_timeout_s=60.0, connect_timeout_s=60.0
            ),
        )

    a, b = rig(), rig()
    try:
        tokens = list(range(60, 84))  # 3 objects
        a.insert(tokens)
        a.settle()
        assert a.tree.l3.l3_index is not None and not a.tree.l3.l3_index.watched
        assert _tree_blocks(a, "external") == _reference(tokens)
        assert _tree_blocks(b, "external") == []  # b never heard of them
        assert b.tree.l3.storage_prefix_len(tokens) == 24  # an exists check (MatchPrefix)
        assert _tree_blocks(b, "external") == _reference(tokens)
        node = a.tree.match_prefix(tokens).last_device_node
        assert a.tree.l3.delete_from_storage([node]) > 0  # the objects ending in the node
        assert _tree_blocks(a, "external") == []
        assert b.tree.l3.storage_prefix_len(tokens) == 0  # b learns they are gone
        assert _tree_blocks(b, "external") == []
    finally:
        a.close()
        b.close()
