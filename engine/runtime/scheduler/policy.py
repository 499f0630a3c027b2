"""SchedulePolicy: the order in which waiting requests are considered.

Aging (``lpm``, ``dfs-weight``): cache-aware orders serve well-cached requests first, which
wins on the median but, without aging, lets follow-up turns overtake a first turn forever. A
request that ``max_bypass`` later arrivals have overtaken (``req.admission.bypassed``, counted
at admission) is *aged*: it goes ahead of the cache-ordered rest, in arrival order.
NOTE: aging that lets old requests go first too early makes the waiting follow-ups lose their
cached prefixes (the median falls to fcfs's); aging late costs the tail, since cold requests that
arrive together wait for ``max_bypass`` warm ones each. The default (20) and the alternatives
measured under pressure are in docs/benchmarks.md.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from engine.runtime.request import Req
from hicache.tree.base import BasePrefixCache
from hicache.tree.node import TreeNode

# Above this many waiting requests LPM's per-request prefix matching costs more than it saves.
LPM_FALLBACK_TO_FCFS = 128
# A request whose cached prefix is shorter than this, but which shares this many leading tokens
# with an earlier waiting request, waits one round so that the earlier one caches the prefix.
IN_BATCH_PREFIX_THRESHOLD = 32


class SchedulePolicy:
    def __init__(
        self,
        policy: str,
        tree_cache: BasePrefixCache,
        l3_hit: Callable[[Req], int],
        seed: int = 0,
        max_bypass: int = 0,
    ):
        self.policy = policy
        self.tree_cache = tree_cache  # dfs-weight walks its tree
        self.l3_hit = l3_hit  # tokens of a request's prefix L3 held (CacheManager.l3_hit)
        self.rng = random.Random(seed)
        self.max_bypass = max_bypass

    def calc_priority(self, waiting: list[Req], match_fn: Callable[[Req], None]) -> set[str]:
        """Sorts `waiting` in place; returns rids deprioritized by in-batch prefix dedup.
        match_fn(req) computes req.kv.prefix_indices / req.kv.last_node from the tree."""
        policy = self.policy
        if policy == "lpm" and len(waiting) > LPM_FALLBACK_TO_FCFS:
            policy = "fcfs"
        for r in waiting:
            match_fn(r)
        deprioritized = self._in_batch_dedup(waiting)
        aging = self.max_bypass > 0 and policy in ("lpm", "dfs-weight")

        def aged(r: Req) -> bool:
            return aging and r.admission.bypassed >= self.max_bypass

        if policy == "lpm":
            # cached = device + host part, or what L3 holds (loads are far cheaper than a
            # recompute: a request whose prefix was evicted while it waited keeps its place)
            waiting.sort(
                key=lambda r: (
                    (0, r.admission.created, 0)
                    if aged(r)
                    else (
                        1,
                        r.rid in deprioritized,
                        -max(
                            len(r.kv.prefix_indices) + r.kv.host_hit_length,
                            self.l3_hit(r),
                        ),
                    )
                )
            )
        elif policy == "dfs-weight":
            self._sort_dfs_weight(waiting)
            # stable: keeps DFS order among the young
            waiting.sort(
                key=lambda r: (0, r.admission.created) if aged(r) else (1, r.rid in deprioritized)
            )
        elif policy == "lof":
            waiting.sort(key=lambda r: (r.rid in deprioritized, -r.max_new_tokens))
        elif policy == "random":
            self.rng.shuffle(waiting)
            waiting.sort(key=lambda r: r.rid in deprioritized)
        else:  # fcfs: arrival order, deduped requests last
            waiting.sort(key=lambda r: r.rid in deprioritized)
        return deprioritized

    @staticmethod
    def count_bypasses(waiting: list[Req], admitted: list[Req]) -> None:
        """``admitted`` went ahead of ``waiting``: each waiting request counts the admitted
        ones that arrived after it."""
        times = sorted(r.admission.created for r in admitted)
        for r in waiting:
            r.admission.bypassed += len(times) - bisect.bisect_right(times, r.admission.created)

    def _in_batch_dedup(self, waiting: list[Req]) -> set[str]:
        seen: set[tuple[str | None, tuple[int, ...]]] = set()
        out: set[str] = set()
        for r in waiting:
            if len(r.kv.prefix_indices) > IN_BATCH_PREFIX_THRESHOLD:
                continue
            ids = r.kv.fill_ids
            if len(ids) <= IN_BATCH_PREFIX_THRESHOLD:
                continue
            key = (r.cache_namespace, tuple(ids[:IN_BATCH_PREFIX_THRESHOLD]))
            if key in seen:
                out.add(r.rid)
            else:
                seen.add(key)
        return out

    def _sort_dfs_weight(self, waiting: list[Req]) -> None:
        """Visit the tree depth first, heavier subtrees (more waiting requests) first."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        nodes: dict[int, Any] = {}
        root = self.tree_cache.root_node
        for r in waiting:
            cur: TreeNode | None = r.kv.last_node if r.kv.last_node is not None else root
            by_node[id(cur)].append(r)
            while cur is not None:
                nodes[id(cur)] = cur
                weight[id(cur)] += 1
                cur = cur.parent
        order: list[Req] = []
        stack = [root]
        while stack:
            node = stack.pop()
            order.extend(by_node.get(id(node), []))
            kids = [c for c in node.children.values() if id(c) in weight]
            kids.sort(key=lambda c: weight[id(c)])  # heaviest popped first
            stack.extend(kids)
        waiting[:] = order
