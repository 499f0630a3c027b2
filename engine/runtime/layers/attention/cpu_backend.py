"""``cpu``: attention by one C kernel (``csrc/attention.h``) for EXTEND and DECODE alike, reading
K/V straight from the paged pool through ``req_to_token`` (no gather into padded tensors, no
masks).

A query row's keys are reduced in fixed chunks of absolute key positions (blocks of 64 inside
spans of 256, merged in order), so its output is the same bits whether its prefix was computed
in this forward, read from the cache or loaded from the host, in a prefill chunk of any size or
a decode step, in a batch of any company: the cache never changes an answer.

An EXTEND batch with ``fb.host_reads`` (a HiCache load still held, on a CPU) reads those
slots' K/V in place from the host pool (the kernel takes a slot -> host row table): the same
bytes, so the same outputs, with no wait for the copy.

The CPU default whenever the C kernels are built (``cpu_kernels``) and the model's heads fit
the kernel (``supports``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.runtime.layers.cpu_kernels import KERNELS, AttnBatchC, threads

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention

MAX_GROUP, MAX_HEAD_DIM = 16, 256  # AMAXG / AMAXHD in csrc/attention.h


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the C kernel takes these heads (else it would return -2)."""
    group = num_heads // num_kv_heads
    return (
        num_heads % num_kv_heads == 0
        and group <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
        and head_dim % 8 == 0
    )


@dataclass
class _Batch:
    """One forward's request geometry, int64 on CPU (what ``AttnBatch`` points at)."""

    is_decode: bool
    rows: torch.Tensor  # [bs] req_to_token rows
    q_first: torch.Tensor  # [bs] first query token of each request in q
    q_len: torch.Tensor  # [bs] query tokens per request
    kv_len: torch.Tensor  # [bs] keys per request (seq_lens)
    host_row: torch.Tensor | None  # [num_slots] host row of a slot still loading, -1 else
    host: Any  # fb.host_reads (HostReads) or None


class CpuAttnBackend:
    reads_host_kv = True  # EXTEND takes fb.host_reads (the scheduler's hold-and-read, CPU)
    supports_cuda_graph = False

    def __init__(self, model_runner_or_config: Any = None) -> None:
        lib = KERNELS.get()
        if lib is None:
            raise ValueError(f"attention backend 'cpu' needs the C kernels: {KERNELS.error}")
        self.lib = lib
        cfg = getattr(model_runner_or_config, "hf_config", None)
        if cfg is not None:
            heads = cfg.num_attention_heads
            kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
            if not supports(heads, kv_heads, head_dim):
                raise ValueError(
                    f"attention backend 'cpu' takes head_dim <= {MAX_HEAD_DIM} (a multiple of 8) "
                    f"and <= {MAX_GROUP} query heads per kv head; this model has head_dim "
                    f"{head_dim}, {heads} heads, {kv_heads} kv heads"
                )
        self.meta: _Batch | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        rows = fb.req_pool_indices.to(torch.int64).contiguous()
        kv_len = fb.seq_lens.to(torch.int64).contiguous()
        if fb.forward_mode.is_decode():
            q_len = torch.ones(bs, dtype=torch.int64)
            q_first = torch.arange(bs, dtype=torch.int64)
        else:
            assert fb.extend_seq_lens is not None
            q_len = fb.extend_seq_lens.to(torch.int64).contiguous()
            q_first = torch.cumsum(q_len, 0) - q_len
        host_row = None
        if fb.host_reads is not None:
            num_slots = fb.token_to_kv_pool.k_buffer[0].shape[0]
            host_row = torch.full((num_slots,), -1, dtype=torch.int64)
            host_row[fb.host_reads.device_indices] = fb.host_reads.host_indices
        self.meta = _Batch(
            fb.forward_mode.is_decode(), rows, q_first, q_len, kv_len, host_row, fb.host_reads
        )

    @property
    def decode_rows(self) -> torch.Tensor | None:
        """A DECODE batch's req_to_token rows (read by the fused decode stack), else None."""
        meta = self.meta
        return meta.rows if meta is not None and meta.is_decode else None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "init_forward_metadata was not called for this batch"
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)  # [num_slots, kv_heads, head_dim]
        if k_buf.dtype != torch.float32 or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
            raise ValueError("attention backend 'cpu' needs a contiguous float32 KV pool")
        q = q.float().contiguous()  # [num_tokens, heads * head_dim]
        out = torch.empty_like(q)
        hk = hv = None
        h_stride = 0
        if meta.host_row is not None:
            hk, hv = meta.host.layer_kv(layer.layer_id)  # [host rows, kv_heads, head_dim] views
            if hk.dtype != torch.float32 or hk.stride(1) != layer.head_dim or hk.stride(2) != 1:
                raise ValueError("attention backend 'cpu' reads host KV as float32 rows")
            h_stride = hk.stride(0)
        r2t = fb.req_to_token_pool.req_to_token  # [rows, max_context] int32
        batch = AttnBatchC(
            q.data_ptr(),
            q.shape[1],
            out.data_ptr(),
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            None if hk is None else hk.data_ptr(),
            None if hv is None else hv.data_ptr(),
            h_stride,
            None if meta.host_row is None else meta.host_row.data_ptr(),
            r2t.data_ptr(),
            r2t.stride(0),
            meta.rows.data_ptr(),
            meta.q_first.data_ptr(),
            meta.q_len.data_ptr(),
            meta.kv_len.data_ptr(),
            meta.rows.shape[0],
            layer.num_heads,
            layer.num_kv_heads,
            layer.head_dim,
            layer.scaling,
        )
        rc = self.lib.attention(ctypes.byref(batch), threads())
        if rc == -2:
            raise ValueError(
                f"attention backend 'cpu' does not take {layer.num_heads} heads / "
                f"{layer.num_kv_heads} kv heads of dim {layer.head_dim}"
            )
        if rc != 0:
            raise MemoryError("attention: out of memory for its task buffers")
        return out
