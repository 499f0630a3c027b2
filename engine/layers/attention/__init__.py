"""Attention backends behind one protocol, created by name.

``create_backend(name, model_runner_or_config)``: ``torch_native`` (reference, CPU and any
device); GPU backends register themselves here under their own names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.forward_batch import ForwardBatch
    from engine.layers.radix_attention import RadixAttention


class AttentionBackend(Protocol):
    """Owns the per-batch attention metadata and runs every layer's attention."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Called once per batch, before the layers run."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        """q [num_tokens, heads*head_dim]; k, v [num_tokens, kv_heads*head_dim]. Writes k/v at
        ``fb.out_cache_loc`` into the pool (``layer.layer_id``), then attends over each request's
        whole KV (``req_to_token[req, :seq_len]``); returns [num_tokens, heads*head_dim]."""
        ...


BackendFactory = Callable[[Any], AttentionBackend]

# name -> "module:attr" (imported on first use) or a registered factory
_BACKENDS: dict[str, str | BackendFactory] = {
    "torch_native": "engine.layers.attention.torch_native:TorchNativeAttnBackend",
    "triton": "engine.layers.attention.triton_backend:TritonAttnBackend",
}


def register_backend(name: str, factory: str | BackendFactory) -> None:
    """Register a backend factory (or its ``"module:attr"`` path) under ``name``."""
    _BACKENDS[name] = factory


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def create_backend(name: str, model_runner_or_config: Any = None) -> AttentionBackend:
    """A new backend ``name``, given the model runner (or its config) to size itself from."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {available_backends()}")
    factory = _BACKENDS[name]
    if isinstance(factory, str):
        module_name, attr = factory.split(":")
        factory = getattr(importlib.import_module(module_name), attr)
    return factory(model_runner_or_config)


__all__ = ["AttentionBackend", "available_backends", "create_backend", "register_backend"]
