"""FileStorageBackend: one file per L3 object under a directory, LRU-capped, surviving restarts,
with an index that tells the truth about the disk.

    <dir>/<2-char fan-out>/<name>.kv      name = the key when filename-safe, else blake2b(key)

File = header + payload. Header (little endian, VERSION 4):
    magic "HCKV" | version u16 | ndim u8 | kind u8 (0 tensor, 1 bytes) | key_len u32 |
    parent_len u32 (NO_PARENT: first of its chain) | payload_len u64 | xxh3-64(payload) u64 |
    dtype name 16s | namespace_len u32 (NO_NAMESPACE: the shared one) |
    token_count u32 (NO_CONTENT: not known) | key bytes | parent key bytes | shape ndim x u64 |
    namespace bytes | tokens token_count x u32
The namespace and tokens (what the object is the KV of, ``ObjectContent``) let a restarted
daemon publish the objects it finds as KV-event blocks (hicache.l3_blocks); they stay on this
machine (the redis backend keeps none). VERSION 3 files (the same without namespace_len,
token_count, namespace and tokens) and VERSION 2 files (VERSION 3 with crc32(payload) u32) are
still read, as objects whose content is not known. xxh3 as in the redis backend:
crc32 ran at ~1.5 GB/s, so checking a 2,000-token prefix's objects (92 MB of SmolLM2 KV) cost
~60 ms of CPU on a read and again on a write, and the backup's checksums took the cores of the
forwards beside it. Another version, a bad magic/length/checksum/key is *corrupt*: counted in
``corrupt``, the file removed, never wrong data. Writes go to a tmp file then ``os.replace``
(atomic).

The index (in memory, rebuilt from the headers at start) maps key -> (file size, parent,
content) in LRU order, plus parent -> children; ``watch`` reports its every change (an object
indexed, dropped, the index cleared) under the lock, so in the order they happen. An object that leaves the index takes its descendants:

    chain   k0 -> k1 -> k2 -> k3          k1 found gone (or corrupt) by a read
    index   k0                            k1..k3 dropped, k2, k3's files removed; vanished += 3

The same cascade follows ``delete``, LRU eviction and ``reconcile``. A child may be written
before its parent (the tree backs nodes up as their host copies land, in any order): it waits
in the index, linked under the parent's key, and leaves with the parent if that is lost.
NOTE: with chains written parents-first, an indexed key's parent is indexed or None. Reads and
writes touch a chain tail first and its ancestors last, so an ancestor is more recently used
than its descendants and the cap evicts tails before heads.

``reconcile()`` rescans the directory: entries whose file is gone or has the wrong size leave
(with their descendants); files the index does not know (another process sharing the directory)
are adopted once their header checks out. Files whose parent is missing are removed at start
(they can never be reached), not later (another process may still be writing their parent).
``stats()`` runs it first when the last one is older than ``reconcile_interval_s`` (None: never;
the owner rescans, e.g. StorageIO's backup thread when idle): one
``scandir`` per fan-out dir and one ``stat`` per file (~5 us each), so the counters agree with
the disk. A checksum failure is only found on read.

Errors (as the redis backend counts them): ``errors`` counts *calls* that hit trouble (a
``batch_set`` some of whose objects could not be written, a ``batch_get`` that could not read
one, a rescan that could not list the directory), one per call however many objects it
carried; the objects a ``batch_set`` did not store are its False answers. Each kind of problem
(operation, errno) logs one warning per outage: it is logged again only after an operation of
that kind succeeded with no error of that kind for ``REARM_QUIET_S`` (a read-only directory
whose older fan-out subdirs are still writable fails and succeeds by turns: one outage).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import BinaryIO, NamedTuple

import torch

from hicache.stats import StorageStats
from hicache.storage import codec
from hicache.storage.base import (
    ObjectContent,
    ObjectsRemoved,
    ObjectsStored,
    StorageBackend,
    StorageValue,
    StoreCleared,
    StoredObject,
    Watcher,
)
from hicache.storage.codec import Corrupt
from hicache.storage.outage import OutageLog

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"HCKV", 4
NO_PARENT = NO_NAMESPACE = NO_CONTENT = 0xFFFFFFFF
_FIXED = struct.Struct("<4sHBBIIQQ16sII")
_FIXED_V3 = struct.Struct("<4sHBBIIQQ16s")  # no namespace and tokens
_FIXED_V2 = struct.Struct("<4sHBBIIQI16s")  # crc32 checksums
_START = struct.Struct("<4sH")  # magic and version: what says how the rest reads
_MAX_KEY_LEN = 4096
_MAX_TOKENS = 1 << 20
_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{3,160}$")
TMP_MAX_AGE_S = 300.0  # a tmp file this old is a write that never finished
REARM_QUIET_S = 60.0  # a problem logged once is logged again after this long without it


class _Entry(NamedTuple):
    size: int  # file bytes (header + payload)
    parent: str | None
    path: str
    seq: int  # insertion order; reconcile only judges entries older than its scan
    content: ObjectContent | None  # None: not known (a file older than VERSION 4)


class _Header(NamedTuple):
    key: str
    parent: str | None
    kind: int
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    checksum: int
    version: int
    header_len: int
    content: ObjectContent | None

    def matches(self, payload: bytes | memoryview) -> bool:
        """Whether ``payload`` has the checksum the header recorded (crc32 in VERSION 2)."""
        if self.version == 2:
            return zlib.crc32(payload) == self.checksum
        return codec.checksum(payload) == self.checksum


class FileStorageBackend(StorageBackend):
    """Objects as files in ``directory``; ``capacity_bytes`` caps the files' total size (LRU)."""

    medium = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int = 64 << 30,
        reconcile_interval_s: float | None = 1.0,
    ) -> None:
        self.dir = os.fspath(directory)
        self.reconcile_interval_s = reconcile_interval_s
        self._lock = threading.Lock()  # index, children, stats; never held over payload I/O
        self._reconcile_lock = threading.Lock()  # one rescan at a time
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self._children: dict[str, set[str]] = {}
        self._removing: dict[str, int] = {}  # path -> pending removals (not to be adopted)
        self._unremovable: set[str] = set()  # files we could not remove: never adopt them
        self._problems = OutageLog()  # (operation, errno or kind) logged in this outage
        self._watcher: Watcher | None = None  # reports the index's changes (watch)
        self._seq = 0
        self._last_reconcile = 0.0
        self._refused = 0  # not stored: parent lost or failed, or the cap full of its chain
        self._stats = StorageStats(capacity_bytes=capacity_bytes)
        try:
            os.makedirs(self.dir, exist_ok=True)
        except OSError as e:
            self._error(("dir", e.errno), "file storage %s unusable: %s", self.dir, e)
            self._count_error()
        with self._reconcile_lock:
            self._reconcile(initial=True)
        logger.info(
            "file storage %s: %d objects, %d bytes",
            self.dir,
            self._stats.objects,
            self._stats.bytes,
        )

    # ---- StorageBackend ----------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
        return len(keys)

    def exists_mask(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._index for key in keys]

    def batch_get(self, keys: Sequence[str]) -> list[StorageValue | None]:
        with self._lock:
            self._touch_locked(keys)
        out: list[StorageValue | None] = []
        failed = False
        for key in keys:
            with self._lock:
                entry = self._index.get(key)  # None too when an earlier key took it along
            value, nbytes, problem = None, 0, ""
            if entry is not None:
                try:
                    value, nbytes = _read_object(key, entry.path)
                except FileNotFoundError:
                    problem = "vanished"
                except Corrupt as e:
                    problem = f"corrupt ({e})"
                except (OSError, RuntimeError, ValueError, MemoryError) as e:
                    problem, failed = "unreadable", True
                    self._error(
                        ("read", getattr(e, "errno", type(e).__name__)),
                        "file storage %s: cannot read objects: %s",
                        self.dir,
                        e,
                    )
            with self._lock:
                if value is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._stats.bytes_read += nbytes
                    self._rearm_locked("read")
            if entry is not None and problem:
                self._lose(key, entry, problem)
            out.append(value)
        if failed:
            self._count_error()
        return out

    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[StorageValue],
        parents: Sequence[str | None] | None = None,
        contents: Sequence[ObjectContent | None] | None = None,
    ) -> list[bool]:
        """A key whose parent failed earlier in the batch is refused (it could never be
        reached); one whose parent is not stored yet waits for it (see the module docstring).
        ``contents`` go into the files' headers."""
        if (
            len(values) != len(keys)
            or (parents is not None and len(parents) != len(keys))
            or (contents is not None and len(contents) != len(keys))
        ):
            raise ValueError("keys, values, parents and contents differ in length")
        parents = parents if parents is not None else [None] * len(keys)
        contents = contents if contents is not None else [None] * len(keys)
        batch = set(keys)
        with self._lock:  # the chain we extend is in use: keep eviction off it
            self._touch_locked([p for p in parents if p is not None])
        stored: set[str] = set()
        failed: set[str] = set()
        ok: list[bool] = []
        trouble: list[tuple[str, object]] = []  # problems met by this call
        for k, v, p, c in zip(keys, values, parents, contents):
            if p is not None and p in failed:
                good = False
                with self._lock:
                    self._refused += 1
            else:
                good = self._set_one(k, v, p, c, batch, p in stored, trouble)
            (stored if good else failed).add(k)
            ok.append(good)
        if trouble:
            self._count_error()
        with self._lock:
            ok = [o and k in self._index for o, k in zip(ok, keys)]  # an eviction may follow
            self._touch_locked([k for k, o in zip(keys, ok) if o])
        return ok

    def delete(self, key: str) -> None:
        with self._lock:
            paths = self._drop_tree_locked(key)
        self._remove_files(paths)

    def clear(self) -> None:
        with self._lock:
            paths = [e.path for e in self._index.values()]
            self._index.clear()
            self._children.clear()
            self._stats.objects = self._stats.bytes = 0
            self._mark_removing_locked(paths)
            if self._watcher is not None:
                self._watcher(StoreCleared())
        self._remove_files(paths)

    def watch(self, watcher: Watcher | None) -> bool:
        with self._lock:
            self._watcher = watcher
            if watcher is not None:
                watcher(
                    ObjectsStored(
                        tuple(StoredObject(k, e.parent, e.content) for k, e in self._index.items())
                    )
                )
        return True

    def stats(self) -> dict[str, int]:
        """Counters; first a ``reconcile`` when the last is older than ``reconcile_interval_s``
        (throttled: stats may be polled; concurrent callers skip a rescan in progress).
        ``errors``: calls that hit trouble, one per call (not per object; see the module
        docstring); ``refused``: objects not stored because their parent was lost or failed,
        or the cap was full of their own chain."""
        due = (
            self.reconcile_interval_s is not None
            and time.monotonic() - self._last_reconcile >= self.reconcile_interval_s
        )
        if due and self._reconcile_lock.acquire(blocking=False):
            try:
                self._reconcile()
            finally:
                self._reconcile_lock.release()
        with self._lock:
            out = self._stats.as_dict()
            out["refused"] = self._refused
            return out

    def reconcile(self) -> int:
        with self._reconcile_lock:
            return self._reconcile()

    def describe(self) -> dict[str, str]:
        return {"backend": "file", "address": self.dir}

    # ---- writes ------------------------------------------------------------------------------
    def _set_one(
        self,
        key: str,
        value: StorageValue,
        parent: str | None,
        content: ObjectContent | None,
        batch: set[str],
        parent_stored: bool,
        trouble: list[tuple[str, object]],
    ) -> bool:
        """Store one object; the problems it meets are appended to ``trouble``."""
        with self._lock:
            entry = self._index.get(key)
            had_parent = parent_stored or (parent is not None and parent in self._index)
            if entry is None and had_parent and parent not in self._index:
                self._refused += 1  # lost since this batch stored it
                return False
        if entry is None:
            return self._write_one(key, value, parent, content, batch, had_parent, trouble)
        if _size_on_disk(entry.path) == entry.size:
            if entry.content is None and content is not None:
                with self._lock:  # a file older than VERSION 4: its content is known now
                    if self._index.get(key) is entry:
                        self._insert_locked(key, entry.size, entry.parent, entry.path, content)
            return True  # content-addressed: same key, same bytes
        # its file vanished: write it again under the same links
        if self._write_one(key, value, entry.parent, content, batch, had_parent, trouble):
            return True
        # NOTE: not written again: the index must not go on listing it (nor what hangs from it)
        self._lose(key, entry, "vanished")
        return False

    def _write_one(
        self,
        key: str,
        value: StorageValue,
        parent: str | None,
        content: ObjectContent | None,
        batch: set[str],
        had_parent: bool,
        trouble: list[tuple[str, object]],
    ) -> bool:
        path = self._path(key)
        try:
            header, payload = _encode(key, value, parent, content)
        except (TypeError, RuntimeError, ValueError) as e:
            trouble.append(("encode", type(e).__name__))
            self._error(trouble[-1], "file storage: cannot encode %s: %s", type(value).__name__, e)
            return False
        size = len(header) + payload.nbytes
        if size > self._stats.capacity_bytes:
            trouble.append(("too big", None))
            self._error(
                trouble[-1],
                "file storage: an object of %d bytes exceeds the capacity of %d",
                size,
                self._stats.capacity_bytes,
            )
            return False
        with self._lock:
            paths, room = self._make_room_locked(size, batch)
            if not room:
                self._refused += 1
        self._remove_files(paths)
        if not room:
            return False  # the cap is full of this batch's own chain
        tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)  # also after the dir was removed
            with open(tmp, "wb", buffering=0) as f:
                _write_all(f, header)
                _write_all(f, payload)
            os.replace(tmp, path)
        except OSError as e:
            _remove(tmp)
            trouble.append(("write", e.errno))
            self._error(trouble[-1], "file storage %s: cannot write objects: %s", self.dir, e)
            return False
        with self._lock:
            if had_parent and parent not in self._index:  # lost while we wrote
                self._refused += 1
                self._mark_removing_locked([path])
                paths = [path]
            else:
                self._insert_locked(key, size, parent, path, content)
                self._stats.bytes_written += size
                self._rearm_locked("write")
                paths, _ = self._make_room_locked(0, batch)
        self._remove_files(paths)
        return path not in paths

    # ---- index (all *_locked methods run under self._lock) -----------------------------------
    def _insert_locked(
        self, key: str, size: int, parent: str | None, path: str, content: ObjectContent | None
    ) -> None:
        old = self._index.get(key)
        if old is not None:  # rewritten (or adopted by a rescan meanwhile): keep its links
            self._stats.bytes -= old.size
            parent = old.parent
            content = content if content is not None else old.content
        else:
            self._stats.objects += 1
            if parent is not None:
                self._children.setdefault(parent, set()).add(key)
        self._seq += 1
        self._index[key] = _Entry(size, parent, path, self._seq, content)
        self._index.move_to_end(key)
        self._stats.bytes += size
        if self._watcher is not None and (old is None or old.content != content):
            self._watcher(ObjectsStored((StoredObject(key, parent, content),)))

    def _drop_tree_locked(self, key: str) -> list[str]:
        """Drop ``key`` and its descendants; their paths, every ancestor before its
        descendants (removal goes in reverse, so no file on disk outlives its parent)."""
        entry = self._index.pop(key, None)
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
            e = self._index.pop(k := stack.pop(), None)
            if e is not None:
                dropped.append(e)
                keys.append(k)
                stack.extend(self._children.pop(k, ()))
        self._stats.objects -= len(dropped)
        self._stats.bytes -= sum(e.size for e in dropped)
        paths = [e.path for e in dropped]
        self._mark_removing_locked(paths)
        if self._watcher is not None:
            self._watcher(ObjectsRemoved(tuple(keys)))
        return paths

    def _make_room_locked(self, need: int, keep: set[str]) -> tuple[list[str], bool]:
        """Evict LRU objects (with their descendants) until ``need`` more bytes fit, never
        picking one of ``keep``; returns the paths to remove and whether it fits."""
        paths: list[str] = []
        while self._stats.bytes + need > self._stats.capacity_bytes:
            victim = next((k for k in self._index if k not in keep), None)
            if victim is None:
                return paths, False
            dropped = self._drop_tree_locked(victim)
            self._stats.evictions += len(dropped)
            paths += dropped
        return paths, True

    def _touch_locked(self, keys: Iterable[str]) -> None:
        """Mark ``keys`` and their ancestors used: the last key first, the chain's root last,
        so ancestors stay more recent than descendants (O(chain depth), dict moves only)."""
        order: list[str] = []
        seen: set[str] = set()
        for key in reversed(list(keys)):
            k: str | None = key
            while k is not None and k not in seen and (e := self._index.get(k)) is not None:
                seen.add(k)
                order.append(k)
                k = e.parent
        for k in order:
            self._index.move_to_end(k)

    def _mark_removing_locked(self, paths: list[str]) -> None:
        for p in paths:
            self._removing[p] = self._removing.get(p, 0) + 1

    def _rearm_locked(self, kind: str) -> None:
        """An operation of ``kind`` succeeded: its problems not seen for ``REARM_QUIET_S``
        are over (the next one is logged again)."""
        for _ in self._problems.ok(kind, REARM_QUIET_S):
            logger.info("file storage %s: %s works again", self.dir, kind)

    # ---- losses and I/O helpers --------------------------------------------------------------
    def _lose(self, key: str, entry: _Entry, problem: str) -> None:
        """A read found ``key`` gone, corrupt or unreadable: drop it with its descendants and
        remove their files; except when unreadable (maybe passing trouble: out of memory or file
        handles): the files stay, and a later reconcile adopts them again if they are fine."""
        with self._lock:
            if self._index.get(key) is not entry:
                return  # already dropped, or written again since we looked
            paths = self._drop_tree_locked(key)
            if problem == "vanished":
                self._stats.vanished += len(paths)
            else:
                self._stats.vanished += len(paths) - 1
                if problem.startswith("corrupt"):
                    self._stats.corrupt += 1
        if problem == "unreadable":  # logged by _error, counted by batch_get
            self._remove_files([], keep=paths)
            return
        level = logging.INFO if problem == "vanished" else logging.WARNING
        logger.log(
            level,
            "file storage: object %s %s; dropped it and %d chained after it",
            key,
            problem,
            len(paths) - 1,
        )
        self._remove_files(paths)

    def _remove_files(self, paths: list[str], keep: Sequence[str] = ()) -> None:
        """Remove ``paths`` (descendants first); ``keep``: dropped from the index, left on disk."""
        if not paths and not keep:
            return
        stuck = [p for p in reversed(paths) if not _remove(p)]
        with self._lock:
            for p in (*paths, *keep):
                n = self._removing.get(p, 0) - 1
                if n > 0:
                    self._removing[p] = n
                else:
                    self._removing.pop(p, None)
            self._unremovable.update(stuck)

    def _error(self, problem: tuple[str, object], msg: str, *args: object) -> None:
        """Meet one problem: log the first of each kind per outage (see the module docstring),
        not one line per object. Counting is the calling operation's (``_count_error``)."""
        if self._problems.met(problem):
            logger.warning(msg + " (logged once per outage; see stats errors)", *args)

    def _count_error(self) -> None:
        """One call met trouble (one error however many of its objects failed)."""
        with self._lock:
            self._stats.errors += 1

    def _path(self, key: str) -> str:
        name = (
            key if _SAFE.match(key) else hashlib.blake2b(key.encode(), digest_size=20).hexdigest()
        )
        return os.path.join(self.dir, name[:2], name + ".kv")

    # ---- reconcile ---------------------------------------------------------------------------
    def _reconcile(self, initial: bool = False) -> int:
        with self._lock:
            self._last_reconcile = time.monotonic()
            scan_seq = self._seq
        found = self._scan()
        if found is None:
            return 0
        # files we could not remove before (a read-only directory): try again, so a flushed or
        # evicted object does not stay on disk, uncounted, to be adopted at the next start
        with self._lock:
            retry = [p for p in self._unremovable if p in found]
        removed = [p for p in retry if _remove(p)]
        with self._lock:
            self._unremovable.difference_update(removed)
        for p in removed:
            found.pop(p, None)
        gone = damaged = 0
        paths: list[str] = []
        with self._lock:
            entries = list(self._index.items())
        unknown = dict(found)  # minus the files the index knows
        stale = []
        for key, entry in entries:
            st = unknown.pop(entry.path, None)
            if entry.seq <= scan_seq and (st is None or st.st_size != entry.size):
                stale.append((key, entry))
        with self._lock:
            for key, entry in stale:
                if self._index.get(key) is not entry:
                    continue  # already dropped with its parent
                tree = self._drop_tree_locked(key)
                if entry.path in found:  # damaged: wrong size
                    damaged += 1
                    self._stats.corrupt += 1
                    self._stats.vanished += len(tree) - 1
                else:
                    gone += 1
                    self._stats.vanished += len(tree)
                paths += tree
            dropped = len(paths)
            new = [
                (p, st)
                for p, st in unknown.items()
                if p not in self._removing and p not in self._unremovable
            ]
            self._unremovable.intersection_update(found)
        self._remove_files(paths)
        adopted, corrupt, orphans = self._adopt(new, initial)
        if dropped or corrupt or orphans:
            logger.info(
                "file storage %s: dropped %d objects (%d gone, %d damaged, the rest "
                "chained after them), adopted %d, removed %d corrupt and %d orphan "
                "files",
                self.dir,
                dropped,
                gone,
                damaged,
                adopted,
                corrupt,
                orphans,
            )
        return dropped

    def _scan(self) -> dict[str, os.stat_result] | None:
        """path -> stat of every object file; None when the directory cannot be read."""
        found: dict[str, os.stat_result] = {}
        now = time.time()
        try:
            subdirs = [d.path for d in os.scandir(self.dir) if d.is_dir()]
            for sub in subdirs:
                try:
                    entries = list(os.scandir(sub))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for entry in entries:
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    if entry.name.endswith(".kv"):
                        found[entry.path] = st
                    elif ".kv.tmp." in entry.name and now - st.st_mtime > TMP_MAX_AGE_S:
                        _remove(entry.path)
        except (FileNotFoundError, NotADirectoryError):
            return {}  # the directory is gone: so is every object; a write recreates it
        except OSError as e:
            self._error(("scan", e.errno), "file storage %s: cannot list: %s", self.dir, e)
            self._count_error()
            return None
        with self._lock:
            self._rearm_locked("scan")
        return found

    def _adopt(
        self, unknown: list[tuple[str, os.stat_result]], remove_orphans: bool
    ) -> tuple[int, int, int]:
        """Index the valid files among ``unknown`` whose chain reaches an indexed object or a
        root; remove corrupt ones (and orphans, if asked). Returns (adopted, corrupt, orphans
        removed)."""
        headers: dict[str, tuple[_Header, os.stat_result, str]] = {}
        bad: list[str] = []
        for path, st in unknown:
            try:
                with open(path, "rb", buffering=0) as f:
                    h = _read_header(f)
                if self._path(h.key) != path:
                    raise Corrupt("file in the wrong place")
                if h.header_len + h.payload_len != st.st_size:
                    raise Corrupt("size differs from its header")
                headers[h.key] = (h, st, path)
            except FileNotFoundError:
                continue
            except (OSError, Corrupt):
                bad.append(path)
        stuck = [p for p in bad if not _remove(p)]
        with self._lock:
            self._stats.corrupt += len(bad) - len(stuck)
            self._unremovable.update(stuck)
            pending = {
                k: v
                for k, v in headers.items()
                if k not in self._index and v[2] not in self._removing
            }
            order = self._adoptable_locked(pending)
            self._insert_adopted_locked(order, pending)
            orphans = {k: self._orphan_root(k, pending) for k in pending if k not in self._index}
            paths, _ = self._make_room_locked(0, set())
        self._remove_files(paths)
        if not remove_orphans or not orphans:
            return len(order), len(bad), 0
        # an orphan whose missing ancestor is still absent after the scan can never be reached;
        # if the ancestor appeared meanwhile (written during the scan), a later pass adopts both
        lost = {p for p in set(orphans.values()) if _size_on_disk(self._path(p)) is None}
        doomed = [pending[k][2] for k, p in orphans.items() if p in lost]
        for p in doomed:
            _remove(p)
        with self._lock:
            self._stats.vanished += len(doomed)
        return len(order), len(bad), len(doomed)

    def _adoptable_locked(
        self, pending: dict[str, tuple[_Header, os.stat_result, str]]
    ) -> list[str]:
        """Keys of ``pending`` reachable from a root or an indexed object, parents first."""
        kids: dict[str, list[str]] = {}
        order: list[str] = []
        for key, (h, _, _) in pending.items():
            if h.parent is None or h.parent in self._index:
                order.append(key)
            elif h.parent in pending:
                kids.setdefault(h.parent, []).append(key)
        for key in order:  # grows while we walk it: breadth first
            order.extend(kids.pop(key, ()))
        return order

    def _insert_adopted_locked(
        self, order: list[str], pending: dict[str, tuple[_Header, os.stat_result, str]]
    ) -> None:
        # LRU position: a key is as recent as the newest file below it (ancestors stay more
        # recent than their descendants); deeper first among equals.
        recency = {k: pending[k][1].st_mtime for k in order}
        depth: dict[str, int] = {}
        for k in order:
            p = pending[k][0].parent
            depth[k] = depth[p] + 1 if p in depth else 0
        for k in reversed(order):
            p = pending[k][0].parent
            if p in recency:
                recency[p] = max(recency[p], recency[k])
        for k in sorted(order, key=lambda k: (recency[k], -depth[k])):
            h, st, path = pending[k]
            self._insert_locked(k, st.st_size, h.parent, path, h.content)
        # adopted under an object we already held: that chain is in use again
        self._touch_locked(
            [p for k in order if (p := pending[k][0].parent) is not None and p not in pending]
        )

    @staticmethod
    def _orphan_root(key: str, pending: dict[str, tuple[_Header, os.stat_result, str]]) -> str:
        """The first missing ancestor of an orphan (walks the pending headers)."""
        seen: set[str] = set()
        parent = pending[key][0].parent
        while parent in pending and parent not in seen:
            seen.add(parent)
            parent = pending[parent][0].parent
        assert parent is not None
        return parent


