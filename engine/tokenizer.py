"""The request front: prompts (text, token ids or chat messages) to validated token ids, and
sampling dicts to SamplingParams. The in-process Engine and the split daemon's API server both
use it, so a prompt is checked the same way wherever it arrives."""

from __future__ import annotations

from typing import Any

from engine.front import Prompt
from engine.sampling_params import SamplingParams


class TokenizerManager:
    def __init__(self, tokenizer: Any, vocab_size: int, max_context_len: int):
        self.tokenizer = tokenizer  # None for models without one (token-id prompts only)
        self.vocab_size = vocab_size
        self.max_context_len = max_context_len

    def tokenize(self, prompt: Prompt, chat: bool = False) -> list[int]:
        tok = self.tokenizer
        is_chat = (
            isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
        )
        if (isinstance(prompt, str) or is_chat) and tok is None:
            raise ValueError("this model has no tokenizer: send prompts as token id lists")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty")
            if chat:
                prompt, is_chat = [{"role": "user", "content": prompt}], True
            else:
                return list(tok.encode(prompt))
        if is_chat:
            return list(
                tok.apply_chat_template(
                    prompt, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
        ids = [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
        if len(ids) != len(prompt):
            raise ValueError("token id prompts must contain only integers")
        bad = [t for t in ids if t < 0 or t >= self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of the vocabulary [0, {self.vocab_size})")
        return ids

    def prepare(
        self, prompt: Prompt, sampling_params: dict | None, chat: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """Token ids and sampling parameters for a request, or ValueError saying what is wrong."""
        params = SamplingParams.from_dict(sampling_params)
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt, chat)
        if not ids:
            raise ValueError("prompt is empty after tokenization")
        if len(ids) >= self.max_context_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; the context limit is "
                f"{self.max_context_len} including at least one output token"
            )
        return ids, params
