"""Incremental detokenization: emit text only once it is stable (no partial UTF-8 sequence)."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Keeps offsets into a request's output ids, decoding a small window each step (as HF's
    TextStreamer and SGLang's detokenizer manager do), so streaming costs O(window) per token."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # all text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def step(self, output_ids: list[int], final: bool = False) -> str:
        """Returns the new text delta for output_ids (all output tokens so far); always "" for a
        model without a tokenizer (token-id prompts and outputs only)."""
        if self.tokenizer is None:
            return ""
        prefix_text = self._decode(output_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(output_ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            delta = new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(output_ids)
            self.text += delta
            return delta
        return ""