# ---- file format -------------------------------------------------------------------------------
def _encode(
    key: str, value: StorageValue, parent: str | None, content: ObjectContent | None = None
) -> tuple[bytes, memoryview]:
    """Header bytes and a view of the payload (no copy of a contiguous CPU tensor)."""
    v = codec.encode(value)
    key_b = key.encode()
    parent_b = parent.encode() if parent is not None else b""
    ns = content.namespace if content is not None else None
    ns_b = ns.encode() if ns is not None else b""
    tokens = content.tokens if content is not None else b""
    if len(tokens) % 4 or len(tokens) // 4 > _MAX_TOKENS:
        raise ValueError(f"object content of {len(tokens)} token bytes")
    fixed = _FIXED.pack(
        MAGIC,
        VERSION,
        len(v.shape),
        0 if v.is_tensor else 1,
        len(key_b),
        NO_PARENT if parent is None else len(parent_b),
        v.payload.nbytes,
        codec.checksum(v.payload),
        v.dtype.encode(),
        NO_NAMESPACE if ns is None else len(ns_b),
        NO_CONTENT if content is None else len(tokens) // 4,
    )
    shape = struct.pack(f"<{len(v.shape)}Q", *v.shape)
    return fixed + key_b + parent_b + shape + ns_b + tokens, v.payload


