"""L3Admission: which waiting requests read their L3 hit into L2, and when a request whose
prefetch is in flight may be admitted (the prefetch policy decides). Part of ``L3Tier``; the
scheduler reaches it through BasePrefixCache's ``l3_*`` methods.

A request's L3 prefetch starts on arrival, and again if its prefix was evicted while it waited
(its object keys are hashed once). At its turn, ``ready`` asks whether its prefetch may still
be waited for; L2 without room for it takes the room of the landed prefetches of requests that
go after it. What the tier knows of a request (``L3Progress``) lives from its first match until
``forget`` (it finished, was aborted or failed); a retracted request keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from hicache.tree.request import CacheRequest

if TYPE_CHECKING:
    from hicache.l3.tier import L3Tier

R = TypeVar("R", bound=CacheRequest)


@dataclass
class L3Progress:
    """What the tier knows of a waiting request's L3 prefetch."""

    keys: list[str] | None = None  # its L3 object keys (hashed once)
    hit: int = 0  # tokens of its prefix L3 held when last asked
    tokens: int = 0  # tokens its own L3 prefetch put in the tree
    matched_seen: int = 0  # longest L1 + L2 match seen while waiting


class L3Admission:
    """The L3 admission decisions, with each request's ``L3Progress`` by request id."""

    def __init__(self, tier: L3Tier) -> None:
        self.tier = tier
        self.progress: dict[str, L3Progress] = {}

    def _of(self, req: CacheRequest) -> L3Progress:
        p = self.progress.get(req.rid)
        if p is None:
            p = self.progress[req.rid] = L3Progress()
        return p

    def start(self, req: CacheRequest) -> int:
        """Read what L3 holds beyond the request's match (``req.kv.match_result``, set by the
        scheduler before) into L2; returns the tokens the started prefetch will add."""
        if not self.tier.has_storage():
            return 0
        match = req.kv.match_result
        if match is None:
            raise AssertionError("a request's prefetch starts after its match")
        prefetch, p = self.tier.prefetch, self._of(req)
        key = req.kv.fill_ids[: len(req.kv.fill_ids) - 1]
        if p.keys is None:
            p.keys = prefetch.prefetch_keys(key, req.cache_namespace)
        res = prefetch.start_prefetch(req.rid, key, req.cache_namespace, match, keys=p.keys)
        p.hit = res.in_l3
        return res.tokens

    def matched(self, req: CacheRequest) -> None:
        """The request was matched again (the tree changed): if its prefix was evicted while it
        waited, L3 may still hold it."""
        p = self._of(req)
        matched = len(req.kv.prefix_indices) + req.kv.host_hit_length
        if matched < p.matched_seen:
            self.start(req)
        p.matched_seen = max(p.matched_seen, matched)

    def ready(self, req: R, behind: Sequence[R], rematch: Callable[[R], None]) -> bool:
        """May ``req`` be admitted now (prefetch policy)? ``behind``: the waiting requests that
        go after it; ``rematch``: the scheduler's (re)match of a waiting request."""
        got = self.tier.prefetch.poll_prefetch(req.rid)
        if got is None:
            return False
        p = self._of(req)
        if got == 0 and p.hit > len(req.kv.prefix_indices) + req.kv.host_hit_length:
            # L3 holds more than the tree and nothing is being read (L2 was full when it
            # last tried): try now; the policy then decides how long to wait for it
            rematch(req)
            if self.start(req) or self._take_room_of(req, behind):
                return False
        p.tokens = got or p.tokens
        return True

    def admitted(self, req: CacheRequest) -> int:
        """The request was admitted: its prefetch's state goes. Returns the tokens its own
        prefetch put in the tree (its match counts them as L2; they came from L3)."""
        self.tier.prefetch.finish_prefetch(req.rid)
        p = self.progress.get(req.rid)
        return p.tokens if p is not None else 0

    def forget(self, req: CacheRequest) -> None:
        """The request went away (finished, aborted, failed): stop its prefetch, give its host
        slots back, drop its progress."""
        self.tier.prefetch.cancel_prefetch(req.rid)
        self.progress.pop(req.rid, None)

    def l3_hit(self, req: CacheRequest) -> int:
        """Tokens of the request's prefix L3 held when last asked (0: never asked)."""
        p = self.progress.get(req.rid)
        return p.hit if p is not None else 0

    def _take_room_of(self, req: CacheRequest, behind: Sequence[CacheRequest]) -> int:
        """L2 had no room for ``req``'s prefetch: the prefetches of requests that go after it
        give theirs, the last in the order first, and its prefetch starts.
        NOTE: otherwise L2 fills with the landed prefetches of requests the cache order keeps
        waiting, and the requests admitted recompute what L3 holds (docs/benchmarks.md)."""
        prefetch = self.tier.prefetch
        if prefetch.has_prefetch(req.rid):
            return 0
        need = self._of(req).hit - len(req.kv.prefix_indices) - req.kv.host_hit_length
        if need < prefetch.prefetch_threshold:
            return 0
        freed = 0
        for r in reversed(behind):
            if freed >= need:
                break
            n = prefetch.yield_prefetch(r.rid)
            # what landed stays in L2 until evicted: it still came from L3
            q = self._of(r)
            q.tokens = max(q.tokens, n)
            freed += n
        return self.start(req) if freed else 0
