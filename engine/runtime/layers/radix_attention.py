"""RadixAttention: the attention layer the models call; the batch's backend does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    """Holds one layer's attention geometry; ``forward`` delegates to ``fb.attn_backend``,
    which writes this layer's new K/V into the pool and attends over each request's KV."""

    def __init__(
        self,
        layer_id: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} not a multiple of kv heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = head_dim**-0.5 if scaling is None else scaling

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        # q [num_tokens, heads*head_dim]; k, v [num_tokens, kv_heads*head_dim]
        # NOTE: attention for layer i runs only after layer i's KV is on device: block here on
        # an in-flight HiCache load (layer-wise overlap), before the backend reads/writes the pool.
        if fb.wait_layer is not None:
            fb.wait_layer(self.layer_id)
        return fb.attn_backend.forward(q, k, v, self, fb)  # [num_tokens, heads*head_dim]

    def extra_repr(self) -> str:
        return (
            f"layer_id={self.layer_id}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}"
        )