def _read_header(f: BinaryIO) -> _Header:
    start = f.read(_START.size)
    if len(start) != _START.size:
        raise Corrupt("short header")
    magic, version = _START.unpack(start)
    if magic != MAGIC or version not in (2, 3, VERSION):
        raise Corrupt(f"magic {magic!r} version {version}, not {MAGIC!r} 2, 3 or {VERSION}")
    fixed = {VERSION: _FIXED, 3: _FIXED_V3, 2: _FIXED_V2}[version]
    raw = start + f.read(fixed.size - _START.size)
    if len(raw) != fixed.size:
        raise Corrupt("short header")
    fields = fixed.unpack(raw)
    _, _, ndim, kind, key_len, parent_len, payload_len, checksum, dtype = fields[:9]
    ns_len, n_tokens = fields[9:] if version == VERSION else (NO_NAMESPACE, NO_CONTENT)
    has_parent = parent_len != NO_PARENT
    parent_len = parent_len if has_parent else 0
    has_content, has_ns = n_tokens != NO_CONTENT, ns_len != NO_NAMESPACE
    n_tokens = n_tokens if has_content else 0
    ns_len = ns_len if has_ns else 0
    if (
        kind not in (0, 1)
        or key_len > _MAX_KEY_LEN
        or parent_len > _MAX_KEY_LEN
        or ns_len > _MAX_KEY_LEN
        or n_tokens > _MAX_TOKENS
    ):
        raise Corrupt("bad header fields")
    var = key_len + parent_len + 8 * ndim + ns_len + 4 * n_tokens
    rest = f.read(var)
    if len(rest) != var:
        raise Corrupt("short header")
    at = key_len + parent_len + 8 * ndim  # the namespace, then the tokens
    content = None
    if has_content:
        ns = rest[at : at + ns_len].decode(errors="replace") if has_ns else None
        content = ObjectContent(ns, rest[at + ns_len :])
    return _Header(
        key=rest[:key_len].decode(errors="replace"),
        parent=rest[key_len : key_len + parent_len].decode(errors="replace")
        if has_parent
        else None,
        kind=kind,
        dtype=dtype.rstrip(b"\0").decode(errors="replace"),
        shape=struct.unpack_from(f"<{ndim}Q", rest, key_len + parent_len),
        payload_len=payload_len,
        checksum=checksum,
        version=version,
        header_len=fixed.size + var,
        content=content,
    )


