"""MHATokenToKVPoolHost: the host (L2) KV pool and its own paged slot allocator.

Host slot ids are ``0 .. size-1`` (no padding page on the host); page ``p`` owns slots
``[p*page_size, (p+1)*page_size)``. Every page is in exactly one state:

    free  --alloc-->  in use  --free (ref == 0)-->  free
                        |  protect: ref += 1 (a copy is in flight)
                        +--free (ref > 0)-->  pending free  --release to ref 0-->  free

NOTE: freeing a protected page is *deferred*, never refused: the page leaves the owner at once
but returns to the free list only when its last in-flight copy releases it, so a copy can never
land in a page someone else was handed. Freeing a free (or pending) page raises ValueError.
Invariant: ``available + pending + in use == size`` (in slots).
"""

from __future__ import annotations

import os

import torch

from hicache.transfer.kernels import transfer

_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


def host_pool_size(
    device_size: int,
    page_size: int,
    bytes_per_token: int,
    hicache_ratio: float = 2.0,
    hicache_size_gb: float = 0.0,
) -> int:
    """Host pool size in tokens (a multiple of page_size): ``hicache_size_gb`` (GB = 1e9 bytes,
    as SGLang) when > 0, else ``hicache_ratio`` x the device pool size."""
    if hicache_size_gb > 0:
        tokens = int(hicache_size_gb * 1e9) // bytes_per_token
    else:
        tokens = int(device_size * hicache_ratio)
    return tokens // page_size * page_size


HOST_MEMORY_RESERVE = 2 << 30  # bytes left to the rest of the process (weights, activations)


