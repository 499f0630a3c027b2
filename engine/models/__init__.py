"""Model implementations (Llama, Qwen2, Qwen3), the architecture registry and the loader."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM
from engine.models.registry import MODEL_REGISTRY, architecture_of, get_model_class

__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "architecture_of",
    "get_model_class",
]
