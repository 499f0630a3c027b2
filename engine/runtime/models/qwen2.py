"""Qwen2: the Llama decoder with a bias on q/k/v (none on o_proj)."""

from __future__ import annotations

from typing import Any

from engine.runtime.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_biases(cls, config: Any) -> tuple[bool, bool]:
        return True, False
