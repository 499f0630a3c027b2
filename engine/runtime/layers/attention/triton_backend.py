"""``triton``: the attention backend running this package's Triton kernels (triton_kernels.py).

Per batch (``init_forward_metadata``) it keeps the few device tensors the kernels read (the
extend start of each request, the longest extend); per layer it scatters the new K/V into the
pool and launches one kernel that gathers each request's KV through ``req_to_token`` itself:

    DECODE  one program per (request, head): the single query sees keys ``j < seq_len[b]``
    EXTEND  one program per (request, head, query block): new token i sees keys
            ``j <= prefix_len[b] + i`` (causal with the cached prefix)

With deterministic inference on (``deterministic_of``), both modes run the fixed-split kernels
of triton_fixed_split.py instead, which reduce every query's keys in the same fixed
chunks in both modes: a token's output is the same bits in prefill, after a prefix hit, at
decode, and beside any other requests.

CUDA graphs (decode): the decode metadata is only the batch size; the kernels read
``seq_lens`` / ``req_pool_indices`` from device memory (their KV loop bounds included) and their
grids are fixed per captured batch size (the fixed-split decode's chunk axis by the table width),
so capture and replay need no extra buffers and replay the same splits as eager decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.runtime.layers.attention import deterministic_of, triton_fixed_split, triton_kernels

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention


@dataclass
class _Metadata:
    is_decode: bool
    bs: int
    max_extend_len: int  # 1 for DECODE
    extend_starts: torch.Tensor | None  # [bs] int64 (EXTEND): first flat token of each request


class TritonAttnBackend:
    """Triton decode / extend attention over KV read through ``req_to_token``."""

    reads_host_kv = False  # loads land on the device before the forward reads them

    supports_cuda_graph = True

    def __init__(self, model_runner_or_config: Any = None) -> None:
        self.meta: _Metadata | None = None
        self.deterministic = deterministic_of(model_runner_or_config)
        self.split_size = triton_fixed_split.SPLIT_SIZE  # keys per chunk (deterministic)

    # --- CUDA graph protocol (decode) ---------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_kv_tokens: int) -> None:
        """Nothing to preallocate: the decode kernel reads everything from the batch tensors."""

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        """Before capturing ``fb`` (DECODE over the graph runner's static tensors)."""
        assert fb.forward_mode.is_decode(), "only DECODE batches are captured"
        self.meta = _Metadata(True, fb.batch_size, 1, None)

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        """Before each replay of the graph of ``fb.batch_size`` (the padded batch)."""
        assert fb.forward_mode.is_decode(), "only DECODE batches are replayed"
        self.meta = _Metadata(True, fb.batch_size, 1, None)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        if fb.forward_mode.is_decode():
            self.meta = _Metadata(True, bs, 1, None)
            return
        assert fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
        assert fb.extend_seq_lens_cpu is not None
        starts = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens  # [bs]
        self.meta = _Metadata(False, bs, max(fb.extend_seq_lens_cpu), starts.to(torch.int64))

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
        heads, head_dim = layer.num_heads, layer.head_dim
        q3 = q.reshape(-1, heads, head_dim)  # [num_tokens, heads, head_dim]
        req_to_token = fb.req_to_token_pool.req_to_token  # [rows, max_context_len] int32
        split = {"split": self.split_size} if self.deterministic else {}
        kernels = triton_fixed_split if self.deterministic else triton_kernels
        if meta.is_decode:
            out = kernels.decode_attention(
                q3,
                k_buf,
                v_buf,
                req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                layer.scaling,
                **split,
            )  # [bs, heads, head_dim]
        else:
            assert fb.extend_prefix_lens is not None and fb.extend_seq_lens is not None
            assert meta.extend_starts is not None
            out = kernels.extend_attention(
                q3,
                k_buf,
                v_buf,
                req_to_token,
                fb.req_pool_indices,
                fb.extend_prefix_lens,
                fb.extend_seq_lens,
                meta.extend_starts,
                meta.max_extend_len,
                layer.scaling,
                **split,
            )  # [num_tokens, heads, head_dim]
        return out.reshape(-1, heads * head_dim)  # [num_tokens, heads*head_dim]
