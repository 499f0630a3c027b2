"""Llama decoder (also the base of Qwen2 / Qwen3): fused qkv and gate_up matmuls, RoPE,
RadixAttention over the paged KV pool, logits only for each request's last token by default."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.layers import Embedding, Linear, MergedLinear, RadixAttention, RMSNorm, get_rope
from engine.runtime.layers.cpu_kernels import threads
from engine.runtime.layers.linear import LMHead
from engine.runtime.layers.rotary import RotaryEmbedding

Device = torch.device | str

# HF checkpoint name fragment -> (fused module name fragment, shard)
FUSED_SHARDS: dict[str, tuple[str, str]] = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", "gate"),
    ".up_proj.": (".gate_up_proj.", "up"),
}


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
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
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, qkv_bias, device, dtype
        )
        self.o_proj = Linear(q_size, config.hidden_size, o_bias, device, dtype)
        self.rotary_emb = rotary_emb  # NOTE: one module shared by all layers
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim)

    def prepare_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """Hook before RoPE on ``qk [num_tokens, heads + kv_heads, head_dim]`` (Qwen3: norms)."""
        return qk

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        # [num_tokens, heads + 2 * kv_heads, head_dim]
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * kv_heads, head_dim)
        # q and k heads are adjacent: one RoPE call for both
        qk = self.rotary_emb(positions, self.prepare_qk(qkv[:, : heads + kv_heads]))
        q = qk[:, :heads].reshape(num_tokens, heads * head_dim)
        k = qk[:, heads:].reshape(num_tokens, kv_heads * head_dim)
        v = qkv[:, heads + kv_heads :].reshape(num_tokens, kv_heads * head_dim)
        out = self.attn(q, k, v, fb)  # [num_tokens, heads * head_dim]
        return self.o_proj(out)  # [num_tokens, hidden_size]


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, device: Device, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": inter, "up": inter}, bias, device, dtype
        )
        self.down_proj = Linear(inter, config.hidden_size, bias, device, dtype)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported")
        # the C kernel (cpu_kernels) when the fast CPU path is on: SiLU x up in one call, the
        # same arithmetic as the fused decode stack's
        self.kernel: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]: gate | up
        if self.kernel is not None and gate_up.dtype == torch.float32:
            gate_up = gate_up.contiguous()
            rows, inter = gate_up.numel() // gate_up.shape[-1], gate_up.shape[-1] // 2
            act = gate_up.new_empty(*gate_up.shape[:-1], inter)
            self.kernel.silu_mul(gate_up.data_ptr(), rows, inter, act.data_ptr(), threads())
            return self.down_proj(act)
        gate, up = gate_up.chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, attention: nn.Module, config: Any, device: Device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = attention
        self.mlp = LlamaMLP(config, device, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, device, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # hidden, residual: [num_tokens, hidden_size]; residual carries the un-normed stream
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: Any,
        make_attention: Callable[[int], nn.Module],
        device: Device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, device, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(make_attention(i), config, device, dtype)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        # the whole stack in one C call for CPU decode (llama_cpu_decode.install)
        self.fused_decode: Any = None

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(fb.input_ids)  # [num_tokens, hidden_size]
        if self.fused_decode is not None and self.fused_decode.takes(fb):
            hidden, residual = self.fused_decode(fb, hidden)
        else:
            residual = None
            for layer in self.layers:
                hidden, residual = layer(fb.positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        return hidden  # [num_tokens, hidden_size]


class LlamaForCausalLM(nn.Module):
    """``model(fb) -> logits``: ``[bs, vocab]`` (each request's last token) or
    ``[num_tokens, vocab]`` for an EXTEND batch with ``fb.return_all_logits``."""

    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention

    def __init__(
        self, config: Any, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.head_dim = head_dim_of(config)
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or (
            config.num_attention_heads
        )
        qkv_bias, o_bias = self.attention_biases(config)
        rotary = get_rope(config, self.head_dim, device, dtype)
        self.model = LlamaModel(
            config,
            lambda i: self.attention_cls(config, i, qkv_bias, o_bias, rotary, device, dtype),
            device,
            dtype,
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, False, device, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.model(fb)  # [num_tokens, hidden_size]
        if fb.forward_mode.is_extend() and not fb.return_all_logits:
            hidden = hidden.index_select(0, fb.last_token_indices())  # [bs, hidden_size]
        return self.lm_head(hidden)  # [bs or num_tokens, vocab]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; q/k/v and gate/up go into their fused matrices."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for fragment, (fused, shard) in FUSED_SHARDS.items():
                if fragment in name:
                    fused_name = name.replace(fragment, fused)
                    module_name, param = fused_name.rsplit(".", 1)
                    modules[module_name].load_shard(shard, param, tensor)
                    loaded.add(f"{fused_name}:{shard}")
                    break
            else:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r} in checkpoint")
                if params[name].shape != tensor.shape:
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}"
                    )
                with torch.no_grad():
                    params[name].copy_(tensor)
                loaded.add(name)
        self._check_all_loaded(loaded)

    def _check_all_loaded(self, loaded: set[str]) -> None:
        modules = dict(self.named_modules())
        missing: list[str] = []
        # NOTE: a tied lm_head.weight is listed once, as model.embed_tokens.weight
        for name, _ in self.named_parameters():
            module = modules[name.rsplit(".", 1)[0]]
            if isinstance(module, MergedLinear):
                missing += [
                    f"{name}:{s}" for s in module.shard_offsets if f"{name}:{s}" not in loaded
                ]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"weights missing from checkpoint: {missing[:8]}")