def _read_object(key: str, path: str) -> tuple[StorageValue, int]:
    """The value stored under ``key`` at ``path`` and its payload bytes; the payload is read
    straight into the returned tensor. Raises Corrupt / OSError."""
    with open(path, "rb", buffering=0) as f:
        h = _read_header(f)
        if h.key != key:
            raise Corrupt(f"holds key {h.key}")
        if os.fstat(f.fileno()).st_size != h.header_len + h.payload_len:
            raise Corrupt("size differs from its header")
        if h.kind == 1:
            data = f.read(h.payload_len)
            if len(data) != h.payload_len or not h.matches(data):
                raise Corrupt("checksum mismatch")
            return data, h.payload_len
        value = torch.empty(h.shape, dtype=codec.tensor_dtype(h.dtype, h.shape, h.payload_len))
        view = value.reshape(-1).view(torch.uint8).numpy().data  # read straight into it
        if _readinto_all(f, view) != h.payload_len:
            raise Corrupt("short payload")
    if not h.matches(view):
        raise Corrupt("checksum mismatch")
    return value, h.payload_len


def _readinto_all(f: BinaryIO, view: memoryview) -> int:
    n = 0
    while n < view.nbytes:
        got = f.readinto(view[n:])  # type: ignore[attr-defined]
        if not got:
            break
        n += got
    return n


def _write_all(f: BinaryIO, data: bytes | memoryview) -> None:
    view = memoryview(data)
    n = 0
    while n < view.nbytes:
        n += f.write(view[n:])


def _size_on_disk(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _remove(path: str) -> bool:
    """Remove a file; False only when it is still there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True
