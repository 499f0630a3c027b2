"""transformers' own greedy decode: the reference that tests and benchmarks compare the engine's
tokens with (a transformers model, one prompt at a time, every new token decoded: no stop at
an end-of-sequence token)."""

from __future__ import annotations

from typing import Any

import torch


def greedy_reference(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's ``new_tokens`` greedy tokens from ``model.generate``."""
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outs.append(y[0, len(ids) :].tolist())
    return outs
