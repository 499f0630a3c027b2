"""PrefillAdder: decides which waiting requests fit the next prefill batch."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

from engine.runtime.request import Req
from hicache.tree.base import BasePrefixCache
from hicache.tree.request import locked_node

# Reserve at most this many future decode tokens per request when budgeting (as SGLang does).
CLIP_MAX_NEW_TOKENS = 4096


class AddResult(enum.Enum):
    CONTINUE = 1
    NO_TOKEN = 2  # out of KV budget: stop adding
    OTHER = 3  # input or running-request budget exhausted: stop adding


def _ceil(x: int, page: int) -> int:
    return -(-x // page) * page


class PrefillAdder:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        allocator: Any,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        page_size: int,
    ):
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.page_size = page_size
        reserved = sum(
            int(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * new_token_ratio)
            for r in running
        )
        self.rem_total_tokens = allocator.available_size() + tree_cache.evictable_size() - reserved
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size if chunked_prefill_size > 0 else None
        self.new_token_ratio = new_token_ratio
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def _room(self) -> int:
        """Device tokens a prefill could still get: free + evictable."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def _take(self, req: Req, remaining: int, reserve: int) -> AddResult:
        """Schedules `remaining` prompt tokens of req (chunked if needed)."""
        if self.rem_chunk_tokens is not None and remaining > self.rem_chunk_tokens:
            # Chunk boundaries stay page-aligned so the tree can take every full chunk.
            chunk = (self.rem_chunk_tokens // self.page_size) * self.page_size
            if chunk <= 0:
                return AddResult.OTHER
            req.kv.extend_len = chunk
            self.new_chunked_req = req
        else:
            req.kv.extend_len = remaining
        self.can_run.append(req)
        self.rem_total_tokens -= _ceil(req.kv.extend_len, self.page_size) + reserve
        self.rem_input_tokens -= req.kv.extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.kv.extend_len
        if self.new_chunked_req is not None:
            return AddResult.OTHER
        return AddResult.CONTINUE

    def add_chunked_req(self, req: Req) -> AddResult:
        """Continues a request that was cut by the chunk budget last round (already locked).
        The chunk shrinks to what the KV budget holds (whole pages); none fits: NO_TOKEN."""
        req.kv.fill_ids = req.all_ids()  # the tree saw only the computed part
        remaining = len(req.kv.fill_ids) - req.kv.kv_len
        fits = max(0, self.rem_total_tokens) // self.page_size * self.page_size
        if fits <= 0:
            return AddResult.NO_TOKEN
        if fits < remaining and (self.rem_chunk_tokens is None or fits < self.rem_chunk_tokens):
            self.rem_chunk_tokens = fits
        return self._take(req, remaining, 0)

    def add_one_req(
        self, req: Req, num_running: int = 0, load_back: Callable[[Req], None] | None = None
    ) -> AddResult:
        """Admit ``req`` if its KV fits the budget, locking its matched prefix.

        NOTE: the budget is checked *with* the prefix locked (a locked prefix is no longer
        evictable room), and the host (L2) part of the match counts as tokens to place:
        ``load_back(req)``, run only once it fits, takes device slots for it. Every change of
        free + evictable room (slots loaded into, nodes locked) is charged."""
        if self.rem_input_tokens <= 0 or (
            self.rem_chunk_tokens is not None and self.rem_chunk_tokens < self.page_size
        ):
            return AddResult.OTHER
        reserve = int(min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
        # device tokens it needs: the host part to load back + the tokens to compute
        remaining = len(req.kv.fill_ids) - len(req.kv.prefix_indices)
        room0 = self._room()
        locked = req.kv.last_node
        if locked is not None:
            self.tree_cache.inc_lock_ref(locked)
        rem = self.rem_total_tokens - (room0 - self._room())
        if _ceil(remaining, self.page_size) + reserve > rem:
            # Still admit it when nothing else runs and the prompt alone fits: the decode phase
            # retracts if it must; otherwise a long request could starve forever.
            if self.can_run or num_running or _ceil(remaining, self.page_size) > rem:
                if locked is not None:
                    self.tree_cache.dec_lock_ref(locked)
                return AddResult.NO_TOKEN
            reserve = 0
        if load_back is not None:
            load_back(req)
            if req.kv.last_node is not locked:  # the lock follows the (longer) device prefix
                self.tree_cache.inc_lock_ref(locked_node(req))
                if locked is not None:
                    self.tree_cache.dec_lock_ref(locked)
        self.rem_total_tokens -= room0 - self._room()
        return self._take(req, len(req.kv.fill_ids) - len(req.kv.prefix_indices), reserve)
