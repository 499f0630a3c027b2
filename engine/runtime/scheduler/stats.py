"""Counters the scheduler keeps for cache_stats() (hicache.observe.stats.CacheStats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hicache.tier import TIERS


@dataclass
class CacheCounters:
    hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    miss_tokens: int = 0
    prompt_tokens: int = 0
    requests: int = 0
    finished: int = 0
    retractions: int = 0

    def record_match(self, per_tier: dict[str, int], miss: int) -> None:
        for tier, n in per_tier.items():
            self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + n
        self.miss_tokens += miss
        self.prompt_tokens += sum(per_tier.values()) + miss
        self.requests += 1

    def reset(self) -> None:
        """Zero every counter (e.g. after the daemon's warm-up request)."""
        vars(self).update(vars(CacheCounters()))
