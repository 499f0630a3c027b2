"""A Llama-family decode stack as one C call (``decode_layers`` in csrc/cpu_kernels.c).

On the CPU path, a decode step of a few rows spends as long in per-layer Python and torch
dispatch (~40 ops a layer: views, chunks, the norm / RoPE / attention / product calls and their
output tensors) as in the matmuls. ``FusedDecode`` hands the C side every layer's packed
weights and KV-pool pointers once, at start-up; per step it passes the embeddings and the
batch's positions, slots and ``req_to_token`` rows, and gets back the last layer's output and
the residual stream (``LlamaModel.forward`` applies the final norm and the vocab projection as
always). The C function calls the same product, norm, RoPE and attention kernels the modules
call, in the same order, so its outputs equal the per-module path's bit for bit
(``tests/unit/test_llama_cpu_decode.py``).

Taken when (``install``): C kernels built, every q/k/v, o, gate/up, down on packed panels
(quantized, or dense with the ``cpu`` linear backend), the ``cpu`` attention backend, RoPE and
norms on their kernels, and a plain Llama attention (no ``prepare_qk`` hook: Qwen3's q/k norms
keep the module path).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.layers.attention.cpu_backend import CpuAttnBackend
from engine.runtime.layers.cpu_kernels import KERNELS, PackedLinearC, threads
from engine.runtime.layers.linear import Linear
from engine.runtime.layers.packed import PackedWeight
from engine.runtime.layers.quant import QuantLinear

log = logging.getLogger(__name__)


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", ctypes.POINTER(PackedLinearC)),
        ("o", ctypes.POINTER(PackedLinearC)),
        ("gate_up", ctypes.POINTER(PackedLinearC)),
        ("down", ctypes.POINTER(PackedLinearC)),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ]


class _DecodeShape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("hd", ctypes.c_int64),
        ("inter", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("cos_sin", ctypes.c_void_p),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _panels(layer: Any) -> PackedWeight | None:
    """The packed weight of a QuantLinear or a ``cpu``-prepacked Linear, else None."""
    return layer.panels if isinstance(layer, (QuantLinear, Linear)) else None


class FusedDecode:
    """``fused(fb, hidden) -> (hidden, residual)`` for a DECODE batch ``takes`` accepts."""

    def __init__(self, model: Any, kv_pool: Any, backend: CpuAttnBackend, lib: Any) -> None:
        layers = list(model.layers)
        attn0 = layers[0].self_attn
        self.lib, self.backend, self.num_layers = lib, backend, len(layers)
        entries = []
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            k_buf, v_buf = kv_pool.get_kv_buffer(i)
            linears = [
                _panels(x) for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            ]
            descs = [ctypes.pointer(w.desc) for w in linears if w is not None]
            assert len(descs) == len(linears), "install() checked every weight is on panels"
            entries.append(
                _DecodeLayer(
                    _ptr(layer.input_layernorm.weight),
                    _ptr(layer.post_attention_layernorm.weight),
                    *descs,
                    _ptr(k_buf),
                    _ptr(v_buf),
                )
            )
        self.layers = (_DecodeLayer * len(entries))(*entries)
        rope = attn0.rotary_emb
        self.shape = _DecodeShape(
            layers[0].input_layernorm.hidden_size,
            attn0.num_heads,
            attn0.num_kv_heads,
            attn0.head_dim,
            layers[0].mlp.down_proj.in_features,
            layers[0].input_layernorm.eps,
            attn0.attn.scaling,
            _ptr(rope.cos_sin_cache),
        )
        # NOTE: the C side holds raw pointers into the model's weights and the pool's buffers
        self.kv_pool = kv_pool

    def takes(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode.is_decode() and self.backend.decode_rows is not None

    def __call__(self, fb: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if len(self.kv_pool.k_buffer) != self.num_layers:  # released at shutdown
            raise RuntimeError("fused decode: the KV pool's memory was released")
        hidden = hidden.contiguous()  # [bs, hidden_size] float32, overwritten in place
        residual = torch.empty_like(hidden)
        rows = self.backend.decode_rows
        assert rows is not None, "takes() said this batch has its decode rows"
        positions = fb.positions.to(torch.int64).contiguous()
        out_loc = fb.out_cache_loc.to(torch.int64).contiguous()
        r2t = fb.req_to_token_pool.req_to_token
        rc = self.lib.decode_layers(
            self.layers,
            self.num_layers,
            ctypes.byref(self.shape),
            hidden.data_ptr(),
            residual.data_ptr(),
            hidden.shape[0],
            positions.data_ptr(),
            out_loc.data_ptr(),
            r2t.data_ptr(),
            r2t.stride(0),
            rows.data_ptr(),
            threads(),
        )
        if rc == -1:
            raise MemoryError("fused decode: no memory for its scratch buffers")
        if rc != 0:
            raise RuntimeError(f"fused decode failed ({rc})")
        return hidden, residual


def install(model: torch.nn.Module, kv_pool: Any, backend: Any) -> str | None:
    """Put a ``FusedDecode`` on ``model.model`` (a Llama-family ``LlamaModel``) when this model
    and setup can take it; returns None when installed, else why not."""
    from engine.runtime.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel

    lib = KERNELS.get()
    stack = getattr(model, "model", None)
    if lib is None:
        return "no C kernels"
    if not isinstance(stack, LlamaModel):
        return f"{type(model).__name__} is not a Llama-family stack"
    if not isinstance(backend, CpuAttnBackend):
        return f"attention backend {type(backend).__name__} is not 'cpu'"
    for layer in stack.layers:
        assert isinstance(layer, LlamaDecoderLayer), "a LlamaModel holds LlamaDecoderLayers"
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, LlamaAttention):
            return f"{type(attn).__name__} is not a Llama attention"
        if type(attn).prepare_qk is not LlamaAttention.prepare_qk:
            return f"{type(attn).__name__} transforms q/k before RoPE"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(_panels(x) is None for x in linears):
            return "weights not on packed panels (linear_backend is not 'cpu')"
        if layer.input_layernorm.kernel is None or layer.post_attention_layernorm.kernel is None:
            return "norms not on the C kernel"
        if attn.rotary_emb.kernel is None:
            return "RoPE not on the C kernel (its cache is shorter than the context)"
    k_buf, _ = kv_pool.get_kv_buffer(0)
    if k_buf.dtype != torch.float32 or k_buf.device.type != "cpu":
        return "KV pool is not float32 on CPU"
    stack.fused_decode = FusedDecode(stack, kv_pool, backend, lib)
    return None
