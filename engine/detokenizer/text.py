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


class TextStream:
    """One request's text: incremental detokenization plus stop strings. The scheduler uses it
    in-process (and for stop strings in the split daemon), the detokenizer process for the
    streamed text; both see the same ids in the same steps, so both cut at the same place."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, stop: list[str]):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = stop

    @property
    def text(self) -> str:
        return self.detok.text

    def step(self, output_ids: list[int], final: bool, drop_last: bool) -> tuple[str, str | None]:
        """(new text, the stop string it hit or None) for all output ids so far. `final`: the
        request finished for a reason other than a stop string; `drop_last`: its last token is
        the stop token, which is not part of the text."""
        ids = output_ids[:-1] if drop_last else output_ids
        delta = self.detok.step(ids, final=final)
        if not self.stop or final:
            return delta, None
        hit = _find_stop(self.detok.text, self.stop, len(delta))
        if hit is None:
            return delta, None
        stop, cut = hit
        drop = len(self.detok.text) - cut
        delta = delta[: len(delta) - drop] if drop <= len(delta) else ""
        self.detok.text = self.detok.text[:cut]
        return delta, stop


def _find_stop(text: str, stops: list[str], delta_len: int) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the newest text; returns (stop, cut position)."""
    best: tuple[str, int] | None = None
    for s in stops:
        start = max(0, len(text) - delta_len - len(s) + 1)
        pos = text.find(s, start)
        if pos != -1 and (best is None or pos < best[1]):
            best = (s, pos)
    return best
