"""The L3 objects a daemon knows are stored, and the KV-event blocks they hold.

L3 objects outlive the tree's nodes (a file L3 keeps them across restarts, a shared server holds
other daemons' too), so the tree cannot say which blocks L3 holds. ``L3Index`` keeps what the
daemon knows, by where the objects live (``StorageBackend.medium``):

    disk      the file backend reports every change of its own index (``watch``): objects
              written, evicted by its size cap, lost on a read or a rescan, deleted, cleared,
              and first all it holds at start (their tokens are in the files): exact
    external  a server others write to and evict from: what this daemon learns itself, through
              the tree's hooks (hicache.l3.tier, l3_prefetch): its backups acknowledged, an exists
              check finding a prefix's objects (``found``); dropped when a check or a read
              misses one (``found``, ``read``) or when it deletes (``lost``) or clears them

An object is ``object_size`` tokens of a path from the root; its key chains on its parent's
(hicache.storage.base). ``L3BlockView`` cuts the objects into the KV events' blocks: a block is
in L3 when every object from the root to the one it ends in is (a prefix is read from L3 from
its first object on):

    objects   [ o0 (0-48)          ][ o1 (48-96)          ]      block_size 32
    blocks    [ b0 (0-32) ][ b1 (32-64) ][ b2 (64-96) ]         b1 ends in o1: in L3 iff o0, o1
    hashes    hicache.observe.blocks' function and namespace salts: a block in L1 and in L3 has one

What a watched backend reports is checked against this model's key chain (a key is the hash of
the parent's key, or of this model's seed for the namespace, and the tokens): another model's
objects in the same directory, and files without tokens (format version < 4), are never
published.

NOTE: thread-safe. A watched backend reports from its I/O threads, under its own lock (so this
index takes its lock inside the backend's, never the other way round); the hooks and the view
run on the scheduler thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

from hicache.observe.blocks import L3_TIERS, ROOT, Block, Chain, chain_blocks, namespace_salt
from hicache.storage.base import (
    ObjectContent,
    ObjectsRemoved,
    ObjectsStored,
    StorageBackend,
    StoreChange,
    StoreCleared,
    StoredObject,
    object_key,
    prefix_hash_seed,
)

DIRTY_SLACK = 10_000  # changes kept for the view beyond 4x the objects; more: it rereads all


class L3Object(NamedTuple):
    parent: str | None
    content: ObjectContent


class L3Changes(NamedTuple):
    """Published objects since the last ``take``: added (parents before children) and removed
    keys; ``full``: ``added`` is every published object (the first take, or after overflow)."""

    added: list[tuple[str, L3Object]]
    removed: list[str]
    full: bool


class L3Index:
    """The L3 objects this daemon knows are stored; those whose whole chain from the root is
    known are *published* (see the module docstring)."""

    def __init__(self, storage: StorageBackend, fingerprint: str, object_size: int) -> None:
        if storage.medium not in L3_TIERS:
            raise ValueError(f"L3 medium {storage.medium!r}: expected one of {L3_TIERS}")
        self.medium = storage.medium
        self.object_size = object_size
        self._fingerprint = fingerprint  # the key chain's (StorageIO.fingerprint)
        self._seeds: dict[str | None, str] = {}
        self._lock = threading.Lock()
        self._objects: dict[str, L3Object] = {}
        self._children: dict[str, set[str]] = {}  # parent key -> keys (parent known or not)
        self._public: set[str] = set()  # published objects (their chain is whole)
        self._dirty: set[str] = set()  # keys published or unpublished since the last take
        self._full = True  # the next take gives everything
        self._storage: StorageBackend | None = storage
        self.watched = storage.watch(self._report)

    def close(self) -> None:
        """Stop following the backend (it is detached)."""
        if self._storage is not None and self.watched:
            self._storage.watch(None)
        self._storage = None

    # ---- the tree's hooks (scheduler thread; no-ops when the backend reports itself) ---------
    def found(
        self, namespace: str | None, token_ids: Sequence[int], keys: Sequence[str], hit: int
    ) -> None:
        """An exists check of ``keys`` (the object keys of ``token_ids``, a path from the
        root) found the first ``hit``: they are stored; ``keys[hit]`` is not, nor what is
        chained after it."""
        if self.watched:
            return
        with self._lock:
            self._add_path(namespace, token_ids, keys, range(hit))
            if hit < len(keys):
                self._remove(keys[hit])
            self._bound()

    def stored(
        self,
        namespace: str | None,
        token_ids: Sequence[int],
        keys: Sequence[str],
        indices: Sequence[int],
    ) -> None:
        """Objects ``indices`` of the path ``token_ids`` (object keys ``keys``) are stored
        (a backup acknowledged them)."""
        if self.watched:
            return
        with self._lock:
            self._add_path(namespace, token_ids, keys, indices)
            self._bound()

    def read(self, keys: Sequence[str], landed: int, missed: bool) -> None:
        """A read of ``keys`` (consecutive objects of a chain) landed the first ``landed``;
        ``missed``: ``keys[landed]`` was not there (nor, then, what is chained after it)."""
        if self.watched or not missed or landed >= len(keys):
            return
        with self._lock:
            self._remove(keys[landed])
            self._bound()

    def lost(self, key: str) -> None:
        """``key`` and what is chained after it are gone (deleted)."""
        if self.watched:
            return
        with self._lock:
            self._remove(key)
            self._bound()

    def cleared(self) -> None:
        if self.watched:
            return
        with self._lock:
            self._clear()

    # ---- reading (scheduler thread) ----------------------------------------------------------
    def published(self) -> list[tuple[str, L3Object]]:
        """Every published object, parents before children (changes nothing)."""
        with self._lock:
            return self._published_locked()

    def take(self, full: bool = False) -> L3Changes:
        """What was published and unpublished since the last take (``full``: everything).
        NOTE: one taker (the KV events' view): a take consumes the changes."""
        with self._lock:
            if full or self._full:
                self._full = False
                self._dirty.clear()
                return L3Changes(self._published_locked(), [], True)
            dirty, self._dirty = self._dirty, set()
            now = self._in_order(dirty & self._public)
            return L3Changes(
                [(k, self._objects[k]) for k in now], list(dirty - self._public), False
            )

    def __len__(self) -> int:
        """Objects known (published or waiting for their parent)."""
        with self._lock:
            return len(self._objects)

    # ---- the watched backend's reports (its threads, under its lock) --------------------------
    def _report(self, change: StoreChange) -> None:
        with self._lock:
            match change:
                case ObjectsStored(objects):
                    for o in objects:
                        if self._verified(o):
                            assert o.content is not None
                            self._add(o.key, o.parent, o.content)
                case ObjectsRemoved(keys):
                    for k in keys:
                        self._remove(k)
                case StoreCleared():
                    self._clear()
            self._bound()

    def _verified(self, o: StoredObject) -> bool:
        """Is ``o`` an object of this model's key chain, with the tokens its key says?"""
        c = o.content
        if c is None or len(c.tokens) != 4 * self.object_size:
            return False
        seed = self._seed(c.namespace) if o.parent is None else ""
        return object_key(o.parent, seed, c.tokens) == o.key

    # ---- state (under the lock) -------------------------------------------------------------
    def _seed(self, namespace: str | None) -> str:
        seed = self._seeds.get(namespace)
        if seed is None:
            seed = self._seeds[namespace] = prefix_hash_seed(self._fingerprint, namespace)
        return seed

    def _add_path(
        self,
        namespace: str | None,
        token_ids: Sequence[int],
        keys: Sequence[str],
        indices: Sequence[int],
    ) -> None:
        S = self.object_size
        for i in indices:
            if keys[i] not in self._objects:
                self._add(
                    keys[i],
                    keys[i - 1] if i else None,
                    ObjectContent.of(namespace, token_ids[i * S : (i + 1) * S]),
                )

    def _add(self, key: str, parent: str | None, content: ObjectContent) -> None:
        if key in self._objects:
            return
        self._objects[key] = L3Object(parent, content)
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)
        if parent is None or parent in self._public:
            self._publish(key)

    def _publish(self, key: str) -> None:
        """``key``'s chain is whole now: publish it and its known descendants."""
        stack = [key]
        while stack:
            k = stack.pop()
            self._public.add(k)
            self._dirty.add(k)
            stack += [c for c in self._children.get(k, ()) if c in self._objects]

    def _remove(self, key: str) -> None:
        """Forget ``key`` and every object chained after it (known or waiting)."""
        gone = self._objects.pop(key, None)
        if gone is not None and gone.parent is not None:
            siblings = self._children.get(gone.parent)
            if siblings is not None:
                siblings.discard(key)
                if not siblings:
                    del self._children[gone.parent]
        stack = [key]
        while stack:
            k = stack.pop()
            self._objects.pop(k, None)
            if k in self._public:
                self._public.discard(k)
                self._dirty.add(k)
            stack += self._children.pop(k, ())

    def _clear(self) -> None:
        self._dirty.update(self._public)
        self._objects.clear()
        self._children.clear()
        self._public.clear()

    def _bound(self) -> None:
        """Changes nobody takes (no subscriber yet) must not grow without bound."""
        if len(self._dirty) > 4 * len(self._objects) + DIRTY_SLACK:
            self._dirty.clear()
            self._full = True

    def _published_locked(self) -> list[tuple[str, L3Object]]:
        return [(k, self._objects[k]) for k in self._in_order(self._public)]

    def _in_order(self, keys: set[str]) -> list[str]:
        """Published ``keys``, each parent before its children, a chain's objects in a row
        (depth first): its blocks make one Stored event."""
        out: list[str] = []
        stack = [k for k in keys if self._objects[k].parent not in keys]
        while stack:
            k = stack.pop()
            out.append(k)
            stack += [c for c in self._children.get(k, ()) if c in keys]
        return out


