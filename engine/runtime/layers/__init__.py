"""Model building blocks: attention (RadixAttention + backends), rotary, norm, linear."""

from __future__ import annotations

from engine.runtime.layers.linear import Embedding, Linear, MergedLinear
from engine.runtime.layers.norm import RMSNorm
from engine.runtime.layers.radix_attention import RadixAttention
from engine.runtime.layers.rotary import RotaryEmbedding, get_rope

__all__ = [
    "Embedding",
    "Linear",
    "MergedLinear",
    "RMSNorm",
    "RadixAttention",
    "RotaryEmbedding",
    "get_rope",
]
