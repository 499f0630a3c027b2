"""HF ``architectures[0]`` -> model class."""

from __future__ import annotations

from typing import Any

from engine.runtime.models.llama import LlamaForCausalLM
from engine.runtime.models.qwen2 import Qwen2ForCausalLM
from engine.runtime.models.qwen3 import Qwen3ForCausalLM

# every family so far builds on the Llama stack (its attention, MLP and weight loading)
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

# config.model_type -> architecture, for configs saved without ``architectures``
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def architecture_of(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", None)
    if model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    raise ValueError(f"config names no architecture (model_type {model_type!r})")


def get_model_class(config: Any) -> type[LlamaForCausalLM]:
    arch = architecture_of(config)
    if arch not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[arch]
