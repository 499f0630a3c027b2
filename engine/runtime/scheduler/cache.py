"""CacheManager: what the scheduler asks of the prefix cache, in one place. It owns a waiting
request's match, its L3 admission, its load back at admission and the hit that admission counts
per tier, and the host reads and layer waits around each forward. The scheduler keeps the loop
and the batch choice; the cache (hicache/) never calls back into it.

A request through the tiers:

    arrive     ``match``: the L1 + L2 match (``tree.match_prefix``, touch=False), kept until the
               tree changes (``tree.version``); L3 (``tree.l3``, attached): what it holds beyond
               the match starts reading into L2 (``l3.prefetch.start_prefetch``)
    its turn   ``ready``: may it be admitted while its L3 read runs (the prefetch policy,
               ``poll_prefetch``)? L2 without room for the read takes the room of the landed
               reads of the requests behind it (``yield_prefetch``)
    admitted   ``load_back``: its L2 part is loaded to L1 (``tree.host.load_back``, overlapping
               the next forward); ``count_hit``: its hit per tier, counted once, the tokens its
               own L3 read put in L2 counted as L3's
    forward    ``before_forward`` / ``after_forward``: the forward waits for the load layer by
               layer, or (a CPU prefill) reads the loading KV from host in place
    gone       ``forget``: its L3 read stops, its state goes

What L3 admission knows of a request (``L3Progress``) lives from its first match until
``forget`` (it finished, was aborted or failed); a retracted request keeps it.
NOTE: every method runs on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.request import Req
from engine.runtime.scheduler.stats import CacheCounters
from hicache.observe.stats import TierSet, tier_stats
from hicache.tier import Tier
from hicache.tree.base import BasePrefixCache
from hicache.tree.request import locked_node

L1, L2, L3 = (t.value for t in Tier)


@dataclass
class L3Progress:
    """What L3 admission knows of a waiting request's L3 read."""

    keys: list[str] | None = None  # its L3 object keys (hashed once)
    hit: int = 0  # tokens of its prefix L3 held when last asked
    tokens: int = 0  # tokens its own L3 read put in the tree
    matched_seen: int = 0  # longest L1 + L2 match seen while waiting


