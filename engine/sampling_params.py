"""SamplingParams: a request's sampling options and their validation, at the edge.

Built from a sampling_params dict (``from_dict``: unknown names refused) and checked before
anything is queued (``validate``; with the vocabulary size once it is known, by
TokenizerManager.prepare); the scheduler process' Sampler (engine/runtime/sampling.py) reads
them. Bad input is a ValueError everywhere (HTTP 400, gRPC INVALID_ARGUMENT). Torch-free: the
split daemon's API server builds them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 = no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # One chunk at the end instead of one per token (vLLM's RequestOutputKind.FINAL_ONLY): for
    # callers that wait for the whole output (non-streaming HTTP, Engine.generate); in the split
    # daemon each chunk is a message through the detokenizer process to the API server
    final_only: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        unknown = sorted(set(d) - _KNOWN)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        p = cls(**d)
        p.validate()
        return p

    def validate(self, vocab_size: int | None = None) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not isinstance(self.final_only, bool):
            # NOTE: bad input is a ValueError everywhere (HTTP 400 / INVALID_ARGUMENT)
            raise ValueError(f"final_only must be true or false, got {self.final_only!r}")  # noqa: TRY004
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids contains an invalid token id {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


_KNOWN = frozenset(f.name for f in fields(SamplingParams))  # a sampling_params dict's names
