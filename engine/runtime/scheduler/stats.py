"""Counters the scheduler keeps, and the cache's figures with them (``cache_stats``:
hicache.observe.stats.CacheStats, on the scheduler thread)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.runtime.scheduler import invariants
from hicache.observe.stats import CacheStats
from hicache.tier import TIERS

if TYPE_CHECKING:
    from engine.runtime.scheduler.scheduler import Scheduler


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


def cache_stats(scheduler: Scheduler) -> CacheStats:
    """Every tier's figures (``CacheManager.tier_stats``) and the scheduler's counters."""
    c = scheduler.counters
    held = int(invariants.scheduler_held_slots(scheduler).numel())
    tiers = scheduler.cache_manager.tier_stats(held_tokens=held)
    return CacheStats(
        l1=tiers.l1,
        l2=tiers.l2,
        l3=tiers.l3,
        prompt_tokens=c.prompt_tokens,
        miss_tokens=c.miss_tokens,
        requests=c.requests,
        finished_requests=c.finished,
        retractions=c.retractions,
        running_requests=len(scheduler.running),
        waiting_requests=len(scheduler.waiting),
    )
