"""The workload: shared prefixes (system prompts), namespaces, multi-turn conversations as
token ids, random sampling parameters, and the greedy check prompts."""

from __future__ import annotations

import random
from typing import Any

from tools.soaklib.config import SoakConfig


class Workload:
    """Shared prefixes (system prompts), per-conversation namespaces, the greedy check prompts."""

    NAMESPACES = ("", "", "soak-a", "soak-b")

    def __init__(self, vocab_size: int, cfg: SoakConfig) -> None:
        rng = random.Random(cfg.seed)
        self.cfg = cfg
        self.lo, self.hi = min(32, vocab_size // 8), vocab_size
        self.prefixes = [self.ids(rng, rng.randint(*cfg.prefix_tokens)) for _ in range(3)]
        n = max(1, cfg.check_prompts)
        # sharing the traffic's prefixes: the checks meet whatever the cache holds of them
        self.check_prompts = [self.prefixes[i % 3] + self.ids(rng, 8 + 3 * i) for i in range(n - 1)]
        self.check_prompts.append(self.ids(rng, cfg.prefix_tokens[0]))

    def ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]

    def sampling(self, rng: random.Random) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": rng.randint(1, self.cfg.max_new_tokens),
            "ignore_eos": rng.random() < 0.7,
        }
        if rng.random() < 0.6:
            sp["temperature"] = 0.0
        else:
            sp.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 31))
        return sp


class Conversation:
    """A multi-turn chat as token ids: a shared prefix, then question / answer turns."""

    def __init__(self, wl: Workload, rng: random.Random) -> None:
        self.wl = wl
        self.ns = rng.choice(Workload.NAMESPACES)
        self.ids = list(rng.choice(wl.prefixes)) + wl.ids(rng, rng.randint(*wl.cfg.question_tokens))
        self.turns = 0

    def advance(self, answer: list[int], rng: random.Random) -> bool:
        """Appends the answer and a new question; False when the conversation is over."""
        self.turns += 1
        self.ids += answer + self.wl.ids(rng, rng.randint(*self.wl.cfg.question_tokens))
        limit = self.wl.cfg.max_prompt_tokens - self.wl.cfg.max_new_tokens - 64
        return self.turns < 6 and len(self.ids) < limit


def choose(rng: random.Random, table: tuple[tuple[str, int], ...]) -> str:
    """A name from ``table`` of (name, weight)."""
    return rng.choices([a for a, _ in table], weights=[w for _, w in table])[0]
