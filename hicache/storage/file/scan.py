"""What a rescan of the file backend's directory finds: the object files there, the ones the
index does not know read from their headers, and which of those can be adopted, in what order.

These functions read the disk but change no index: the backend (hicache.storage.file.backend) decides
under its lock what to adopt, drop or remove. A file is *reachable* when its chain of parents
ends at a root or at an object the index holds; an *orphan* waits for a parent that is not
there (another process may still be writing it), and its first missing ancestor is its
``orphan_root``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Container, Iterable, Mapping
from typing import NamedTuple

from hicache.storage.codec import Corrupt
from hicache.storage.file.format import (
    OBJECT_SUFFIX,
    TMP_MARK,
    Header,
    object_path,
    read_header,
    remove_file,
)

TMP_MAX_AGE_S = 300.0  # a tmp file this old is a write that never finished


class FoundFile(NamedTuple):
    """An object file the index does not know, whose header checks out."""

    header: Header
    stat: os.stat_result
    path: str


def scan_directory(directory: str) -> dict[str, os.stat_result] | None:
    """path -> stat of every object file under ``directory``'s fan-out dirs, removing tmp files
    older than ``TMP_MAX_AGE_S`` on the way; None when the directory is gone. Raises OSError
    when it cannot be listed."""
    found: dict[str, os.stat_result] = {}
    now = time.time()
    try:
        subdirs = [d.path for d in os.scandir(directory) if d.is_dir()]
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
                if entry.name.endswith(OBJECT_SUFFIX):
                    found[entry.path] = st
                elif TMP_MARK in entry.name and now - st.st_mtime > TMP_MAX_AGE_S:
                    remove_file(entry.path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return found


def read_found(
    directory: str, files: Iterable[tuple[str, os.stat_result]]
) -> tuple[dict[str, FoundFile], list[str]]:
    """Read the headers of ``files`` (path, stat): key -> FoundFile of the valid ones, and the
    paths of the corrupt ones (a bad header, the wrong place for its key, a size that differs
    from its header). Files gone meanwhile are in neither."""
    good: dict[str, FoundFile] = {}
    bad: list[str] = []
    for path, st in files:
        try:
            with open(path, "rb", buffering=0) as f:
                h = read_header(f)
            if object_path(directory, h.key) != path:
                raise Corrupt("file in the wrong place")
            if h.header_len + h.payload_len != st.st_size:
                raise Corrupt("size differs from its header")
            good[h.key] = FoundFile(h, st, path)
        except FileNotFoundError:
            continue
        except (OSError, Corrupt):
            bad.append(path)
    return good, bad


def reachable(pending: Mapping[str, FoundFile], indexed: Container[str]) -> list[str]:
    """Keys of ``pending`` reachable from a root or an ``indexed`` object, parents first."""
    kids: dict[str, list[str]] = {}
    order: list[str] = []
    for key, found in pending.items():
        parent = found.header.parent
        if parent is None or parent in indexed:
            order.append(key)
        elif parent in pending:
            kids.setdefault(parent, []).append(key)
    for key in order:  # grows while we walk it: breadth first
        order.extend(kids.pop(key, ()))
    return order


def lru_order(order: list[str], pending: Mapping[str, FoundFile]) -> list[str]:
    """``order`` (parents first) least recently used first: a key is as recent as the newest
    file below it (ancestors stay more recent than their descendants); deeper first among
    equals."""
    recency = {k: pending[k].stat.st_mtime for k in order}
    depth: dict[str, int] = {}
    for k in order:
        p = pending[k].header.parent
        depth[k] = depth[p] + 1 if p in depth else 0
    for k in reversed(order):
        p = pending[k].header.parent
        if p in recency:
            recency[p] = max(recency[p], recency[k])
    return sorted(order, key=lambda k: (recency[k], -depth[k]))


def orphan_root(key: str, pending: Mapping[str, FoundFile]) -> str:
    """The first missing ancestor of an orphan (walks the pending headers)."""
    seen: set[str] = set()
    parent = pending[key].header.parent
    while parent is not None and parent in pending and parent not in seen:
        seen.add(parent)
        parent = pending[parent].header.parent
    assert parent is not None
    return parent
