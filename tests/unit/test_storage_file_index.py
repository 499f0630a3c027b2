"""ObjectIndex (hicache/storage/file/index.py): after random operation sequences its links
agree, it evicts least recently used chains tails first, and its watcher's view equals it."""

from __future__ import annotations

import random

import pytest

from hicache.storage.base import ObjectsRemoved, ObjectsStored, StoreChange, StoreCleared
from hicache.storage.file.index import ObjectIndex


class Mirror:
    """The keys a watcher believes indexed."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def __call__(self, change: StoreChange) -> None:
        if isinstance(change, ObjectsStored):
            self.keys.update(o.key for o in change.objects)
        elif isinstance(change, ObjectsRemoved):
            assert set(change.keys) <= self.keys
            self.keys.difference_update(change.keys)
        else:
            assert isinstance(change, StoreCleared)
            self.keys.clear()


def test_drop_takes_descendants_and_children_may_come_first():
    index = ObjectIndex()
    index.insert("c", 3, "b", "/c", None)  # written before its parent: waits under "b"
    index.insert("a", 1, None, "/a", None)
    index.insert("b", 2, "a", "/b", None)
    index.insert("x", 5, None, "/x", None)
    index.check_integrity()
    assert index.drop_tree("a") == ["/a", "/b", "/c"]  # ancestors first
    assert "c" not in index and len(index) == 1 and index.nbytes == 5
    index.check_integrity()


def test_evict_takes_lru_chain_and_spares_keep():
    index = ObjectIndex()
    for key, parent in [("a", None), ("b", "a"), ("x", None)]:
        index.insert(key, 10, parent, "/" + key, None)
    index.touch(["b"])  # b, then its ancestor a more recent still: x, b, a
    assert index.evict(10, 30, keep={"x"}) == (["/b"], True)  # the tail before its head
    assert index.evict(10, 15, keep={"x"}) == (["/a"], False)  # only x is left
    assert [k for k, _ in index.items()] == ["x"]
    index.check_integrity()


@pytest.mark.parametrize("seed", range(20))
def test_random_operations_keep_the_links(seed):
    rng = random.Random(seed)
    index, mirror = ObjectIndex(), Mirror()
    index.watch(mirror)
    keys = [f"k{i}" for i in range(24)]
    for _ in range(400):
        op, key = rng.random(), rng.choice(keys)
        if op < 0.5:
            parent = rng.choice([None, *keys[: keys.index(key)]])  # no cycles
            index.insert(key, rng.randint(1, 9), parent, "/" + key, None)
        elif op < 0.7:
            paths = index.drop_tree(key)
            assert all(p[1:] not in index for p in paths)
        elif op < 0.85:
            index.touch(rng.sample(keys, 3))
        elif op < 0.98:
            need = rng.randint(0, 20)
            _, fits = index.evict(need, 60, keep={key})
            assert index.nbytes + need <= 60 if fits else {k for k, _ in index.items()} <= {key}
        else:
            index.clear()
        index.check_integrity()
        assert mirror.keys == {k for k, _ in index.items()}
