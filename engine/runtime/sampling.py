"""The batched sampler (its parameters: SamplingParams, engine/sampling_params.py)."""

from __future__ import annotations

from typing import Any

import torch

from engine.sampling_params import SamplingParams


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
