"""ForwardBatch: everything one model forward needs, built by the model runner per step.

A batch is either all EXTEND (prefill / chunked prefill / extend after a cached prefix) or all
DECODE (one new token per request). New tokens of all requests are concatenated:

    request b:  [ prefix (KV already in the pool) | new tokens (KV written this step) ]
                0                  extend_prefix_lens[b]                     seq_lens[b]

NOTE: before the forward, ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` must already hold
the slots of the whole sequence, including ``out_cache_loc`` of the new tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.runtime.layers.attention import AttentionBackend
    from hicache.l2.tier import HostReads
    from hicache.memory.kv_pool import MHATokenToKVPool
    from hicache.memory.req_to_token import ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = 1
    DECODE = 2

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64 on device (all requests' new tokens)
    positions: torch.Tensor  # [num_tokens] int64 absolute positions on device
    out_cache_loc: torch.Tensor  # [num_tokens] int64 slots where each new token's K/V goes
    req_pool_indices: torch.Tensor  # [bs] int64 rows of req_to_token
    seq_lens: torch.Tensor  # [bs] int64 total KV length per request after this step
    extend_prefix_lens: torch.Tensor | None  # [bs] int64 (EXTEND) cached prefix length
    extend_seq_lens: torch.Tensor | None  # [bs] int64 (EXTEND) new tokens per request
    seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int] | None
    extend_seq_lens_cpu: list[int] | None
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    attn_backend: AttentionBackend
    return_all_logits: bool = False  # EXTEND: logits for every token, else each request's last
    # Layer-wise overlap with an in-flight host->device load (HiCache): when set, attention of
    # layer i calls ``wait_layer(i)`` before touching the KV pool, so it runs only after layer
    # i's loaded KV is on device. None: nothing is loading (no wait at all).
    wait_layer: Callable[[int], None] | None = None
    # CPU, instead of wait_layer: the device slots still loading and their host copies
    # (hicache HostReads); the attention backend reads those slots' KV from host memory
    host_reads: HostReads | None = None

    @property
    def num_tokens(self) -> int:
        if self.forward_mode.is_decode():
            return self.batch_size
        assert self.extend_seq_lens_cpu is not None
        return sum(self.extend_seq_lens_cpu)

    def last_token_indices(self) -> torch.Tensor:
        """[bs] int64 on device: index of each request's last new token in the flat layout."""
        if self.forward_mode.is_decode():
            return torch.arange(self.batch_size, device=self.input_ids.device)
        assert self.extend_seq_lens is not None
        return torch.cumsum(self.extend_seq_lens, dim=0) - 1
