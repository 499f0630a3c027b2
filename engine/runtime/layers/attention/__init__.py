"""Attention backends behind one protocol, created by name.

``create_backend(name, model_runner_or_config)``: ``torch_native`` (reference, CPU and any
device), ``triton`` and ``flashinfer`` (CUDA); ``default_backend(device)`` picks one.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention


class AttentionBackend(Protocol):
    """Owns the per-batch attention metadata and runs every layer's attention."""

    # EXTEND reads the KV of slots still loading from host memory (``fb.host_reads``) in place,
    # so the scheduler may hold an L2 hit's load until after the forward (the CPU backends)
    reads_host_kv: bool
    # its DECODE forward can be captured in a CUDA graph (it is a CudaGraphAttentionBackend)
    supports_cuda_graph: bool

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


class CudaGraphAttentionBackend(AttentionBackend, Protocol):
    """A backend whose DECODE forward can be captured in a CUDA graph (``supports_cuda_graph``).

    ``init_cuda_graph_state`` once; per captured batch size ``init_forward_metadata_capture``
    (padded static tensors, outside capture) then the captured ``forward`` calls; before each
    replay ``init_forward_metadata_replay`` (padded requests: seq_len 1, slot
    ``req_to_token[row, 0]``)."""

    def init_cuda_graph_state(self, max_bs: int, max_num_kv_tokens: int) -> None: ...

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None: ...

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None: ...


BackendFactory = Callable[[Any], AttentionBackend]

# name -> "module:attr" (imported on first use) or a registered factory
_BACKENDS: dict[str, str | BackendFactory] = {
    "torch_native": "engine.runtime.layers.attention.torch_native:TorchNativeAttnBackend",
    "cpu": "engine.runtime.layers.attention.cpu_backend:CpuAttnBackend",
    "triton": "engine.runtime.layers.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "engine.runtime.layers.attention.flashinfer_backend:FlashInferAttnBackend",
}


def register_backend(name: str, factory: str | BackendFactory) -> None:
    """Register a backend factory (or its ``"module:attr"`` path) under ``name``."""
    _BACKENDS[name] = factory


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def default_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """``torch_native`` off CUDA; on CUDA ``flashinfer`` when installed (it has no float32
    kernels: float32 gets ``triton``), else ``triton``."""
    if device.type != "cuda":
        return "torch_native"
    if dtype == torch.float32 or importlib.util.find_spec("flashinfer") is None:
        return "triton"
    return "flashinfer"


def deterministic_of(model_runner_or_config: Any) -> bool:
    """Whether a backend runs its deterministic (fixed split size) path: the model runner's
    resolved ``deterministic`` (the flag, on CUDA only), else a config's
    ``enable_deterministic_inference``."""
    if hasattr(model_runner_or_config, "deterministic"):
        return bool(model_runner_or_config.deterministic)
    return bool(getattr(model_runner_or_config, "enable_deterministic_inference", False))


def create_backend(name: str, model_runner_or_config: Any = None) -> AttentionBackend:
    """A new backend ``name``, given the model runner (or its config) to size itself from."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {available_backends()}")
    factory = _BACKENDS[name]
    if isinstance(factory, str):
        module_name, attr = factory.split(":")
        factory = getattr(importlib.import_module(module_name), attr)
    return factory(model_runner_or_config)


__all__ = [
    "AttentionBackend",
    "CudaGraphAttentionBackend",
    "available_backends",
    "create_backend",
    "default_backend",
    "deterministic_of",
    "register_backend",
]
