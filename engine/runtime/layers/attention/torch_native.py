"""The reference attention backend: plain torch, batched, any device (the CPU default).

Per batch (``init_forward_metadata``) it builds padded gather indices into the KV pool and the
attention masks; per layer it does one scatter of the new K/V into the pool, one
``index_select`` per buffer, one masked ``scaled_dot_product_attention``:

    kv_indices [bs, max_seq_len]: req_to_token[req, :seq_len], padding -> slot 0 (padding page)
    EXTEND  query i of request b sees key j  iff  j <= prefix_len[b] + i  and  j < seq_len[b]
    DECODE  the single query of request b sees key j  iff  j < seq_len[b]

GQA without copying K/V: the ``G = heads / kv_heads`` query heads that share a kv head are folded
into the query-length dim, so K/V stay ``[bs, kv_heads, max_seq_len, head_dim]``.

An EXTEND batch with ``fb.host_reads`` (a HiCache load from host memory still held, on a CPU)
gathers the KV of those slots from the host pool instead of the device pool (``_HostGather``):
the same bytes, so the same outputs, with no wait for the copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention
    from hicache.l2.tier import HostReads

# Runs of host / device positions up to which each run is gathered straight into place; more
# (a batch of many requests) gather everything from the device pool, then overwrite from host.
MAX_GATHER_RUNS = 16


@dataclass
class _HostGather:
    """Where an EXTEND batch's KV rows come from when some slots are still loading: flat KV
    position ``p`` reads ``kv_indices[p]`` of the device pool, or ``host_rows[p]`` of the
    host pool's layer where that slot is still loading."""

    layer_kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    runs: list[tuple[int, int, torch.Tensor, bool]] | None  # (start, end, rows, from host)
    host_pos: torch.Tensor  # [m] int64 flat positions read from host (when runs is None)
    host_rows: torch.Tensor  # [m] int64 host rows of those positions

    @staticmethod
    def build(kv_indices: torch.Tensor, reads: HostReads, num_slots: int) -> _HostGather | None:
        lut = torch.full((num_slots,), -1, dtype=torch.int64)
        lut[reads.device_indices] = reads.host_indices
        host_rows = lut[kv_indices]  # [n]: host row per flat position, -1: device pool
        from_host = host_rows >= 0
        if not bool(from_host.any()):
            return None
        cuts = (torch.nonzero(from_host[1:] != from_host[:-1]).flatten() + 1).tolist()
        if len(cuts) >= MAX_GATHER_RUNS:
            pos = torch.nonzero(from_host).flatten()
            return _HostGather(reads.layer_kv, None, pos, host_rows[pos])
        bounds = [0, *cuts, kv_indices.numel()]
        flags = from_host[bounds[:-1]].tolist()
        runs = [
            (a, b, (host_rows if h else kv_indices)[a:b], h)
            for a, b, h in zip(bounds, bounds[1:], flags)
        ]
        return _HostGather(reads.layer_kv, runs, host_rows[:0], host_rows[:0])

    def gather(
        self, layer_id: int, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[n, kv_heads, head_dim]`` of every flat position, as ``index_select``
        from the device pool would give once the load landed."""
        out = []
        for buf, host in zip((k_buf, v_buf), self.layer_kv(layer_id)):
            if self.runs is None:
                rows = buf.index_select(0, kv_indices)
                rows.index_copy_(0, self.host_pos, host.index_select(0, self.host_rows))
            else:
                rows = buf.new_empty((kv_indices.numel(), *buf.shape[1:]))
                for a, b, idx, from_host in self.runs:
                    torch.index_select(host if from_host else buf, 0, idx, out=rows[a:b])
            out.append(rows)
        return out[0], out[1]


@dataclass
class _Metadata:
    is_decode: bool
    bs: int
    max_seq_len: int
    max_extend_len: int  # 1 for DECODE
    kv_indices: torch.Tensor  # [bs * max_seq_len] int64 slots on device
    mask: torch.Tensor  # [bs, 1, max_extend_len, max_seq_len] bool on device (True = attend)
    # EXTEND with ragged lengths: flat token t sits at row pad_index[t] of [bs * max_extend_len]
    pad_index: torch.Tensor | None
    host: _HostGather | None = None  # EXTEND with slots still loading (fb.host_reads)
    masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def attn_mask(self, group: int, dtype: torch.dtype) -> torch.Tensor:
        """Additive ``[bs, 1, G * max_extend_len, max_seq_len]`` mask (``mask`` repeated for the
        G folded query heads), built once per batch: SDPA would convert a bool mask per layer."""
        key = (group, dtype)
        if key not in self.masks:
            bs, _, ext, seq = self.mask.shape
            mask = self.mask.unsqueeze(2).expand(bs, 1, group, ext, seq)
            mask = mask.reshape(bs, 1, group * ext, seq)
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
            self.masks[key] = additive.masked_fill_(~mask, float("-inf"))
        return self.masks[key]


class TorchNativeAttnBackend:
    """``torch_native``: SDPA over KV gathered from the pool through ``req_to_token``."""

    reads_host_kv = True  # EXTEND takes fb.host_reads (the scheduler's hold-and-read, CPU)
    supports_cuda_graph = False

    def __init__(self, model_runner_or_config: Any = None) -> None:
        self.meta: _Metadata | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        max_seq_len = max(fb.seq_lens_cpu)
        device = fb.seq_lens.device
        kv_pos = torch.arange(max_seq_len, device=device)  # [max_seq_len]
        valid = kv_pos[None, :] < fb.seq_lens[:, None]  # [bs, max_seq_len]
        req_to_token = fb.req_to_token_pool.req_to_token
        slots = req_to_token[fb.req_pool_indices, :max_seq_len]  # [bs, max_seq_len] int32
        kv_indices = torch.where(valid, slots, 0).to(torch.int64).reshape(-1)
        if fb.forward_mode.is_decode():
            mask = valid[:, None, None, :]  # [bs, 1, 1, max_seq_len]
            self.meta = _Metadata(True, bs, max_seq_len, 1, kv_indices, mask, None)
            return
        assert fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
        assert fb.extend_seq_lens_cpu is not None
        ext_lens_cpu = fb.extend_seq_lens_cpu
        max_ext = max(ext_lens_cpu)
        q_pos = fb.extend_prefix_lens[:, None] + torch.arange(max_ext, device=device)[None, :]
        # [bs, max_ext, max_seq_len]: causal with prefix, within the request's KV
        mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & valid[:, None, :]
        pad_index = None
        if any(n != max_ext for n in ext_lens_cpu):
            num_tokens = sum(ext_lens_cpu)
            starts = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens  # [bs]
            token_req = torch.repeat_interleave(
                torch.arange(bs, device=device), fb.extend_seq_lens, output_size=num_tokens
            )  # [num_tokens]: request of each flat token
            offset = torch.arange(num_tokens, device=device) - starts[token_req]
            pad_index = token_req * max_ext + offset  # [num_tokens]
        host = None
        if fb.host_reads is not None:
            num_slots = fb.token_to_kv_pool.k_buffer[0].shape[0]
            host = _HostGather.build(kv_indices, fb.host_reads, num_slots)
        self.meta = _Metadata(
            False, bs, max_seq_len, max_ext, kv_indices, mask.unsqueeze(1), pad_index, host
        )

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

        bs, seq, ext = meta.bs, meta.max_seq_len, meta.max_extend_len
        heads, kv_heads, head_dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        group = heads // kv_heads
        if meta.host is None:
            k_all, v_all = (
                k_buf.index_select(0, meta.kv_indices),
                v_buf.index_select(0, meta.kv_indices),
            )
        else:
            k_all, v_all = meta.host.gather(layer.layer_id, k_buf, v_buf, meta.kv_indices)
        # [bs, kv_heads, max_seq_len, head_dim]
        k_all = k_all.view(bs, seq, kv_heads, head_dim).transpose(1, 2)
        v_all = v_all.view(bs, seq, kv_heads, head_dim).transpose(1, 2)
        if k_all.dtype != q.dtype:
            k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)

        if meta.is_decode:
            qg = q.reshape(bs, kv_heads, group, head_dim)  # [bs, kv_heads, G, head_dim]
            out = F.scaled_dot_product_attention(
                qg, k_all, v_all, attn_mask=meta.attn_mask(1, q.dtype), scale=layer.scaling
            )  # [bs, kv_heads, G, head_dim]
            return out.reshape(bs, heads * head_dim)

        q = q.reshape(-1, heads, head_dim)  # [num_tokens, heads, head_dim]
        if meta.pad_index is not None:
            q_pad = q.new_zeros(bs * ext, heads, head_dim)
            q = q_pad.index_copy_(0, meta.pad_index, q)  # [bs * max_ext, heads, head_dim]
        # [bs, max_ext, kv_heads, G, head_dim] -> [bs, kv_heads, G * max_ext, head_dim]
        qg = q.view(bs, ext, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(bs, kv_heads, group * ext, head_dim)
        out = F.scaled_dot_product_attention(
            qg, k_all, v_all, attn_mask=meta.attn_mask(group, q.dtype), scale=layer.scaling
        )  # [bs, kv_heads, G * max_ext, head_dim]
        out = out.view(bs, kv_heads, group, ext, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bs * ext, heads * head_dim)  # [bs * max_ext, heads*head_dim]
        if meta.pad_index is not None:
            out = out.index_select(0, meta.pad_index)
        return out  # [num_tokens, heads*head_dim]
