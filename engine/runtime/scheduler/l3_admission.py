"""L3Admission: which waiting requests read their L3 hit into L2, and when a request whose
prefetch is in flight may be admitted (the cache's prefetch policy decides).

A request's L3 prefetch starts on arrival, and again if its prefix was evicted while it waited
(its object keys are hashed once). At its turn, ``ready`` asks the cache whether its prefetch
may still be waited for; L2 without room for it takes the room of the landed prefetches of
requests that go after it.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.runtime.request import Req
from hicache.base_prefix_cache import BasePrefixCache


class L3Admission:
    def __init__(self, tree_cache: BasePrefixCache, match: Callable[[Req], None]) -> None:
        self.tree_cache = tree_cache
        self.match = match  # the scheduler's (re)match of a waiting request

    def start(self, req: Req) -> int:
        """Read what L3 holds beyond the request's match (``req.match_result``, set by the
        scheduler before) into L2; returns the tokens the started prefetch will add."""
        if not self.tree_cache.has_storage():
            return 0
        assert req.match_result is not None, "a request's prefetch starts after its match"
        key = req.fill_ids[: len(req.fill_ids) - 1]
        if req.l3.keys is None:
            req.l3.keys = self.tree_cache.prefetch_keys(key, req.cache_namespace)
        res = self.tree_cache.start_prefetch(req.rid, key, req.cache_namespace, req.match_result,
                                             keys=req.l3.keys)
        req.l3.hit = res.in_l3
        return res.tokens

    def ready(self, req: Req, behind: list[Req]) -> bool:
        """May ``req`` be admitted now (prefetch policy)? ``behind``: the waiting requests that
        go after it."""
        got = self.tree_cache.poll_prefetch(req.rid)
        if got is None:
            return False
        if got == 0 and req.l3.hit > len(req.prefix_indices) + req.host_hit_length:
            # L3 holds more than the tree and nothing is being read (L2 was full when it
            # last tried): try now; the policy then decides how long to wait for it
            self.match(req)
            if self.start(req) or self._take_room_of(req, behind):
                return False
        req.l3.tokens = got or req.l3.tokens
        return True

    def admitted(self, req: Req) -> None:
        """The request was admitted: its prefetch's state goes."""
        self.tree_cache.finish_prefetch(req.rid)

    def cancel(self, req: Req) -> None:
        """The request went away: stop its prefetch, give its host slots back."""
        self.tree_cache.cancel_prefetch(req.rid)

    def _take_room_of(self, req: Req, behind: list[Req]) -> int:
        """L2 had no room for ``req``'s prefetch: the prefetches of requests that go after it
        give theirs, the last in the order first, and its prefetch starts.
        NOTE: otherwise L2 fills with the landed prefetches of requests the cache order keeps
        waiting, and the requests admitted recompute what L3 holds (docs/benchmarks.md)."""
        tc = self.tree_cache
        if tc.has_prefetch(req.rid):
            return 0
        need = req.l3.hit - len(req.prefix_indices) - req.host_hit_length
        if need < tc.prefetch_threshold:
            return 0
        freed = 0
        for r in reversed(behind):
            if freed >= need:
                break
            n = tc.yield_prefetch(r.rid)
            # what landed stays in L2 until evicted: it still came from L3
            r.l3.tokens = max(r.l3.tokens, n)
            freed += n
        return self.start(req) if freed else 0
