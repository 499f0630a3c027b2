"""The tiers of the cache hierarchy, named as the API and the stats name them."""

from __future__ import annotations

from enum import StrEnum


class Tier(StrEnum):
    L1 = "l1"  # device memory: the KV pool the forward reads
    L2 = "l2"  # host memory: the host pool (HiRadixCache)
    L3 = "l3"  # storage: file or Redis objects shared across restarts and daemons


TIERS: tuple[str, ...] = tuple(t.value for t in Tier)  # plain strings, in order l1, l2, l3
MEMORY_TIERS: tuple[str, ...] = (Tier.L1.value, Tier.L2.value)  # the tiers tree nodes hold
