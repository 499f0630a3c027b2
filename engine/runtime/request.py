"""Req: one generation request and its KV bookkeeping (seed 000's lifecycle). The prefix
caches see it as ``hicache.cache_request.CacheRequest``."""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.detokenizer.text import TextStream
from engine.front import FinishKind, SamplingParams, StreamChunk
from hicache.base_prefix_cache import MatchResult

log = logging.getLogger(__name__)

_rid_counter = itertools.count()


@dataclass
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None  # the stop token id or stop string
    message: str = ""


class Req:
    def __init__(
        self,
        rid: str | None,
        input_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_context_len: int,
        device: torch.device,
        namespace: str | None = None,
        sink: Callable[[StreamChunk], None] | None = None,
    ):
        """`sink`: where chunks go instead of `chunks` (the split daemon's scheduler process
        sends them to the detokenizer process, and detokenizes here only for stop strings)."""
        self.rid = rid if rid is not None else f"req-{next(_rid_counter)}"
        self.origin_input_ids = input_ids
        self.params = params
        self.output_ids: list[int] = []
        self.cache_namespace = namespace
        self.eos_token_ids = eos_token_ids
        # Room for at least one output token is checked at submit; clip the budget to the context.
        self.max_new_tokens = min(params.max_new_tokens, max_context_len - len(input_ids))
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        # KV bookkeeping
        self.req_pool_idx: int | None = None
        self.fill_ids: list[int] = []  # tokens whose KV is (or will be, this step) in the pool
        self.prefix_indices = torch.empty(0, dtype=torch.int64)  # tree-owned slots in use
        self.last_node: Any = None  # the node this request holds a lock on
        self.kv_len = 0  # tokens with KV in req_to_token[req_pool_idx]
        self.kv_alloc = 0  # ... plus those launched forwards are writing (slots allocated)
        self.num_pending = 0  # launched batches with this request whose results are not in
        self.future_slot = 0  # overlap: where its last launched token lands (ForwardWorker)
        self.release_deferred = False  # finished while a launched forward writes its KV
        self.extend_len = 0  # tokens to compute in the current extend step
        self.is_chunked = False  # mid-prompt after a chunked prefill step
        self.retractions = 0
        # Accounting (first prefill only)
        self.cached_tokens = 0
        self.cached_tokens_per_tier: dict[str, int] = {"l1": 0, "l2": 0, "l3": 0}
        self.host_hit_length = 0  # tokens of the match on host (L2), loaded back at admission
        # its hit was counted (admission); NOTE: a retracted request keeps it: counted once
        self.hit_counted = False
        self.match_result: MatchResult | None = None  # the tree's last match for it ...
        self.match_version: int | None = None  # ... valid while tree_cache.version is this
        self.bypassed = 0  # later arrivals admitted before it (aging)
        self.finished_reason: FinishReason | None = None
        self.to_abort = False
        # Streaming
        self.chunks: queue.Queue[StreamChunk | BaseException] = queue.Queue()
        self.sink = sink or self.chunks.put
        text_tokenizer = tokenizer if sink is None or params.stop else None
        self.text = TextStream(text_tokenizer, params.skip_special_tokens, params.stop)
        self.sent_ids = 0
        self.held_text = ""  # final_only: text produced since the last chunk
        self.created = time.monotonic()
        self.first_token_time: float | None = None

    # --- lifecycle -------------------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def kv_committed_len(self) -> int:
        # read by the prefix caches: tokens whose KV is in req_to_token[req_pool_idx]
        return self.kv_len

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None

    def reset_for_retract(self) -> None:
        """After retraction the request restarts from its prompt + outputs so far."""
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node = None
        self.kv_len = 0
        self.kv_alloc = 0
        self.extend_len = 0
        self.is_chunked = False
        self.req_pool_idx = None
        self.match_result = None
        self.retractions += 1

    def check_finished(self, max_context_len: int) -> None:
        if self.finished_reason is not None or not self.output_ids:
            return
        last = self.output_ids[-1]
        is_eos = not self.params.ignore_eos and last in self.eos_token_ids
        if is_eos or last in self.params.stop_token_ids:
            self.finished_reason = FinishReason("stop", matched=last)
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = FinishReason("length")
        elif self.seqlen >= max_context_len:
            self.finished_reason = FinishReason("length", message="context length reached")

    # --- streaming -------------------------------------------------------------------------
    def emit(self, flush: bool = False) -> None:
        """Pushes a chunk with the tokens and text produced since the last one."""
        finished = self.finished()
        fr = self.finished_reason
        stop_token = fr is not None and fr.kind == "stop" and isinstance(fr.matched, int)
        try:
            delta, stop = self.text.step(self.output_ids, finished, stop_token)
        except Exception:
            # NOTE: a chunk must still go out: the caller's handle waits for it (the ids are
            # exact; only this step's text is lost)
            log.exception("detokenizing request %s failed; sending token ids only", self.rid)
            delta, stop = "", None
        if stop is not None:
            self.finished_reason = FinishReason("stop", matched=stop)
            finished = True
        new_ids = self.output_ids[self.sent_ids :]
        if not new_ids and not delta and not finished and not flush:
            return
        if self.params.final_only and not finished and not flush:
            self.held_text += delta  # the ids wait in output_ids
            return
        delta, self.held_text = self.held_text + delta, ""
        self.sent_ids = len(self.output_ids)
        fr = self.finished_reason
        self.sink(
            StreamChunk(
                token_ids=new_ids,
                text=delta,
                finished=finished,
                finish_reason=fr.kind if fr else None,
                matched_stop=fr.matched if fr else None,
                prompt_tokens=len(self.origin_input_ids),
                completion_tokens=len(self.output_ids),
                cached_tokens=self.cached_tokens,
                cached_tokens_per_tier=dict(self.cached_tokens_per_tier),
                error=fr.message if fr and fr.kind == "abort" else None,
            )
        )

