"""PrefillAdder: decides which waiting requests fit the next prefill batch (seed 004)."""

from __future__ import annotations

import enum
from typing import Any

from engine.request import Req

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
        tree_cache: Any,
        allocator: Any,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int,
        page_size: int,
    ):
        self.tree_cache = tree_cache
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

    def _lock(self, req: Req) -> None:
        # Locking moves the prefix from evictable to protected: that space is no longer ours.
        if req.last_node is not None:
            self.rem_total_tokens += self.tree_cache.inc_lock_ref(req.last_node) or 0  # delta <= 0

    def _take(self, req: Req, remaining: int, reserve: int) -> AddResult:
        """Schedules `remaining` prompt tokens of req (chunked if needed)."""
        if self.rem_chunk_tokens is not None and remaining > self.rem_chunk_tokens:
            # Chunk boundaries stay page-aligned so the tree can take every full chunk.
            chunk = (self.rem_chunk_tokens // self.page_size) * self.page_size
            if chunk <= 0:
                return AddResult.OTHER
            req.extend_len = chunk
            self.new_chunked_req = req
        else:
            req.extend_len = remaining
        self.can_run.append(req)
        self.rem_total_tokens -= _ceil(req.extend_len, self.page_size) + reserve
        self.rem_input_tokens -= req.extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= req.extend_len
        if self.new_chunked_req is not None:
            return AddResult.OTHER
        return AddResult.CONTINUE

    def add_chunked_req(self, req: Req) -> AddResult:
        """Continues a request that was cut by the chunk budget last round (already locked)."""
        req.fill_ids = req.all_ids()  # the tree saw only the computed part
        remaining = len(req.fill_ids) - req.kv_len
        return self._take(req, remaining, 0)

    def add_one_req(self, req: Req, num_running: int = 0) -> AddResult:
        remaining = len(req.fill_ids) - len(req.prefix_indices)
        reserve = int(min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio)
        need = _ceil(remaining, self.page_size) + reserve
        if self.rem_input_tokens <= 0 or (
            self.rem_chunk_tokens is not None and self.rem_chunk_tokens < self.page_size
        ):
            return AddResult.OTHER
        if need > self.rem_total_tokens:
            # Still admit it when nothing else runs and the prompt alone fits: the decode phase
            # retracts if it must; otherwise a long request could starve forever.
            if (
                self.can_run
                or num_running
                or _ceil(remaining, self.page_size) > self.rem_total_tokens
            ):
                return AddResult.NO_TOKEN
            reserve = 0
        self._lock(req)
        return self._take(req, remaining, reserve)
