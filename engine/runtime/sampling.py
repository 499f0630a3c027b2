"""Sampling parameters (validated at the edge) and the batched sampler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

_KNOWN = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "final_only",
}


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


class Sampler:
    """Samples one token per row. Greedy rows take argmax; others go through temperature,
    top-k, top-p and min-p filtering, then an exponential race (argmax of p / Exp(1)) so that a
    per-request torch.Generator gives reproducible draws without per-token Python loops.

    ``batch_invariant`` (deterministic inference on CUDA): the softmax and top-p's running sum
    run one row per program (torch's CUDA scan lays rows out by the row count) and the sort is
    stable (ties in a fixed order), so a seeded row's draw does not depend on its neighbours."""

    def __init__(self, batch_invariant: bool = False) -> None:
        self.row_ops: Any = None
        if batch_invariant:
            from engine.runtime.layers import batch_invariant as row_ops  # Triton: when used

            self.row_ops = row_ops

    def _softmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.row_ops.softmax(x) if self.row_ops else torch.softmax(x, dim=-1)

    def _cumsum(self, x: torch.Tensor) -> torch.Tensor:
        return self.row_ops.cumsum(x) if self.row_ops else x.cumsum(dim=-1)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        # logits [bs, vocab] on device -> [bs] int64
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_ids
        device = logits.device
        temps = torch.tensor([max(p.temperature, 1e-5) for p in params], device=device)
        probs = self._softmax(logits.float() / temps[:, None])  # [bs, vocab]
        top_ks = [p.top_k for p in params]
        if any(k > 0 for k in top_ks):
            vocab = probs.shape[-1]
            k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device)
            k = k.clamp(max=vocab)
            kth = probs.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if any(p.top_p < 1.0 for p in params):
            top_ps = torch.tensor([p.top_p for p in params], device=device)
            sorted_p, order = probs.sort(dim=-1, descending=True, stable=self.row_ops is not None)
            cum = self._cumsum(sorted_p)
            # keep the smallest set whose mass reaches top_p (always keep the first token)
            drop = (cum - sorted_p) > top_ps[:, None] * cum[:, -1:]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
        if any(p.min_p > 0.0 for p in params):
            min_ps = torch.tensor([p.min_p for p in params], device=device)
            thresh = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
            probs = torch.where(probs >= thresh, probs, torch.zeros_like(probs))
        noise = torch.empty_like(probs).exponential_()
        for i, g in enumerate(generators):  # per request (not per token): seeded rows only
            if g is not None:
                noise[i] = torch.empty(probs.shape[1], device=device).exponential_(generator=g)
        sampled = (probs / noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(is_greedy, greedy_ids, sampled)