class _Cut(NamedTuple):
    """An object as blocks: the chain after it (its children start there), its namespace's
    salt, the hashes of the blocks that end in it."""

    chain: Chain
    salt: str | None
    hashes: tuple[int, ...]


class L3BlockView:
    """An L3Index's published objects as KV-event blocks of ``block_size`` tokens, in the tier
    named by the index's medium; each object is cut once (its blocks never change: its key
    names its whole path)."""

    def __init__(self, block_size: int, salt_key: bytes) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.salt_key = salt_key
        self._salts: dict[str | None, str | None] = {}
        self._index: L3Index | None = None  # the index changes() follows
        self._cuts: dict[str, _Cut] = {}  # the objects changes() published
        self._looked = False

    @property
    def fresh(self) -> bool:
        """Has changes() not been called yet (its first call gives the whole state)?"""
        return not self._looked

    def changes(
        self, index: L3Index | None, reset: bool = False
    ) -> tuple[dict[str, list[Block]], dict[str, list[int]]]:
        """(tier -> blocks stored, tier -> block hashes removed) since the last call; ``reset``:
        the stored blocks are the whole state (and nothing is removed). An index other than
        the last one (L3 attached or detached) removes the old one's blocks."""
        stored: dict[str, list[Block]] = {t: [] for t in L3_TIERS}
        removed: dict[str, list[int]] = {t: [] for t in L3_TIERS}
        self._looked = True
        if index is not self._index:
            if self._index is not None and not reset:
                removed[self._index.medium] = [h for c in self._cuts.values() for h in c.hashes]
            self._index, self._cuts = index, {}
            reset = True
        if index is None:
            return stored, removed
        if reset:
            self._cuts = {}
        ch = index.take(full=reset)
        tier = index.medium
        if ch.full:  # (also after the index dropped changes nobody took): diffed here
            now = {k for k, _ in ch.added}
            gone = [k for k in self._cuts if k not in now]
        else:
            gone = [k for k in ch.removed if k in self._cuts]
        for k in gone:
            removed[tier] += self._cuts.pop(k).hashes
        for key, obj in ch.added:
            if key not in self._cuts:
                stored[tier] += self._cut(self._cuts, key, obj)
        return stored, removed

    def snapshot(self, index: L3Index | None) -> dict[str, list[Block]]:
        """tier -> the published objects' blocks, parents before children (reads the index
        without taking its changes)."""
        out: dict[str, list[Block]] = {t: [] for t in L3_TIERS}
        if index is None:
            return out
        cuts: dict[str, _Cut] = {}
        for key, obj in index.published():
            out[index.medium] += self._cut(cuts, key, obj)
        return out

    def _cut(self, cuts: dict[str, _Cut], key: str, obj: L3Object) -> list[Block]:
        """``obj``'s blocks; records its cut in ``cuts``, where its parent's is."""
        if obj.parent is None:
            chain, salt = ROOT, self._salt(obj.content.namespace)
        else:
            # NOTE: present: parents are published (and cut) before their children
            up = cuts[obj.parent]
            chain, salt = up.chain, up.salt
        blocks, out = chain_blocks(chain, salt, obj.content.token_ids(), self.block_size)
        cuts[key] = _Cut(out, salt, tuple(b.block_hash for b in blocks))
        return blocks

    def _salt(self, namespace: str | None) -> str | None:
        if namespace not in self._salts:
            self._salts[namespace] = namespace_salt(self.salt_key, namespace)
        return self._salts[namespace]
