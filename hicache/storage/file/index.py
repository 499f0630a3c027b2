"""ObjectIndex: the file backend's in-memory index of the objects on its disk.

It maps key -> ``IndexEntry`` (file size, parent, path, content) in LRU order, plus parent ->
children, and reports its every change (an object indexed, dropped, the index cleared) to the
watcher, in the order they happen. It does no I/O: the backend rebuilds it from the file
headers at start, calls it under its own lock and removes the files of what it drops. An
object that leaves the index takes its descendants:

    chain   k0 -> k1 -> k2 -> k3          k1 found gone (or corrupt) by a read
    index   k0                            k1..k3 dropped, k2, k3's files removed; vanished += 3

The same cascade follows ``delete``, LRU eviction and ``reconcile``. A child may be indexed
before its parent (the tree backs nodes up as their host copies land, in any order): it waits
in the index, linked under the parent's key, and leaves with the parent if that is lost.
NOTE: with chains written parents-first, an indexed key's parent is indexed or None. Reads and
writes touch a chain tail first and its ancestors last, so an ancestor is more recently used
than its descendants and the cap evicts tails before heads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable
from typing import NamedTuple

from hicache.storage.base import (
    ObjectContent,
    ObjectsRemoved,
    ObjectsStored,
    StoreCleared,
    StoredObject,
    Watcher,
)


class IndexEntry(NamedTuple):
    size: int  # file bytes (header + payload)
    parent: str | None
    path: str
    seq: int  # insertion order; reconcile only judges entries older than its scan
    content: ObjectContent | None  # None: not known (a file older than VERSION 4)


class ObjectIndex:
    """key -> IndexEntry, least recently used first, with the parent -> children links and the
    bytes of the indexed files. Not thread-safe: its owner serializes every call."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, IndexEntry] = OrderedDict()  # LRU first
        self._children: dict[str, set[str]] = {}
        self._seq = 0
        self._bytes = 0
        self._watcher: Watcher | None = None

    # ---- reads -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: str) -> IndexEntry | None:
        return self._entries.get(key)

    def items(self) -> list[tuple[str, IndexEntry]]:
        """(key, entry) of every indexed object, least recently used first (a copy)."""
        return list(self._entries.items())

    @property
    def nbytes(self) -> int:
        """The indexed files' total size."""
        return self._bytes

    @property
    def seq(self) -> int:
        """The ``seq`` of the last entry indexed (entries with a larger one are newer)."""
        return self._seq

    # ---- changes -----------------------------------------------------------------------------
    def watch(self, watcher: Watcher | None) -> None:
        """Report every change to ``watcher`` from now on, first all the index holds."""
        self._watcher = watcher
        if watcher is not None:
            watcher(
                ObjectsStored(
                    tuple(StoredObject(k, e.parent, e.content) for k, e in self._entries.items())
                )
            )

    def insert(
        self, key: str, size: int, parent: str | None, path: str, content: ObjectContent | None
    ) -> None:
        """Index ``key`` as the most recently used; a key indexed already keeps its parent
        (and its content when ``content`` is None)."""
        old = self._entries.get(key)
        if old is not None:  # rewritten (or adopted by a rescan meanwhile): keep its links
            self._bytes -= old.size
            parent = old.parent
            content = content if content is not None else old.content
        elif parent is not None:
            self._children.setdefault(parent, set()).add(key)
        self._seq += 1
        self._entries[key] = IndexEntry(size, parent, path, self._seq, content)
        self._entries.move_to_end(key)
        self._bytes += size
        if self._watcher is not None and (old is None or old.content != content):
            self._watcher(ObjectsStored((StoredObject(key, parent, content),)))

    def drop_tree(self, key: str) -> list[str]:
        """Drop ``key`` and its descendants; their paths, every ancestor before its
        descendants (removal goes in reverse, so no file on disk outlives its parent)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return []
        if entry.parent is not None:
            siblings = self._children.get(entry.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[entry.parent]
        dropped, keys = [entry], [key]
        stack = list(self._children.pop(key, ()))
        while stack:
            e = self._entries.pop(k := stack.pop(), None)
            if e is not None:
                dropped.append(e)
                keys.append(k)
                stack.extend(self._children.pop(k, ()))
        self._bytes -= sum(e.size for e in dropped)
        if self._watcher is not None:
            self._watcher(ObjectsRemoved(tuple(keys)))
        return [e.path for e in dropped]

    def evict(self, need: int, capacity: int, keep: Collection[str]) -> tuple[list[str], bool]:
        """Drop LRU objects (with their descendants) until ``need`` more bytes fit in
        ``capacity``, never picking one of ``keep``; returns the dropped paths and whether it
        fits."""
        paths: list[str] = []
        while self._bytes + need > capacity:
            victim = next((k for k in self._entries if k not in keep), None)
            if victim is None:
                return paths, False
            paths += self.drop_tree(victim)
        return paths, True

    def touch(self, keys: Iterable[str]) -> None:
        """Mark ``keys`` and their ancestors used: the last key first, the chain's root last,
        so ancestors stay more recent than descendants (O(chain depth), dict moves only)."""
        order: list[str] = []
        seen: set[str] = set()
        for key in reversed(list(keys)):
            k: str | None = key
            while k is not None and k not in seen and (e := self._entries.get(k)) is not None:
                seen.add(k)
                order.append(k)
                k = e.parent
        for k in order:
            self._entries.move_to_end(k)

    def clear(self) -> list[str]:
        """Drop every object; their paths."""
        paths = [e.path for e in self._entries.values()]
        self._entries.clear()
        self._children.clear()
        self._bytes = 0
        if self._watcher is not None:
            self._watcher(StoreCleared())
        return paths

    def check_integrity(self) -> None:
        """Assert the links agree both ways (an indexed key with a parent is that parent's
        child; a listed child is indexed under that parent) and ``nbytes`` sums the entries."""
        for key, entry in self._entries.items():
            assert entry.parent is None or key in self._children[entry.parent], key
        for parent, kids in self._children.items():
            assert kids, parent
            for kid in kids:
                child = self._entries.get(kid)
                assert child is not None and child.parent == parent, (parent, kid)
        assert self._bytes == sum(e.size for e in self._entries.values())
