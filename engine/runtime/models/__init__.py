"""Model implementations (Llama, Qwen2, Qwen3), the architecture registry and the loader."""

from __future__ import annotations

from engine.runtime.models.llama import LlamaForCausalLM
from engine.runtime.models.qwen2 import Qwen2ForCausalLM
from engine.runtime.models.qwen3 import Qwen3ForCausalLM
from engine.runtime.models.registry import MODEL_REGISTRY, architecture_of, get_model_class

__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "architecture_of",
    "get_model_class",
]