class CacheManager:
    """The scheduler's side of ``tree`` (``Scheduler.cache_manager``)."""

    def __init__(
        self,
        tree: BasePrefixCache,
        counters: CacheCounters,
        reads_host_kv: bool,
        wait_forwards: Callable[[], None],
    ) -> None:
        self.tree = tree
        self.counters = counters
        # CPU: a prefill reads the KV of its L2 hit from host memory in place while the copy
        # to the device pool waits until after it: there the copy would only take cores and
        # memory bandwidth from that forward
        self.reads_host_kv = reads_host_kv
        # before a load back writes device slots: no launched forward may still use them
        self.wait_forwards = wait_forwards
        self.l3_progress: dict[str, L3Progress] = {}  # by request id

    # ---- the loop ----------------------------------------------------------------------------
    def check(self) -> None:
        """Take the acks of finished tier copies (every step)."""
        if self.tree.host is not None:
            self.tree.host.check()

    def set_wake(self, wake: Callable[[], None]) -> None:
        """``wake()`` runs on a copy thread whenever a copy is acknowledged."""
        if self.tree.host is not None:
            self.tree.host.set_wake(wake)

    def deadline(self) -> float | None:
        """Earliest time.monotonic() at which a waiting L3 read times out; None: none."""
        l3 = self.tree.l3
        return l3.prefetch.prefetch_deadline() if l3 is not None else None

    def settle(self, timeout: float = 30.0) -> None:
        """Let in-flight tier copies finish and be acknowledged, so nodes locked only by a
        copy become evictable; nothing to wait for without a host tier."""
        if self.tree.host is not None:
            self.tree.host.settle(timeout)

    # ---- a waiting request ---------------------------------------------------------------------
    def arrive(self, req: Req) -> None:
        """A new request: its match, its L3 read."""
        self.match(req)
        self._l3_start(req)

    def match(self, req: Req) -> None:
        """The request's L1 + L2 prefix match, recomputed only when the tree changed. A match
        does not count as a hit (``count_hit`` at admission does)."""
        kv, tree = req.kv, self.tree
        if kv.match_result is not None and kv.match_version == tree.version:
            return
        kv.fill_ids = req.all_ids()
        # Keep at least one token to compute: its logits give the next token.
        key = kv.fill_ids[: len(kv.fill_ids) - 1]
        res = tree.match_prefix(key, namespace=req.cache_namespace, touch=False)
        kv.prefix_indices = res.device_indices
        kv.last_node = res.last_device_node
        kv.host_hit_length = res.host_hit_length
        kv.match_result = res
        kv.match_version = tree.version  # after the match: it may take acks
        if self.tree.l3 is None:
            return
        # its prefix was evicted while it waited: L3 may still hold it
        p = self._progress(req)
        matched = len(kv.prefix_indices) + kv.host_hit_length
        if matched < p.matched_seen:
            self._l3_start(req)
        p.matched_seen = max(p.matched_seen, matched)

    def ready(self, req: Req, behind: Sequence[Req]) -> bool:
        """At its turn: may ``req`` be admitted now (the L3 prefetch policy)? ``behind``: the
        waiting requests that go after it (their landed reads may give L2 room)."""
        l3 = self.tree.l3
        if l3 is None:
            return True
        got = l3.prefetch.poll_prefetch(req.rid)
        if got is None:
            return False
        p = self._progress(req)
        if got == 0 and p.hit > len(req.kv.prefix_indices) + req.kv.host_hit_length:
            # L3 holds more than the tree and nothing is being read (L2 was full when it
            # last tried): try now; the policy then decides how long to wait for it
            self.match(req)
            if self._l3_start(req) or self._take_room_of(req, behind):
                return False
        p.tokens = got or p.tokens
        return True

    def l3_hit(self, req: Req) -> int:
        """Tokens of the request's prefix L3 held when last asked (0: none, or never asked)."""
        p = self.l3_progress.get(req.rid)
        return p.hit if p is not None else 0

    def forget(self, req: Req) -> None:
        """The request went away (finished, aborted, failed): its L3 read stops (its host
        slots come back), what admission knew of it goes."""
        l3 = self.tree.l3
        if l3 is not None:
            l3.prefetch.cancel_prefetch(req.rid)
            self.l3_progress.pop(req.rid, None)

    # ---- admission ---------------------------------------------------------------------------
    def load_back(self, req: Req) -> None:
        """Bring the L2 part of ``req``'s match to the device (``PrefillAdder``'s hook, once
        it fits). NOTE: wait=False: the load overlaps the next forward layer by layer
        (``before_forward``); every path that skips that forward calls ``wait_pending_loads``."""
        kv, host = req.kv, self.tree.host
        if not kv.host_hit_length or host is None:
            return
        self.wait_forwards()  # the load writes device slots a running forward may use
        kv.prefix_indices, kv.last_node = host.load_back(
            locked_node(req), kv.match_result, wait=False, hold=self.reads_host_kv
        )

    def count_hit(self, req: Req) -> None:
        """Admission: the prefix counts as a hit once (``record_hit``), its L3 read is done
        with, and its cached tokens per tier go into the request and the counters; the tokens
        its own L3 read put in the tree count as L3's, not as the L2 its match saw."""
        adm, kv = req.admission, req.kv
        if adm.hit_counted:
            return  # a chunk of an admitted request, or a retracted one coming back
        adm.hit_counted = True
        from_l3 = self.l3_admitted(req)
        if kv.last_node is not None:
            self.tree.record_hit(kv.last_node)
        res = kv.match_result
        if res is None or res.tier_tokens is None:
            tiers = {L1: len(kv.prefix_indices)}
        else:
            tiers = dict(res.tier_tokens)
            moved = min(from_l3, tiers.get(L2, 0))
            tiers[L2] = tiers.get(L2, 0) - moved
            tiers[L3] = tiers.get(L3, 0) + moved
        adm.cached_tokens_per_tier.update(tiers)
        adm.cached_tokens = len(kv.prefix_indices)
        self.counters.record_match(
            adm.cached_tokens_per_tier, len(req.origin_input_ids) - adm.cached_tokens
        )

    # ---- around a forward ----------------------------------------------------------------------
    def before_forward(self, fb: ForwardBatch, is_extend: bool) -> None:
        """While a load is in flight the forward waits for it layer by layer; a CPU prefill
        reads the loading slots from host instead, and a CPU decode (the fused kernel reads
        the pool with no per-layer wait) waits for it whole."""
        host = self.tree.host
        fb.wait_layer = host.pending_layer_wait() if host is not None else None
        if host is None or fb.wait_layer is None or not self.reads_host_kv:
            return
        fb.wait_layer = None
        if is_extend:
            fb.host_reads = host.host_reads()
        else:
            host.wait_pending_loads()

    def after_forward(self, fb: ForwardBatch) -> None:
        """The forward read the loading KV from host: the held copies go now."""
        if fb.host_reads is not None:
            self.release_loads()

    def wait_pending_loads(self) -> None:
        """No forward will wait for the loads started: land them (acked at the next check)."""
        if self.tree.host is not None:
            self.tree.host.wait_pending_loads()

    def release_loads(self) -> None:
        """No forward will read held loads from host: let them copy."""
        if self.tree.host is not None:
            self.tree.host.controller.release_loads()

    # ---- figures -------------------------------------------------------------------------------
    def tier_stats(self, held_tokens: int) -> TierSet:
        """Each tier's record, with the hits admission counted; ``held_tokens``: device tokens
        running requests hold outside the tree."""
        return tier_stats(self.tree, self.counters.hit_tokens, held_tokens)

    # ---- L3 admission ---------------------------------------------------------------------------
    def _progress(self, req: Req) -> L3Progress:
        p = self.l3_progress.get(req.rid)
        if p is None:
            p = self.l3_progress[req.rid] = L3Progress()
        return p

    def _l3_start(self, req: Req) -> int:
        """Read what L3 holds beyond the request's match into L2; returns the tokens the
        started read will add (0: none started, or no L3 attached)."""
        l3 = self.tree.l3
        if l3 is None or not l3.has_storage():
            return 0
        match = req.kv.match_result
        if match is None:
            raise AssertionError("a request's L3 read starts after its match")
        prefetch, p = l3.prefetch, self._progress(req)
        key = req.kv.fill_ids[: len(req.kv.fill_ids) - 1]
        if p.keys is None:
            p.keys = prefetch.prefetch_keys(key, req.cache_namespace)
        res = prefetch.start_prefetch(req.rid, key, req.cache_namespace, match, keys=p.keys)
        p.hit = res.in_l3
        return res.tokens

    def l3_admitted(self, req: Req) -> int:
        """The request was admitted: its read's state goes. Returns the tokens its own read put
        in the tree (its match counts them as L2; they came from L3)."""
        l3 = self.tree.l3
        if l3 is None:
            return 0
        l3.prefetch.finish_prefetch(req.rid)
        p = self.l3_progress.get(req.rid)
        return p.tokens if p is not None else 0

    def _take_room_of(self, req: Req, behind: Sequence[Req]) -> int:
        """L2 had no room for ``req``'s read: the reads of requests that go after it give
        theirs, the last in the order first, and its read starts.
        NOTE: otherwise L2 fills with the landed reads of requests the cache order keeps
        waiting, and the requests admitted recompute what L3 holds (docs/benchmarks.md)."""
        l3 = self.tree.l3
        if l3 is None or l3.prefetch.has_prefetch(req.rid):
            return 0
        prefetch = l3.prefetch
        need = self._progress(req).hit - len(req.kv.prefix_indices) - req.kv.host_hit_length
        if need < prefetch.prefetch_threshold:
            return 0
        freed = 0
        for r in reversed(behind):
            if freed >= need:
                break
            n = prefetch.yield_prefetch(r.rid)
            # what landed stays in L2 until evicted: it still came from L3
            q = self._progress(r)
            q.tokens = max(q.tokens, n)
            freed += n
        return self._l3_start(req) if freed else 0
