"""MHATokenToKVPool: the device bytes of the K and V cache, one buffer pair per layer.

NOTE: buffers hold ``size + page_size`` slots; slots ``0 .. page_size-1`` (page 0) are the
padding page the allocator never hands out. The pool knows nothing of requests or trees.
"""

from __future__ import annotations

import torch

_FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)
)


class MHATokenToKVPool:
    """Per-layer K/V buffers ``[size + page_size, head_num, head_dim]`` of ``dtype`` on device."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        # NOTE: fp8 is stored as uint8 bytes (index_put of fp8 is not supported everywhere)
        # and viewed back as ``dtype`` on read.
        self.store_dtype = torch.uint8 if dtype in _FP8_DTYPES else dtype
        shape = (size + page_size, head_num, head_dim)
        # per layer [size + page_size, head_num, head_dim] on device
        self.k_buffer: list[torch.Tensor] = [
            torch.zeros(shape, dtype=self.store_dtype, device=self.device) for _ in range(layer_num)
        ]
        self.v_buffer: list[torch.Tensor] = [
            torch.zeros(shape, dtype=self.store_dtype, device=self.device) for _ in range(layer_num)
        ]

    def release_memory(self) -> None:
        """Drop the buffers (the engine is shut down): see MHATokenToKVPoolHost.release_memory."""
        self.k_buffer, self.v_buffer = [], []

    def _view(self, buf: torch.Tensor) -> torch.Tensor:
        return buf if self.store_dtype == self.dtype else buf.view(self.dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.k_buffer[layer_id])

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self._view(self.v_buffer[layer_id])

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def get_kv(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at slots ``loc`` ([n] int64): two ``[n, head_num, head_dim]`` copies."""
        return self.get_key_buffer(layer_id)[loc], self.get_value_buffer(layer_id)[loc]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write ``cache_k``/``cache_v`` (``[n, head_num*head_dim]`` or ``[n, head_num, head_dim]``)
        at slots ``loc`` ([n] int64 on device)."""
        shape = (-1, self.head_num, self.head_dim)
        cache_k = cache_k.reshape(shape).to(self.dtype)
        cache_v = cache_v.reshape(shape).to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k, cache_v = cache_k.view(self.store_dtype), cache_v.view(self.store_dtype)
        if loc.dtype != torch.int64:
            loc = loc.to(torch.int64)
        # NOTE: index_copy_ is one row memcpy per slot; ``buf[loc] = x`` (index_put_) measured
        # ~2x slower per call on CPU
        self.k_buffer[layer_id].index_copy_(0, loc, cache_k)
        self.v_buffer[layer_id].index_copy_(0, loc, cache_v)

    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers, K and V."""
        return self.token_bytes(self.dtype, self.head_num, self.head_dim, self.layer_num)

    @staticmethod
    def token_bytes(dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * layer_num * head_num * head_dim * elem

    @staticmethod
    def size_for_budget(
        mem_bytes: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
    ) -> int:
        """Largest usable ``size`` (a multiple of page_size) whose buffers, padding page
        included, fit in ``mem_bytes``; 0 when not even one page fits."""
        per_token = MHATokenToKVPool.token_bytes(dtype, head_num, head_dim, layer_num)
        num_slots = mem_bytes // per_token - page_size  # minus the padding page
        return max(0, num_slots // page_size * page_size)