def available_host_memory() -> int | None:
    """Bytes the kernel could give this process now (``MemAvailable``), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MHATokenToKVPoolHost:
    """Host K/V of ``layer_num`` layers in one tensor ``kv_buffer`` (layout below) on ``device``
    (CPU; pinned when CUDA is available) plus the free list of host pages."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        layout: str = "layer_first",
        device: torch.device | str = "cpu",
        pin_memory: bool | None = None,
    ) -> None:
        if layout not in transfer.LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; expected one of {transfer.LAYOUTS}")
        size = size // page_size * page_size
        if size <= 0:
            raise ValueError(f"host pool must hold at least one page of {page_size} tokens")
        self.size, self.page_size, self.layout = size, page_size, layout
        self.dtype, self.head_num, self.head_dim, self.layer_num = (
            dtype,
            head_num,
            head_dim,
            layer_num,
        )
        self.device = torch.device(device)
        # NOTE: fp8 is kept as uint8 bytes, like the device pool's store_dtype.
        self.store_dtype = torch.uint8 if dtype in _FP8_DTYPES else dtype
        if pin_memory is None:
            pin_memory = torch.cuda.is_available() and self.device.type == "cpu"
        if layout == "layer_first":
            shape = (2, layer_num, size, head_num, head_dim)
        else:
            shape = (2, size, layer_num, head_num, head_dim)
        nbytes = 2 * layer_num * size * head_num * head_dim * self.store_dtype.itemsize
        available = available_host_memory() if self.device.type == "cpu" else None
        if available is not None and nbytes > available - HOST_MEMORY_RESERVE:
            # NOTE: refuse up front: an oversized (pinned) host pool would get the process
            # OOM-killed later, or stall the whole machine, instead of failing with a reason.
            raise ValueError(
                f"host KV pool of {size} tokens needs {nbytes / 2**30:.1f} GiB but only "
                f"{available / 2**30:.1f} GiB of host memory is available (keeping "
                f"{HOST_MEMORY_RESERVE / 2**30:.0f} GiB free); lower hicache_ratio or set "
                f"hicache_size"
            )
        # [2, L, size, H, D] (layer_first) or [2, size, L, H, D] (page_first) on host
        self.kv_buffer = torch.empty(
            shape, dtype=self.store_dtype, device=self.device, pin_memory=pin_memory
        )
        if not pin_memory:
            # NOTE: touch every page now: a fresh page faults on its first write, which made
            # the first device->host write into each host region ~6x slower (measured: 92 MB in
            # 60 ms instead of 9 ms) while the written device pages stayed locked.
            self.kv_buffer.zero_()
        self.num_pages = size // page_size
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)
        self.clear()

    # ---- allocator -------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Drop the buffer (the owner is shut down and no copy is in flight): its GBs go back
        now, not when the cyclic GC gets to the objects that reference this pool."""
        self.kv_buffer = torch.empty((0,), dtype=self.store_dtype)

    def clear(self) -> None:
        """All pages free, no protections (callers make sure no copy is in flight)."""
        # free pages: ``free_pages`` (sorted) is handed out first, ``released`` (freed since) is
        # merged in sorted when it runs short: allocations are runs of consecutive pages (see
        # hicache.memory.allocator), so a node's host copy is a few slices
        self.free_pages = torch.arange(self.num_pages, dtype=torch.int64)
        self.released = self.free_pages[:0]
        self._is_free = torch.ones(self.num_pages, dtype=torch.bool)  # [num_pages]
        self._pending = torch.zeros(self.num_pages, dtype=torch.bool)  # freed while protected
        self._ref = torch.zeros(self.num_pages, dtype=torch.int32)  # in-flight copies per page

    def available_size(self) -> int:
        """Free host slots."""
        return int(self.free_pages.numel() + self.released.numel()) * self.page_size

    def debug_free_pages(self) -> torch.Tensor:
        """Sorted free page ids ([n] int64), for invariant checks."""
        return torch.sort(torch.cat((self.free_pages, self.released))).values

    def pending_free_size(self) -> int:
        """Slots freed by their owner but still protected by an in-flight copy."""
        return int(self._pending.sum()) * self.page_size

    def protected_size(self) -> int:
        """Slots of pages with at least one in-flight copy."""
        return int((self._ref > 0).sum()) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` host slots (a multiple of page_size) as whole pages: ``[need_size]``
        int64 on CPU, page-contiguous; None when not enough pages are free."""
        if need_size % self.page_size != 0:
            raise ValueError(f"need_size {need_size} is not a multiple of {self.page_size}")
        num = need_size // self.page_size
        if num > self.free_pages.numel():
            if num > self.free_pages.numel() + self.released.numel():
                return None
            self.free_pages = torch.sort(torch.cat((self.free_pages, self.released))).values
            self.released = self.released[:0]
        pages, self.free_pages = self.free_pages[:num], self.free_pages[num:]
        self._is_free[pages] = False
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _pages(self, indices: torch.Tensor) -> torch.Tensor:
        pages = torch.unique(indices.cpu() // self.page_size)
        if pages.numel() and (pages[0] < 0 or pages[-1] >= self.num_pages):
            raise ValueError("host indices out of range")
        return pages

    def free(self, indices: torch.Tensor) -> None:
        """Give back the pages of ``indices`` (int64 host slots); protected ones are deferred."""
        pages = self._pages(indices)
        if bool((self._is_free[pages] | self._pending[pages]).any()):
            raise ValueError("double free of host pages")
        busy = self._ref[pages] > 0
        self._pending[pages[busy]] = True
        self._release_to_free_list(pages[~busy])

    def protect(self, indices: torch.Tensor) -> None:
        """Mark the pages of ``indices`` as having one more in-flight copy."""
        pages = self._pages(indices)
        if bool(self._is_free[pages].any()):
            raise ValueError("protect of free host pages")
        self._ref[pages] += 1

    def release(self, indices: torch.Tensor) -> None:
        """One in-flight copy of the pages of ``indices`` finished; completes deferred frees."""
        pages = self._pages(indices)
        if bool((self._ref[pages] <= 0).any()):
            raise ValueError("release of unprotected host pages")
        self._ref[pages] -= 1
        done = pages[(self._ref[pages] == 0) & self._pending[pages]]
        self._pending[done] = False
        self._release_to_free_list(done)

    def _release_to_free_list(self, pages: torch.Tensor) -> None:
        if pages.numel():
            self._is_free[pages] = True
            self.released = torch.cat([self.released, pages])

    # ---- bytes -----------------------------------------------------------------------------
    def storage_fingerprint(self) -> str:
        """What decides the flat (L3) byte format; fold it into the L3 hash seed."""
        # NOTE: the device page size is not part of it: an object's flat bytes are the same
        # whichever page size wrote them.
        return (
            f"{self.layout}:{self.store_dtype}:L{self.layer_num}:H{self.head_num}:D{self.head_dim}"
        )

    @property
    def flat_token_dim(self) -> int:
        """Token dim of the flat form: 2 for layer_first ``[2, L, n, H, D]``, 1 for page_first
        ``[2, n, L, H, D]``."""
        return 2 if self.layout == "layer_first" else 1

    def get_flat_data(self, indices: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """All layers of host slots ``indices`` ([n] int64, whole pages as ``alloc`` hands them
        out) as one contiguous host tensor in the layout's order (see ``flat_token_dim``), for
        L3 backup."""
        return transfer.gather_tokens(self.kv_buffer, indices, self.layout, out, self.page_size)

    def get_flat_data_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of ``get_flat_data`` for ``num_tokens`` tokens."""
        L, H, D = self.layer_num, self.head_num, self.head_dim
        if self.layout == "layer_first":
            return (2, L, num_tokens, H, D)
        return (2, num_tokens, L, H, D)

    def set_from_flat_data(self, indices: torch.Tensor, data: torch.Tensor) -> None:
        """Write ``data`` (the ``get_flat_data`` form for ``len(indices)`` tokens) at ``indices``."""
        transfer.scatter_tokens(self.kv_buffer, indices, self.layout, data, self.page_size)

    def layer_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_id``'s K and V on host as ``[size, head_num, head_dim]`` views (strided
        for page_first), viewed as ``dtype``: read in place by a CPU forward while a load of
        them is held (``HiCacheController.start_loading``)."""
        k, v = (
            (
                self.kv_buffer[kv, layer_id]
                if self.layout == "layer_first"
                else self.kv_buffer[kv][:, layer_id]
            )
            for kv in (0, 1)
        )
        if self.store_dtype != self.dtype:
            k, v = k.view(self.dtype), v.view(self.dtype)
        return k, v

    def load_to_device_per_layer(
        self,
        device_pool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str = "kernel",
        use_triton: bool | None = None,
    ) -> None:
        """Host -> device pool (an MHATokenToKVPool) for one layer."""
        transfer.transfer_per_layer(
            self.kv_buffer,
            device_pool.k_buffer[layer_id],
            device_pool.v_buffer[layer_id],
            host_indices,
            device_indices,
            layer_id,
            self.layout,
            self.page_size,
            io_backend,
            use_triton,
        )

    def backup_from_device_all_layer(
        self,
        device_pool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: str = "kernel",
        use_triton: bool | None = None,
    ) -> None:
        """Device pool -> host, every layer, K and V."""
        transfer.transfer_all_layer(
            device_pool.k_buffer,
            device_pool.v_buffer,
            self.kv_buffer,
            device_indices,
            host_indices,
            self.layout,
            self.page_size,
            io_backend,
            use_triton,
        )
