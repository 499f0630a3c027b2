"""L3 storage: the StorageBackend interface and the chained object keys.

An L3 *object* holds the KV of ``object_size`` consecutive tokens (``hicache_storage_page_size``,
a multiple of the device page size): all layers, K and V, in the host pool's flat form. Keys
chain from the root of the token path:

    seed   = sha256("hicache-l3-v2" | model fingerprint | namespace)
    key[0] = sha256(seed | tokens[0:S])      key[i] = sha256(key[i-1] | tokens[i*S:(i+1)*S])

so a key stands for the whole prefix up to its object, and different models / namespaces never
share keys. Token ids are hashed as little-endian int32 bytes; a tail shorter than one object has
no key (it is never stored). ``key[i-1]`` is ``key[i]``'s *parent*: a backend that loses an
object also forgets every object after it in its chain (they can no longer be reached).

A backend may keep what each object is of (``ObjectContent``: its namespace and tokens, given to
``batch_set``) and report the changes of what it holds (``watch``): the KV events' L3 blocks
(hicache.l3.index). One that cannot (a shared server: others write and evict behind its back)
reports nothing and keeps no content.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

StorageValue = torch.Tensor | bytes
KEY_VERSION = "hicache-l3-v2"


def prefix_hash_seed(model_fingerprint: str, namespace: str | None = None) -> str:
    """Seed of the key chain for one model (include the host pool's storage fingerprint) and
    namespace (None = shared)."""
    parts = (KEY_VERSION, model_fingerprint, namespace or "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def object_keys(
    token_ids: Sequence[int], object_size: int, seed: str, start: int = 0, prev: str | None = None
) -> list[str]:
    """One hex SHA-256 key per full object of ``token_ids``, chained from ``seed``.

    ``start`` (a multiple of ``object_size``) and ``prev`` (the key of the object ending at
    ``start``; None when ``start == 0``) continue a chain computed earlier."""
    if start % object_size:
        raise ValueError(f"start {start} is not a multiple of the object size {object_size}")
    if start and prev is None:
        raise ValueError("continuing a key chain needs the previous key")
    num = (len(token_ids) - start) // object_size
    if num <= 0:
        return []
    raw = np.asarray(token_ids[start : start + num * object_size], dtype="<i4").tobytes()
    step = 4 * object_size
    h_prev = bytes.fromhex(prev) if prev is not None else seed.encode()
    out: list[str] = []
    for i in range(num):
        h = hashlib.sha256(h_prev)
        h.update(raw[i * step : (i + 1) * step])
        h_prev = h.digest()
        out.append(h.hexdigest())
    return out


def object_key(parent: str | None, seed: str, tokens: bytes) -> str:
    """The key of one object: its parent's key (None: the first object, chained from ``seed``)
    and its tokens as little-endian 32-bit bytes; equal to ``object_keys``' for that object."""
    h = hashlib.sha256(bytes.fromhex(parent) if parent is not None else seed.encode())
    h.update(tokens)
    return h.hexdigest()


def page_hashes(token_ids: Sequence[int], page_size: int, seed: str) -> list[str]:
    """``object_keys`` from the start of the path (kept for callers that name pages)."""
    return object_keys(token_ids, page_size, seed)


@dataclass(frozen=True)
class ObjectContent:
    """What an object holds the KV of: a namespace (None: the shared one) and its tokens,
    packed as little-endian u32 (a large store's index keeps millions of them)."""

    namespace: str | None
    tokens: bytes

    @classmethod
    def of(cls, namespace: str | None, token_ids: Sequence[int]) -> ObjectContent:
        return cls(namespace, np.asarray(token_ids, dtype="<u4").tobytes())

    def token_ids(self) -> list[int]:
        return np.frombuffer(self.tokens, dtype="<u4").tolist()


class StoredObject(NamedTuple):
    key: str
    parent: str | None
    content: ObjectContent | None  # None: not known (an object written without it)


@dataclass(frozen=True)
class ObjectsStored:
    """Objects the backend holds now (newly, or, first, all it held when watching began)."""

    objects: tuple[StoredObject, ...]


@dataclass(frozen=True)
class ObjectsRemoved:
    """Objects the backend no longer holds (deleted, evicted, lost on a read or a rescan)."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class StoreCleared:
    """The backend holds nothing any more."""


StoreChange = ObjectsStored | ObjectsRemoved | StoreCleared
Watcher = Callable[[StoreChange], None]


class StorageBackend(ABC):
    """An L3 key -> object store. Methods never raise on I/O trouble: they report misses /
    False and count errors. Implementations are safe to call from several threads."""

    # Where the objects live, as routers name it (KV events' medium): "disk" (this machine's
    # disk, its daemon's own) or "external" (a server other daemons may share)
    medium: str = "external"

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of *leading* keys present (stops at the first absent one)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[StorageValue | None]:
        """Value per key, None for a miss. A key found absent, corrupt or unreadable is
        forgotten together with every key chained after it (see the module docstring)."""

    @abstractmethod
    def batch_set(
        self,
        keys: Sequence[str],
        values: Sequence[StorageValue],
        parents: Sequence[str | None] | None = None,
        contents: Sequence[ObjectContent | None] | None = None,
    ) -> list[bool]:
        """Store each value; True when it is (now or already) stored. ``parents[i]`` is the
        key chained before ``keys[i]`` (None: the first object of its chain); ``contents[i]``
        what it is of (a backend that reports what it holds keeps it; others ignore it)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one key (and the keys chained after it) if present."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every key."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """objects, bytes, capacity_bytes, hits, misses, errors, evictions, corrupt, vanished,
        bytes_read, bytes_written (and backend extras)."""

    def reconcile(self) -> int:
        """Make the index agree with what the store really holds (objects removed or damaged
        behind this process's back); returns the objects dropped. Default: nothing to do."""
        return 0

    def watch(self, watcher: Watcher | None) -> bool:
        """Report every change of the objects this backend holds to ``watcher`` from now on
        (None: stop), starting with one ObjectsStored of all it holds now, in the order the
        changes happen, from the thread that makes each. False: this backend cannot (it does
        not know what its store holds) and reports nothing. NOTE: ``watcher`` may run under the
        backend's lock: it must be quick and never call the backend."""
        return False

    def close(self) -> None:
        """Release what this backend holds open (connections) once nothing will call it any
        more. Default: it holds nothing."""

    def describe(self) -> dict[str, str]:
        """What this backend is, for admin output: at least ``backend`` (a short name); where
        it stores (``address``, never with credentials) when the backend has one."""
        name = type(self).__name__.removesuffix("StorageBackend").lower()
        return {"backend": name or type(self).__name__}

    def exists_mask(self, keys: Sequence[str]) -> list[bool]:
        """Presence of each key (not only the leading ones)."""
        return [self.batch_exists([k]) == 1 for k in keys]

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> StorageValue | None:
        return self.batch_get([key])[0]

    def set(self, key: str, value: StorageValue, parent: str | None = None) -> bool:
        return self.batch_set([key], [value], [parent])[0]
