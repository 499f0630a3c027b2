"""L3 storage backends for host-pool pages."""

from __future__ import annotations

from hicache.storage.base import (
    StorageBackend,
    StorageStats,
    StorageValue,
    object_keys,
    page_hashes,
    prefix_hash_seed,
)
from hicache.storage.file import FileStorageBackend

__all__ = [
    "FileStorageBackend",
    "StorageBackend",
    "StorageStats",
    "StorageValue",
    "object_keys",
    "page_hashes",
    "prefix_hash_seed",
]
