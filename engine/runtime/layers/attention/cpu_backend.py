"""``cpu``: decode attention by a C kernel that reads K/V straight from the paged pool through
``req_to_token`` (no gather into padded tensors, no masks); EXTEND batches as ``torch_native``.

Per decode batch it keeps only the request rows and sequence lengths; per layer it scatters the
new K/V into the pool (as ``torch_native``) and calls ``decode_attention`` once, parallel over
(request, kv head, span of keys) with an online softmax. Results equal ``torch_native``'s within
float32 rounding (softmax order differs). The CPU default when the weights are quantized, the C
kernels built (``cpu_kernels``) and the model's heads fit the kernel (``supports``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.runtime.layers.attention.torch_native import TorchNativeAttnBackend
from engine.runtime.layers.cpu_kernels import KERNELS, threads

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention


MAX_GROUP, MAX_HEAD_DIM = 16, 256  # AMAXG / AMAXHD in csrc/cpu_kernels.c


def supports(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the C decode kernel takes these heads (else it would return -2)."""
    group = num_heads // num_kv_heads
    return group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM and head_dim % 8 == 0


class CpuAttnBackend(TorchNativeAttnBackend):
    def __init__(self, model_runner_or_config: Any = None) -> None:
        super().__init__(model_runner_or_config)
        self.lib = KERNELS.get()
        if self.lib is None:
            raise ValueError(f"attention backend 'cpu' needs the C kernels: {KERNELS.error}")
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
        # a DECODE batch's (req_to_token rows, seq_lens) int64; None for EXTEND (read by the
        # fused decode stack too)
        self.decode_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode() and fb.seq_lens.device.type == "cpu":
            rows = fb.req_pool_indices.to(torch.int64).contiguous()
            self.decode_rows = (rows, fb.seq_lens.to(torch.int64).contiguous())
            self.meta = None
            return
        self.decode_rows = None
        super().init_forward_metadata(fb)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        if self.decode_rows is None:
            return super().forward(q, k, v, layer, fb)
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)  # [num_slots, kv_heads, head_dim]
        if k_buf.dtype != torch.float32 or not (k_buf.is_contiguous() and v_buf.is_contiguous()):
            raise ValueError("attention backend 'cpu' needs a contiguous float32 KV pool")
        rows, seq_lens = self.decode_rows
        q = q.float().contiguous()
        out = torch.empty_like(q)  # [bs, heads * head_dim]
        r2t = fb.req_to_token_pool.req_to_token  # [rows, max_context] int32
        rc = self.lib.decode_attention(
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), r2t.data_ptr(), r2t.stride(0),
            rows.data_ptr(), seq_lens.data_ptr(), q.shape[0], layer.num_heads,
            layer.num_kv_heads, layer.head_dim, layer.scaling, out.data_ptr(), threads(),
        )  # fmt: skip
        if rc == -2:
            raise ValueError(f"attention backend 'cpu' does not take {layer.num_heads} heads / "
                             f"{layer.num_kv_heads} kv heads of dim {layer.head_dim}")
        if rc != 0:
            raise MemoryError("decode attention: out of memory for its partial buffers")
        return out
