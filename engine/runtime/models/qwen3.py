"""Qwen3: the Llama decoder with a per-head RMSNorm on q and k before RoPE (no qkv bias)."""

from __future__ import annotations

from typing import Any

import torch

from engine.runtime.layers import RMSNorm, RotaryEmbedding
from engine.runtime.models.llama import Device, LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        rotary_emb: RotaryEmbedding,
        device: Device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(config, layer_id, qkv_bias, o_bias, rotary_emb, device, dtype)
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, device, dtype)
        self.k_norm = RMSNorm(self.head_dim, eps, device, dtype)

    def prepare_qk(self, qk: torch.Tensor) -> torch.Tensor:
        # qk [num_tokens, heads + kv_heads, head_dim]: each head normed over head_dim
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
