"""Builds the HiRadixCache (L1 device + L2 host + optional L3 storage) from ServerArgs, and the
L3 backends it attaches (at start, or at run time: ``build_storage_for``)."""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any

from engine.config import ServerArgs
from engine.errors import TierUnavailableError
from hicache.memory.host_pool import MHATokenToKVPoolHost, host_pool_size
from hicache.storage.base import StorageBackend
from hicache.transfer.controller import HiCacheController
from hicache.tree.base import BasePrefixCache
from hicache.tree.hiradix import HiRadixCache

if TYPE_CHECKING:
    from engine.runtime.model_runner import ModelRunner

DEFAULT_STORAGE_DIR = os.path.join("~", ".cache", "hicache", "kv")

log = logging.getLogger(__name__)


def model_fingerprint(
    hf_config: Any,
    dtype: Any,
    object_size: int,
    quantization: str = "none",
    numerics: str = "",
) -> str:
    """Hash of the model config, KV dtype, L3 object size, weight quantization and the numeric
    path that computed the KV (``ModelRunner.numerics``): objects of another model (or object
    size, or kernels that round differently) never match."""
    to_json = getattr(hf_config, "to_json_string", None)
    cfg = to_json(use_diff=False) if to_json is not None else repr(hf_config)
    weights = "" if quantization == "none" else f"|W{quantization}"
    return hashlib.sha256(
        f"{cfg}|{dtype}|S{object_size}{weights}|N{numerics}".encode()
    ).hexdigest()[:32]


def storage_scope(fingerprint: str, host_pool: MHATokenToKVPoolHost) -> str:
    """The name of this model's L3 objects on a shared server (redis keys "<prefix>:<scope>:"):
    the fingerprint the object keys are seeded with, so Flush deletes exactly our objects."""
    full = fingerprint + "|" + host_pool.storage_fingerprint()
    return hashlib.sha256(full.encode()).hexdigest()[:16]


def build_storage(
    args: ServerArgs,
    scope: str,
    backend: str | None = None,
    url: str | None = None,
    directory: str | None = None,
) -> Any:
    """The L3 backend ``args`` name (or ``backend`` / ``url`` / ``directory``: a run-time
    attach); None with L3 off."""
    backend = backend if backend is not None else args.hicache_storage_backend
    if not backend:
        return None
    if backend == "redis":
        from hicache.storage.redis.backend import RedisStorageBackend

        redis_url = url or args.hicache_storage_url
        if not redis_url:
            raise ValueError(
                "the redis L3 backend needs a URL (redis://host:port/db, "
                "rediss://..., redis-cluster://h:p,h:p)"
            )
        return RedisStorageBackend(redis_url, scope, key_prefix=args.hicache_storage_key_prefix)
    if backend != "file":
        raise ValueError(f"unknown hicache_storage_backend {backend!r} (file, redis)")
    from hicache.storage.file.backend import FileStorageBackend

    directory = os.path.expanduser(directory or args.hicache_storage_dir or DEFAULT_STORAGE_DIR)
    # NOTE: no rescan inside stats() (it runs on the scheduler thread): the L3 backup thread
    # rescans when idle (hicache.transfer.storage_io)
    return FileStorageBackend(
        directory, int(args.hicache_storage_size_gb * (1 << 30)), reconcile_interval_s=None
    )


def build_storage_for(
    args: ServerArgs,
    cache: BasePrefixCache,
    backend: str,
    url: str | None = None,
    directory: str | None = None,
) -> StorageBackend:
    """The backend ``backend`` / ``url`` / ``directory`` name, for ``cache`` to attach at run
    time (its objects are the ones a daemon with the same model and options would use).
    TierUnavailableError, before anything is built, for a cache without L3. Any thread."""
    if cache.host is None or cache.l3 is None:
        raise TierUnavailableError("L3 needs the hierarchical cache (enable_hierarchical_cache)")
    scope = storage_scope(cache.host.controller.model_fingerprint, cache.host.pool)
    storage = build_storage(args, scope, backend=backend, url=url, directory=directory)
    if storage is None:
        raise ValueError("no L3 backend named")
    return storage


def build_hiradix_cache(args: ServerArgs, runner: ModelRunner) -> HiRadixCache:
    kv_pool, allocator, ps = runner.kv_pool, runner.allocator, args.page_size
    size = host_pool_size(
        allocator.size, ps, kv_pool.bytes_per_token(), args.hicache_ratio, args.hicache_size
    )
    if size <= allocator.size and args.hicache_write_policy != "write_back":
        # NOTE: with write-through every device page also holds a host page, so a host pool no
        # larger than the device pool is all copies of L1: nothing host-only survives and an L3
        # prefetch has nowhere to land (SGLang refuses this size outright).
        log.warning(
            "host pool (%d tokens) is not larger than the device pool (%d): L2 will "
            "only mirror L1 and L3 prefetches will be skipped; use hicache_ratio > 1",
            size,
            allocator.size,
        )
    host_pool = MHATokenToKVPoolHost(
        size,
        ps,
        kv_pool.dtype,
        kv_pool.head_num,
        kv_pool.head_dim,
        kv_pool.layer_num,
        layout=args.hicache_mem_layout,
    )
    sps = args.hicache_storage_page_size
    assert sps is not None, "ServerArgs derives it from page_size when not given"
    fingerprint = model_fingerprint(
        runner.hf_config, kv_pool.dtype, sps, runner.quantization, runner.numerics
    )
    controller = HiCacheController(
        kv_pool,
        host_pool,
        allocator,
        io_backend=args.hicache_io_backend,
        storage=build_storage(args, storage_scope(fingerprint, host_pool)),
        model_fingerprint=fingerprint,
        storage_object_size=sps,
    )
    return HiRadixCache(
        runner.req_to_token_pool,
        allocator,
        ps,
        host_pool,
        controller,
        write_policy=args.hicache_write_policy,
        eviction_policy=args.radix_eviction_policy,
        prefetch_threshold=args.hicache_prefetch_threshold,
        prefetch_policy=args.hicache_storage_prefetch_policy,
        prefetch_timeout_base=args.hicache_prefetch_timeout_base,
        prefetch_timeout_per_ki_token=args.hicache_prefetch_timeout_per_ki_token,
    )


def close_storage(storage: StorageBackend | None) -> None:
    """Release a detached backend's connections (None: nothing was attached)."""
    if storage is not None:
        storage.close()
