"""Rotary position embedding (neox / HF ``rotate_half`` layout) with a precomputed cos/sin
cache indexed by absolute positions; ``default``, ``linear`` and ``llama3`` scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from engine.runtime.layers.cpu_kernels import threads


def rope_params_from_config(config: Any) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, scaling)`` from an HF config: transformers>=5 ``rope_parameters`` or the
    older ``rope_theta`` + ``rope_scaling`` attributes. ``scaling`` has at least ``rope_type``."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return float(theta), params


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``[num_tokens, heads, head_dim]`` tensors given ``positions [num_tokens]``."""

    cos_sin_cache: torch.Tensor  # a buffer: [max_position, head_dim] on device

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        rope_theta: float = 10000.0,
        scaling: dict[str, Any] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        scaling = scaling or {"rope_type": "default"}
        rope_type = scaling.get("rope_type", "default")
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (rope_theta**exponent)  # [head_dim / 2]
        t = torch.arange(max_position, dtype=torch.int64).float()
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            t = t / scaling["factor"]
        elif rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        # [max_position, head_dim] on device: cos half | sin half
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=device, dtype=dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._positions: torch.Tensor | None = None
        # the C kernel (cpu_kernels) when the fast CPU path is on: RoPE in place, one call
        self.kernel: Any = None
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] = (cache, cache)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos | cos`` and ``-sin | sin``, each ``[num_tokens, 1, head_dim]``; reused while
        ``positions`` is the same tensor (one model forward shares one RotaryEmbedding across
        its layers, so this runs once per forward, not once per layer)."""
        if positions is not self._positions:
            cos, sin = self.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
            self._positions = positions
            self._cos_sin = (torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))
        return self._cos_sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions [num_tokens]; x [num_tokens, heads, head_dim] = x1 | x2 (halves)
        if (
            self.kernel is not None
            and x.dtype == torch.float32
            and x.stride(2) == 1
            and x.stride(1) == self.head_dim
            and positions.dtype == torch.int64
        ):
            # NOTE: in place (x is a view of the fresh qkv projection)
            positions = positions.contiguous()
            self.kernel.rope_neox_inplace(
                x.data_ptr(),
                x.shape[0],
                x.stride(0),
                x.shape[1],
                self.head_dim,
                positions.data_ptr(),
                self.cos_sin_cache.data_ptr(),
                threads(),
            )
            return x
        # out = (x1 * cos - x2 * sin) | (x2 * cos + x1 * sin) = x * (cos|cos) + (x2|x1) * (-sin|sin)
        cos2, sin2 = self.cos_sin(positions)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.addcmul(x * cos2, torch.cat((x2, x1), dim=-1), sin2)


def get_rope(
    config: Any,
    head_dim: int,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> RotaryEmbedding:
    """The model's RotaryEmbedding from its HF config."""
    theta, scaling = rope_params_from_config(config)
    max_position = int(getattr(config, "max_position_embeddings", 4096))
    return RotaryEmbedding(head_dim, max_position, theta, scaling, device, dtype)
