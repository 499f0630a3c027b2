"""FileStorageBackend: one file per L3 object under a directory, LRU-capped, surviving restarts,
with an index that tells the truth about the disk.

The object format (one file per object: header + payload, atomic writes) is
hicache.storage.file.format's; the in-memory index (key -> file size, parent, content in LRU
order, parent -> children, dropping an object with its descendants) is
hicache.storage.file.index's, rebuilt from the file headers at start. A bad magic, version,
length, checksum or key is *corrupt*: counted in ``corrupt``, the file removed, never wrong
data. ``watch`` reports the index's every change under the lock, so in the order they happen.

``reconcile()`` rescans the directory (what it finds: hicache.storage.file.scan): entries
whose file is gone or has the wrong size leave (with their descendants); files the index does
not know (another process sharing the directory) are adopted once their header checks out.
Files whose parent is missing are removed at start (they can never be reached), not later
(another process may still be writing their parent). ``stats()`` runs it first when the last
one is older than ``reconcile_interval_s`` (None: never; the owner rescans, e.g. StorageIO's
backup thread when idle): one ``scandir`` per fan-out dir and one ``stat`` per file (~5 us
each), so the counters agree with the disk. A checksum failure is only found on read.

Errors (as the redis backend counts them): ``errors`` counts *calls* that hit trouble (a
``batch_set`` some of whose objects could not be written, a ``batch_get`` that could not read
one, a rescan that could not list the directory), one per call however many objects it
carried; the objects a ``batch_set`` did not store are its False answers. Each kind of problem
(operation, errno) logs one warning per outage: it is logged again only after an operation of
that kind succeeded with no error of that kind for ``REARM_QUIET_S`` (a read-only directory
whose older fan-out subdirs are still writable fails and succeeds by turns: one outage).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence

from hicache.observe.stats import StorageStats
from hicache.storage.base import ObjectContent, StorageBackend, StorageValue, Watcher
from hicache.storage.codec import Corrupt
from hicache.storage.file.format import (
    encode_object,
    object_path,
    read_object,
    remove_file,
    size_on_disk,
    write_object,
)
from hicache.storage.file.index import IndexEntry, ObjectIndex
from hicache.storage.file.reconcile import DirectoryReconcile
from hicache.storage.outage import OutageLog

logger = logging.getLogger(__name__)

REARM_QUIET_S = 60.0  # a problem logged once is logged again after this long without it


class FileStorageBackend(DirectoryReconcile, StorageBackend):
    """Objects as files in ``directory``; ``capacity_bytes`` caps the files' total size (LRU).
    The rescan (``_reconcile``) is hicache.storage.file.reconcile's."""

    medium = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int = 64 << 30,
        reconcile_interval_s: float | None = 1.0,
    ) -> None:
        self.dir = os.fspath(directory)
        self.reconcile_interval_s = reconcile_interval_s
        self._lock = threading.Lock()  # index, removals, stats; never held over payload I/O
        self._reconcile_lock = threading.Lock()  # one rescan at a time
        self._index = ObjectIndex()  # under self._lock
        self._removing: dict[str, int] = {}  # path -> pending removals (not to be adopted)
        self._unremovable: set[str] = set()  # files we could not remove: never adopt them
        self._problems = OutageLog()  # (operation, errno or kind) logged in this outage
        self._last_reconcile = 0.0
        self._refused = 0  # not stored: parent lost or failed, or the cap full of its chain
        self._stats = StorageStats(capacity_bytes=capacity_bytes)  # objects, bytes: the index's
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
            len(self._index),
            self._index.nbytes,
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
            self._index.touch(keys)
        out: list[StorageValue | None] = []
        failed = False
        for key in keys:
            with self._lock:
                entry = self._index.get(key)  # None too when an earlier key took it along
            value, nbytes, problem = None, 0, ""
            if entry is not None:
                try:
                    value, nbytes = read_object(key, entry.path)
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
            self._index.touch([p for p in parents if p is not None])
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
            self._index.touch([k for k, o in zip(keys, ok) if o])
        return ok

    def delete(self, key: str) -> None:
        with self._lock:
            paths = self._drop_tree_locked(key)
        self._remove_files(paths)

    def clear(self) -> None:
        with self._lock:
            paths = self._index.clear()
            self._mark_removing_locked(paths)
        self._remove_files(paths)

    def watch(self, watcher: Watcher | None) -> bool:
        with self._lock:
            self._index.watch(watcher)
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
            counts = dataclasses.replace(
                self._stats, objects=len(self._index), bytes=self._index.nbytes
            )
            out = counts.as_dict()
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
        if size_on_disk(entry.path) == entry.size:
            if entry.content is None and content is not None:
                with self._lock:  # a file older than VERSION 4: its content is known now
                    if self._index.get(key) is entry:
                        self._index.insert(key, entry.size, entry.parent, entry.path, content)
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
            header, payload = encode_object(key, value, parent, content)
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
        try:
            write_object(path, header, payload)
        except OSError as e:
            trouble.append(("write", e.errno))
            self._error(trouble[-1], "file storage %s: cannot write objects: %s", self.dir, e)
            return False
        with self._lock:
            if had_parent and parent not in self._index:  # lost while we wrote
                self._refused += 1
                self._mark_removing_locked([path])
                paths = [path]
            else:
                self._index.insert(key, size, parent, path, content)
                self._stats.bytes_written += size
                self._rearm_locked("write")
                paths, _ = self._make_room_locked(0, batch)
        self._remove_files(paths)
        return path not in paths

    # ---- index (all *_locked methods run under self._lock) -----------------------------------
    def _drop_tree_locked(self, key: str) -> list[str]:
        """Drop ``key`` and its descendants from the index; their paths, to be removed."""
        paths = self._index.drop_tree(key)
        self._mark_removing_locked(paths)
        return paths

    def _make_room_locked(self, need: int, keep: set[str]) -> tuple[list[str], bool]:
        """Evict LRU objects (with their descendants) until ``need`` more bytes fit, never
        picking one of ``keep``; returns the paths to remove and whether it fits."""
        paths, fits = self._index.evict(need, self._stats.capacity_bytes, keep)
        self._stats.evictions += len(paths)
        self._mark_removing_locked(paths)
        return paths, fits

    def _mark_removing_locked(self, paths: list[str]) -> None:
        for p in paths:
            self._removing[p] = self._removing.get(p, 0) + 1

    def _rearm_locked(self, kind: str) -> None:
        """An operation of ``kind`` succeeded: its problems not seen for ``REARM_QUIET_S``
        are over (the next one is logged again)."""
        for _ in self._problems.ok(kind, REARM_QUIET_S):
            logger.info("file storage %s: %s works again", self.dir, kind)

    # ---- losses and I/O helpers --------------------------------------------------------------
    def _lose(self, key: str, entry: IndexEntry, problem: str) -> None:
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
        stuck = [p for p in reversed(paths) if not remove_file(p)]
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
        return object_path(self.dir, key)
