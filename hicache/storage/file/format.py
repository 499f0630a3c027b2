"""The file backend's object format: one file per L3 object, header + payload.

    <dir>/<2-char fan-out>/<name>.kv      name = the key when filename-safe, else blake2b(key)

Header (little endian, VERSION 4):
    magic "HCKV" | version u16 | ndim u8 | kind u8 (0 tensor, 1 bytes) | key_len u32 |
    parent_len u32 (NO_PARENT: first of its chain) | payload_len u64 | xxh3-64(payload) u64 |
    dtype name 16s | namespace_len u32 (NO_NAMESPACE: the shared one) |
    token_count u32 (NO_CONTENT: not known) | key bytes | parent key bytes | shape ndim x u64 |
    namespace bytes | tokens token_count x u32
The namespace and tokens (what the object is the KV of, ``ObjectContent``) let a restarted
daemon publish the objects it finds as KV-event blocks (hicache.l3.index); they stay on this
machine (the redis backend keeps none). VERSION 3 files (the same without namespace_len,
token_count, namespace and tokens) and VERSION 2 files (VERSION 3 with crc32(payload) u32) are
still read, as objects whose content is not known. xxh3 as in the redis backend:
crc32 ran at ~1.5 GB/s, so checking a 2,000-token prefix's objects (92 MB of SmolLM2 KV) cost
~60 ms of CPU on a read and again on a write, and the backup's checksums took the cores of the
forwards beside it. Another version, a bad magic/length/checksum/key is ``Corrupt`` (the
backend counts it and removes the file: never wrong data). Writes go to a tmp file then
``os.replace`` (atomic); a tmp file's name holds ``TMP_MARK``.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import uuid
import zlib
from typing import BinaryIO, NamedTuple

import torch

from hicache.storage import codec
from hicache.storage.base import ObjectContent, StorageValue
from hicache.storage.codec import Corrupt

MAGIC, VERSION = b"HCKV", 4
NO_PARENT = NO_NAMESPACE = NO_CONTENT = 0xFFFFFFFF
FIXED = struct.Struct("<4sHBBIIQQ16sII")
FIXED_V3 = struct.Struct("<4sHBBIIQQ16s")  # no namespace and tokens
FIXED_V2 = struct.Struct("<4sHBBIIQI16s")  # crc32 checksums
_START = struct.Struct("<4sH")  # magic and version: what says how the rest reads
_MAX_KEY_LEN = 4096
_MAX_TOKENS = 1 << 20
_SAFE = re.compile(r"^[A-Za-z0-9_.\-]{3,160}$")
OBJECT_SUFFIX = ".kv"
TMP_MARK = OBJECT_SUFFIX + ".tmp."  # in the name of a file being written


class Header(NamedTuple):
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


def object_path(directory: str, key: str) -> str:
    """Where the object ``key`` lives under ``directory``."""
    name = key if _SAFE.match(key) else hashlib.blake2b(key.encode(), digest_size=20).hexdigest()
    return os.path.join(directory, name[:2], name + OBJECT_SUFFIX)


def encode_object(
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
    fixed = FIXED.pack(
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


def read_header(f: BinaryIO) -> Header:
    """The header at ``f``'s position (VERSION 2, 3 or 4). Raises Corrupt / OSError."""
    start = f.read(_START.size)
    if len(start) != _START.size:
        raise Corrupt("short header")
    magic, version = _START.unpack(start)
    if magic != MAGIC or version not in (2, 3, VERSION):
        raise Corrupt(f"magic {magic!r} version {version}, not {MAGIC!r} 2, 3 or {VERSION}")
    fixed = {VERSION: FIXED, 3: FIXED_V3, 2: FIXED_V2}[version]
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
    return Header(
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


def read_object(key: str, path: str) -> tuple[StorageValue, int]:
    """The value stored under ``key`` at ``path`` and its payload bytes; the payload is read
    straight into the returned tensor. Raises Corrupt / OSError."""
    with open(path, "rb", buffering=0) as f:
        h = read_header(f)
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


def write_object(path: str, header: bytes, payload: bytes | memoryview) -> None:
    """Write a file atomically: a tmp file beside ``path``, then ``os.replace``. Raises OSError,
    leaving no tmp file behind."""
    tmp = f"{path}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # also after the dir was removed
        with open(tmp, "wb", buffering=0) as f:
            _write_all(f, header)
            _write_all(f, payload)
        os.replace(tmp, path)
    except OSError:
        remove_file(tmp)
        raise


def size_on_disk(path: str) -> int | None:
    """The file's size; None when it cannot be found (or stat'ed)."""
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def remove_file(path: str) -> bool:
    """Remove a file; False only when it is still there."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    return True


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
