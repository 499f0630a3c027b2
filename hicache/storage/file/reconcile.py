"""DirectoryReconcile: the file backend's rescan (``FileStorageBackend.reconcile``), which makes
its index agree with the directory: entries whose file is gone or has the wrong size leave (with
their descendants); files the index does not know (another process sharing the directory) are
adopted once their header checks out, in LRU order; corrupt files are removed, and at start the
orphans (a missing parent they can never reach). What a scan finds is
hicache.storage.file.scan's; this part decides, under the backend's lock, what to adopt, drop or
remove. A base of FileStorageBackend (hicache.storage.file.backend), over its index and lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hicache.storage.file.format import remove_file, size_on_disk
from hicache.storage.file.scan import lru_order, orphan_root, reachable, read_found, scan_directory

if TYPE_CHECKING:
    from hicache.observe.stats import StorageStats
    from hicache.storage.file.index import ObjectIndex

logger = logging.getLogger("hicache.storage.file.backend")  # NOTE: the backend's messages


class DirectoryReconcile:
    """The rescan of FileStorageBackend's directory; the backend provides what is declared."""

    if TYPE_CHECKING:
        dir: str
        _lock: threading.Lock
        _index: ObjectIndex
        _removing: dict[str, int]
        _unremovable: set[str]
        _stats: StorageStats
        _last_reconcile: float

        def _drop_tree_locked(self, key: str) -> list[str]: ...
        def _make_room_locked(self, need: int, keep: set[str]) -> tuple[list[str], bool]: ...
        def _rearm_locked(self, kind: str) -> None: ...
        def _remove_files(self, paths: list[str], keep: Sequence[str] = ()) -> None: ...
        def _error(self, problem: tuple[str, object], msg: str, *args: object) -> None: ...
        def _count_error(self) -> None: ...
        def _path(self, key: str) -> str: ...

    def _reconcile(self, initial: bool = False) -> int:
        with self._lock:
            self._last_reconcile = time.monotonic()
            scan_seq = self._index.seq
        found = self._scan()
        if found is None:
            return 0
        # files we could not remove before (a read-only directory): try again, so a flushed or
        # evicted object does not stay on disk, uncounted, to be adopted at the next start
        with self._lock:
            retry = [p for p in self._unremovable if p in found]
        removed = [p for p in retry if remove_file(p)]
        with self._lock:
            self._unremovable.difference_update(removed)
        for p in removed:
            found.pop(p, None)
        gone = damaged = 0
        paths: list[str] = []
        with self._lock:
            entries = self._index.items()
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
        try:
            found = scan_directory(self.dir)
        except OSError as e:
            self._error(("scan", e.errno), "file storage %s: cannot list: %s", self.dir, e)
            self._count_error()
            return None
        if found is None:
            return {}  # the directory is gone: so is every object; a write recreates it
        with self._lock:
            self._rearm_locked("scan")
        return found

    def _adopt(
        self, unknown: list[tuple[str, os.stat_result]], remove_orphans: bool
    ) -> tuple[int, int, int]:
        """Index the valid files among ``unknown`` whose chain reaches an indexed object or a
        root; remove corrupt ones (and orphans, if asked). Returns (adopted, corrupt, orphans
        removed)."""
        headers, bad = read_found(self.dir, unknown)
        stuck = [p for p in bad if not remove_file(p)]
        with self._lock:
            self._stats.corrupt += len(bad) - len(stuck)
            self._unremovable.update(stuck)
            pending = {
                k: v
                for k, v in headers.items()
                if k not in self._index and v.path not in self._removing
            }
            order = reachable(pending, self._index)
            for k in lru_order(order, pending):
                h, st, path = pending[k]
                self._index.insert(k, st.st_size, h.parent, path, h.content)
            # adopted under an object we already held: that chain is in use again
            self._index.touch(
                [
                    p
                    for k in order
                    if (p := pending[k].header.parent) is not None and p not in pending
                ]
            )
            orphans = {k: orphan_root(k, pending) for k in pending if k not in self._index}
            paths, _ = self._make_room_locked(0, set())
        self._remove_files(paths)
        if not remove_orphans or not orphans:
            return len(order), len(bad), 0
        # an orphan whose missing ancestor is still absent after the scan can never be reached;
        # if the ancestor appeared meanwhile (written during the scan), a later pass adopts both
        lost = {p for p in set(orphans.values()) if size_on_disk(self._path(p)) is None}
        doomed = [pending[k].path for k, p in orphans.items() if p in lost]
        for p in doomed:
            remove_file(p)
        with self._lock:
            self._stats.vanished += len(doomed)
        return len(order), len(bad), len(doomed)
