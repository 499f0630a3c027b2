"""L3 storage: the StorageBackend interface and the per-page key hashing.

A key names one page of KV (all layers, K and V, in the host pool's flat form). Keys chain:

    seed = sha256("hicache-l3-v1" | model fingerprint | namespace)
    key[0] = sha256(seed | tokens[0:P])      key[i] = sha256(key[i-1] | tokens[i*P:(i+1)*P])

so a key stands for the whole prefix up to its page, and different models / namespaces never
share keys. Token ids are hashed as little-endian int32 bytes; a partial tail page has no key.
"""

from __future__ import annotations

import hashlib
import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

StorageValue = torch.Tensor | bytes


def prefix_hash_seed(model_fingerprint: str, namespace: str | None = None) -> str:
    """Seed of the key chain for one model (include the host pool's storage fingerprint) and
    namespace (None = shared)."""
    parts = ("hicache-l3-v1", model_fingerprint, namespace or "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def page_hashes(token_ids: Sequence[int], page_size: int, prefix_hash_seed: str) -> list[str]:
    """One hex SHA-256 key per full page of ``token_ids``, chained from ``prefix_hash_seed``."""
    prev = prefix_hash_seed.encode()
    out: list[str] = []
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        page = token_ids[start : start + page_size]
        h = hashlib.sha256(prev)
        h.update(struct.pack(f"<{page_size}i", *page))
        prev = h.digest()
        out.append(h.hexdigest())
    return out


@dataclass
class StorageStats:
    """Counters every backend keeps; ``stats()`` returns them as a dict."""

    objects: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    evictions: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class StorageBackend(ABC):
    """An L3 key -> page store. Methods never raise on I/O trouble: they report misses / False
    and count errors. Implementations are safe to call from several threads."""

    @abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of *leading* keys present (stops at the first absent one)."""

    @abstractmethod
    def batch_get(self, keys: Sequence[str]) -> list[StorageValue | None]:
        """Value per key, None for a miss (absent, corrupt or unreadable)."""

    @abstractmethod
    def batch_set(self, keys: Sequence[str], values: Sequence[StorageValue]) -> list[bool]:
        """Store each value; True when it is (now or already) stored."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove one key if present."""

    @abstractmethod
    def clear(self) -> None:
        """Remove every key."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """objects, bytes, capacity_bytes, hits, misses, errors, evictions, bytes_read,
        bytes_written (and backend extras)."""

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str) -> StorageValue | None:
        return self.batch_get([key])[0]

    def set(self, key: str, value: StorageValue) -> bool:
        return self.batch_set([key], [value])[0]
