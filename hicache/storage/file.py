"""FileStorageBackend: one file per page under a directory, LRU-capped, surviving restarts.

    <dir>/<2-char fan-out>/<name>.kv      name = the key when filename-safe, else blake2b(key)

File = header + payload. Header (little endian):
    magic "HCKV" | version u16 | ndim u8 | kind u8 (0 tensor, 1 bytes) | key_len u32 |
    payload_len u64 | crc32(payload) u32 | dtype name 16s | key bytes | shape ndim x u64
A bad magic/version/length/checksum/key reads as a miss: counted in ``misses`` and ``corrupt``,
the file removed. Never wrong data. Writes go to a tmp file then ``os.replace`` (atomic).
The index (key -> size, LRU order) lives in memory and is rebuilt from the headers on start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

from hicache.storage.base import StorageBackend, StorageStats, StorageValue

logger = logging.getLogger(__name__)

MAGIC, VERSION = b"HCKV", 1
_FIXED = struct.Struct("<4sHBBIQI16s")
_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{3,160}$")


class _Corrupt(Exception):
    pass


class FileStorageBackend(StorageBackend):
    """Pages as files in ``directory``; ``capacity_bytes`` caps the files' total size (LRU)."""

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int = 64 << 30) -> None:
        self.dir = os.fspath(directory)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, LRU first
        self._stats = StorageStats(capacity_bytes=capacity_bytes)
        self._rebuild_index()

    # ---- paths and encoding --------------------------------------------------------------
    def _path(self, key: str) -> str:
        name = (
            key if _SAFE.match(key) else hashlib.blake2b(key.encode(), digest_size=20).hexdigest()
        )
        return os.path.join(self.dir, name[:2], name + ".kv")

    @staticmethod
    def _encode(key: str, value: StorageValue) -> tuple[bytes, memoryview]:
        if isinstance(value, (bytes, bytearray, memoryview)):
            kind, dtype, shape, payload = 1, "uint8", (len(value),), memoryview(value)
        else:
            t = value.detach().cpu().contiguous()
            kind, dtype, shape = 0, str(t.dtype).removeprefix("torch."), tuple(t.shape)
            payload = memoryview(t.view(torch.uint8).reshape(-1).numpy()).cast("B")
        key_b = key.encode()
        fixed = _FIXED.pack(MAGIC, VERSION, len(shape), kind, len(key_b), payload.nbytes,
                            zlib.crc32(payload), dtype.encode())  # fmt: skip
        return fixed + key_b + struct.pack(f"<{len(shape)}Q", *shape), payload

    @staticmethod
    def _read_header(f) -> tuple[str, int, str, tuple[int, ...], int, int]:
        raw = f.read(_FIXED.size)
        if len(raw) != _FIXED.size:
            raise _Corrupt("short header")
        magic, version, ndim, kind, key_len, payload_len, crc, dtype = _FIXED.unpack(raw)
        if magic != MAGIC or version != VERSION or kind not in (0, 1):
            raise _Corrupt("bad magic/version")
        rest = f.read(key_len + 8 * ndim)
        if len(rest) != key_len + 8 * ndim:
            raise _Corrupt("short header")
        shape = struct.unpack(f"<{ndim}Q", rest[key_len:])
        key = rest[:key_len].decode(errors="replace")
        return key, kind, dtype.rstrip(b"\0").decode(), shape, payload_len, crc

    def _decode(self, key: str, path: str) -> StorageValue:
        with open(path, "rb") as f:
            file_key, kind, dtype, shape, payload_len, crc = self._read_header(f)
            payload = f.read(payload_len + 1)
        if file_key != key or len(payload) != payload_len or zlib.crc32(payload) != crc:
            raise _Corrupt("key/length/checksum mismatch")
        if kind == 1:
            return payload
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise _Corrupt(f"unknown dtype {dtype}")
        return torch.frombuffer(bytearray(payload), dtype=torch_dtype).reshape(shape)

    # ---- index -----------------------------------------------------------------------------
    def _rebuild_index(self) -> None:
        found: list[tuple[float, str, int]] = []
        try:
            os.makedirs(self.dir, exist_ok=True)
            for entry in os.scandir(self.dir):
                if entry.is_dir():
                    found += self._scan_subdir(entry.path)
        except OSError as e:
            logger.warning("file storage %s unusable: %s", self.dir, e)
            self._stats.errors += 1
        for _, key, size in sorted(found):  # oldest first = LRU end
            self._index[key] = size
            self._stats.bytes += size
        self._stats.objects = len(self._index)
        with self._lock:
            self._evict_locked(0)

    def _scan_subdir(self, subdir: str) -> list[tuple[float, str, int]]:
        found = []
        for entry in os.scandir(subdir):
            if ".tmp." in entry.name:
                _remove(entry.path)  # a write that never finished
            elif entry.name.endswith(".kv"):
                try:
                    with open(entry.path, "rb") as f:
                        key = self._read_header(f)[0]
                    if self._path(key) != entry.path:
                        raise _Corrupt("file in the wrong place")
                    st = entry.stat()
                    found.append((st.st_mtime, key, st.st_size))
                except (OSError, _Corrupt):
                    self._stats.corrupt += 1
                    _remove(entry.path)
        return found

    def _drop_locked(self, key: str) -> None:
        size = self._index.pop(key, None)
        if size is not None:
            self._stats.bytes -= size
            self._stats.objects -= 1

    def _evict_locked(self, need: int) -> None:
        """Drop LRU files until ``need`` more bytes fit under the cap."""
        while self._index and self._stats.bytes + need > self._stats.capacity_bytes:
            key = next(iter(self._index))
            self._drop_locked(key)
            _remove(self._path(key))
            self._stats.evictions += 1

    # ---- StorageBackend --------------------------------------------------------------------
    def batch_exists(self, keys: Sequence[str]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._index:
                    return i
        return len(keys)

    def batch_get(self, keys: Sequence[str]) -> list[StorageValue | None]:
        out: list[StorageValue | None] = []
        for key in keys:
            with self._lock:
                present = key in self._index
                if present:
                    self._index.move_to_end(key)
            value = None
            if present:
                try:
                    value = self._decode(key, self._path(key))
                except FileNotFoundError:
                    with self._lock:
                        self._drop_locked(key)
                except (OSError, _Corrupt, RuntimeError, ValueError) as e:
                    logger.warning("file storage: dropping unreadable page %s: %s", key, e)
                    with self._lock:
                        self._stats.corrupt += 1
                        self._drop_locked(key)
                    _remove(self._path(key))
            with self._lock:
                if value is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._stats.bytes_read += (
                        len(value)
                        if isinstance(value, bytes)
                        else (value.numel() * value.element_size())
                    )
            out.append(value)
        return out

    def batch_set(self, keys: Sequence[str], values: Sequence[StorageValue]) -> list[bool]:
        assert len(keys) == len(values), "keys and values differ in length"
        return [self._set_one(k, v) for k, v in zip(keys, values)]

    def _set_one(self, key: str, value: StorageValue) -> bool:
        with self._lock:
            if key in self._index:  # content-addressed: same key, same bytes
                self._index.move_to_end(key)
                return True
        path = self._path(key)
        tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        try:
            header, payload = self._encode(key, value)
            size = len(header) + payload.nbytes
            with self._lock:
                if size > self._stats.capacity_bytes:
                    raise OSError(f"page of {size} bytes exceeds the capacity")
                self._evict_locked(size)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except (OSError, TypeError, RuntimeError) as e:
            logger.warning("file storage: cannot write page %s: %s", key, e)
            _remove(tmp)
            with self._lock:
                self._stats.errors += 1
            return False
        with self._lock:
            self._drop_locked(key)
            self._index[key] = size
            self._stats.bytes += size
            self._stats.objects += 1
            self._stats.bytes_written += size
            self._evict_locked(0)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop_locked(key)
        _remove(self._path(key))

    def clear(self) -> None:
        with self._lock:
            keys = list(self._index)
            for key in keys:
                self._drop_locked(key)
        for key in keys:
            _remove(self._path(key))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats.as_dict()


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass
