"""The reference attention backend: plain torch, batched, any device (the CPU default).

Per batch (``init_forward_metadata``) it builds padded gather indices into the KV pool and the
attention masks; per layer it does one scatter of the new K/V into the pool, one
``index_select`` per buffer, one masked ``scaled_dot_product_attention``:

    kv_indices [bs, max_seq_len]: req_to_token[req, :seq_len], padding -> slot 0 (padding page)
    EXTEND  query i of request b sees key j  iff  j <= prefix_len[b] + i  and  j < seq_len[b]
    DECODE  the single query of request b sees key j  iff  j < seq_len[b]

GQA without copying K/V: the ``G = heads / kv_heads`` query heads that share a kv head are folded
into the query-length dim, so K/V stay ``[bs, kv_heads, max_seq_len, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention


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
        self.meta = _Metadata(
            False, bs, max_seq_len, max_ext, kv_indices, mask.unsqueeze(1), pad_index
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
        # [bs, kv_heads, max_seq_len, head_dim]
        k_all = k_buf.index_select(0, meta.kv_indices).view(bs, seq, kv_heads, head_dim)
        v_all = v_buf.index_select(0, meta.kv_indices).view(bs, seq, kv_heads, head_dim)
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
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
