"""L3 storage backends for host-pool pages.

The names below load their modules on first use: ``hicache.storage.redis.url`` (parsed in the
daemon's API server process, which never loads torch) must not pull in the backends.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.observe.stats import StorageStats
    from hicache.storage.base import (
        StorageBackend,
        StorageValue,
        object_keys,
        page_hashes,
        prefix_hash_seed,
    )
    from hicache.storage.file.backend import FileStorageBackend

_HOMES = {
    "FileStorageBackend": "hicache.storage.file.backend",
    "StorageBackend": "hicache.storage.base",
    "StorageStats": "hicache.observe.stats",
    "StorageValue": "hicache.storage.base",
    "object_keys": "hicache.storage.base",
    "page_hashes": "hicache.storage.base",
    "prefix_hash_seed": "hicache.storage.base",
}
__all__ = [
    "FileStorageBackend",
    "StorageBackend",
    "StorageStats",
    "StorageValue",
    "object_keys",
    "page_hashes",
    "prefix_hash_seed",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'hicache.storage' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
