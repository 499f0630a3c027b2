"""Req: one generation request, composed of the records of the state it carries (seed 000's
lifecycle). Each record names the modules that write and read it:

    Req               rid, prompt, sampling, the tokens it produced, why it finished
    ├─ kv             KVState: its row, its slots, its prefix match   (scheduler, BatchBuilder,
    │                 PrefillAdder, SchedulePolicy, the prefix caches)
    ├─ admission      Admission: arrival, aging, the hit it was admitted with   (SchedulePolicy,
    │                 the scheduler at admission)
    └─ stream         OutputStream: where its chunks go, its detokenizer   (Req.emit; the caller)

Where a request is in its lifecycle (waiting, running, a chunk in flight, finished with its
release deferred) is the scheduler's lists (``waiting``, ``running``, ``chunked_req``,
``deferred``), not a flag here. The prefix caches see a Req as
``hicache.tree.request.CacheRequest`` (its ``kv`` as ``CacheKV``); mypy checks that at every
cache call. After submit everything here belongs to the scheduler thread, except
``stream.chunks``, which the caller's thread reads.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.detokenizer.text import TextStream
from engine.front import FinishKind, StreamChunk
from engine.sampling_params import SamplingParams
from hicache.tier import TIERS

if TYPE_CHECKING:
    from hicache.tree.base import MatchResult
    from hicache.tree.node import TreeNode

log = logging.getLogger(__name__)

_rid_counter = itertools.count()


@dataclass
class FinishReason:
    kind: FinishKind
    matched: int | str | None = None  # the stop token id or stop string
    message: str = ""


def _no_slots() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class KVState:
    """Where a request's KV is: its req_to_token row, the cached prefix it uses (its match while
    it waits), and the positions launched forwards write. The prefix caches see it as
    ``hicache.tree.request.CacheKV``.

        positions: 0 ....... len(prefix_indices) ........ kv_len ............... kv_alloc
                   | its prefix: tree slots | its own slots, KV in | launched forwards write |

    (after a chunk, ``prefix_indices`` also holds the partial last page the request keeps:
    ``cache_unfinished_req``)

    Writers: ``Scheduler._match`` (fill_ids and the match), ``PrefillAdder`` (extend_len; a
    chunk's fill_ids), the load back and the caches' ``cache_unfinished_req`` (prefix_indices,
    last_node), ``BatchBuilder`` (req_pool_idx, kv_alloc), the scheduler's launch (num_pending,
    future_slot) and result handling (kv_len, num_pending). Readers: ``BatchBuilder`` (a
    forward's rows, positions and decode inputs), the caches, ``PrefillAdder`` and
    ``SchedulePolicy`` (the match), the KV invariant (the row up to kv_alloc).
    """

    # its row
    req_pool_idx: int | None = None  # its req_to_token row; None until admitted
    # tokens whose KV is (or will be, this step) in its row
    fill_ids: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens with KV in its row
    kv_alloc: int = 0  # ... plus those launched forwards are writing (slots allocated)
    extend_len: int = 0  # tokens to compute in the current extend step
    # the forwards launched with it
    num_pending: int = 0  # launched batches with it whose results are not handled yet
    future_slot: int = 0  # overlap: where its last launched token lands (ForwardWorker)
    # its prefix in the cache
    prefix_indices: torch.Tensor = field(default_factory=_no_slots)  # [n] int64 slots, on device
    last_node: TreeNode | None = None  # the node it holds a lock on (its match's, while it waits)
    host_hit_length: int = 0  # tokens of its match on host (L2), loaded back at admission
    match_result: MatchResult | None = None  # the tree's last match for it ...
    match_version: int | None = None  # ... valid while tree_cache.version is this

    @property
    def kv_committed_len(self) -> int:
        """Read by the caches: tokens whose KV is in its row."""
        return self.kv_len

    def reset(self) -> None:
        """Retracted, or requeued with a row: it restarts from its prompt + outputs so far, with
        no row, no prefix and its match to redo."""
        self.req_pool_idx = None
        self.prefix_indices = _no_slots()
        self.last_node = None
        self.kv_len = 0
        self.kv_alloc = 0
        self.extend_len = 0
        self.match_result = None


def _no_tier_hits() -> dict[str, int]:
    return dict.fromkeys(TIERS, 0)


@dataclass(eq=False)
class Admission:
    """A request's place in the admission order, and the hit it was admitted with.

    Writers: ``SchedulePolicy.count_bypasses`` (bypassed), the scheduler at its first admission
    (``Scheduler._count_hit``: hit_counted and the cached tokens). Readers: ``SchedulePolicy``
    (created and bypassed: arrival order, aging), ``Req.emit`` (the cached tokens, in every
    chunk's usage).
    """

    created: float  # time.monotonic() at submit: the arrival order
    bypassed: int = 0  # later arrivals admitted before it (aging)
    # its hit was counted; NOTE: a retracted request keeps it: counted once
    hit_counted: bool = False
    cached_tokens: int = 0  # prompt tokens its first admission found cached ...
    cached_tokens_per_tier: dict[str, int] = field(default_factory=_no_tier_hits)  # ... by tier


@dataclass(eq=False)
class OutputStream:
    """Where a request's chunks go, and the detokenizer that gives them their text.

    Writer: ``Req.emit`` (the scheduler thread). Reader: the caller's ``RequestHandle`` takes
    ``chunks`` (a thread-safe queue), unless ``sink`` sends the chunks elsewhere: the split
    daemon's scheduler process sends them to the detokenizer process, and detokenizes here only
    for stop strings."""

    sink: Callable[[StreamChunk], None]
    text: TextStream
    # the caller's, when there is no other sink (an exception put there ends the stream with it)
    chunks: queue.Queue[StreamChunk | BaseException]
    sent_ids: int = 0  # output ids already sent
    held_text: str = ""  # final_only: text produced since the last chunk

    @classmethod
    def open(
        cls, tokenizer: Any, params: SamplingParams, sink: Callable[[StreamChunk], None] | None
    ) -> OutputStream:
        text_tokenizer = tokenizer if sink is None or params.stop else None
        text = TextStream(text_tokenizer, params.skip_special_tokens, params.stop)
        chunks: queue.Queue[StreamChunk | BaseException] = queue.Queue()
        return cls(sink or chunks.put, text, chunks)


@dataclass(eq=False)
class Req:
    """One generation request: what was asked (prompt, sampling, namespace: fixed at submit),
    the tokens it produced and why it finished, and the records of its state (module
    docstring). Writers of its own fields: the scheduler appends sampled tokens to
    ``output_ids``; ``check_finished``, ``emit`` (a stop string) and the scheduler (an abort, a
    failure) set ``finished_reason``."""

    rid: str  # unique among the requests in flight
    origin_input_ids: list[int]
    params: SamplingParams
    eos_token_ids: set[int]
    max_new_tokens: int  # params.max_new_tokens clipped to the context
    cache_namespace: str | None  # the namespace its cache keys are salted with
    generator: torch.Generator | None  # params.seed's generator; None: the sampler's own
    kv: KVState
    admission: Admission
    stream: OutputStream
    output_ids: list[int] = field(default_factory=list)
    finished_reason: FinishReason | None = None

    @classmethod
    def new(
        cls,
        rid: str | None,
        input_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        eos_token_ids: set[int],
        max_context_len: int,
        device: torch.device,
        namespace: str | None = None,
        sink: Callable[[StreamChunk], None] | None = None,
    ) -> Req:
        """`sink`: where chunks go instead of `stream.chunks` (the split daemon's scheduler
        process sends them to the detokenizer process, and detokenizes here only for stop
        strings)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            rid=rid if rid is not None else f"req-{next(_rid_counter)}",
            origin_input_ids=input_ids,
            params=params,
            eos_token_ids=eos_token_ids,
            # Room for at least one output token is checked at submit; clip it to the context.
            max_new_tokens=min(params.max_new_tokens, max_context_len - len(input_ids)),
            cache_namespace=namespace,
            generator=generator,
            kv=KVState(),
            admission=Admission(created=time.monotonic()),
            stream=OutputStream.open(tokenizer, params, sink),
        )

    # --- lifecycle -------------------------------------------------------------------------
    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def finished(self) -> bool:
        return self.finished_reason is not None

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
        stream = self.stream
        finished = self.finished()
        fr = self.finished_reason
        stop_token = fr is not None and fr.kind == "stop" and isinstance(fr.matched, int)
        try:
            delta, stop = stream.text.step(self.output_ids, finished, stop_token)
        except Exception:
            # NOTE: a chunk must still go out: the caller's handle waits for it (the ids are
            # exact; only this step's text is lost)
            log.exception("detokenizing request %s failed; sending token ids only", self.rid)
            delta, stop = "", None
        if stop is not None:
            self.finished_reason = FinishReason("stop", matched=stop)
            finished = True
        new_ids = self.output_ids[stream.sent_ids :]
        if not new_ids and not delta and not finished and not flush:
            return
        if self.params.final_only and not finished and not flush:
            stream.held_text += delta  # the ids wait in output_ids
            return
        delta, stream.held_text = stream.held_text + delta, ""
        stream.sent_ids = len(self.output_ids)
        fr = self.finished_reason
        stream.sink(
            StreamChunk(
                token_ids=new_ids,
                text=delta,
                finished=finished,
                finish_reason=fr.kind if fr else None,
                matched_stop=fr.matched if fr else None,
                prompt_tokens=len(self.origin_input_ids),
                completion_tokens=len(self.output_ids),
                cached_tokens=self.admission.cached_tokens,
                cached_tokens_per_tier=dict(self.admission.cached_tokens_per_tier),
                error=fr.message if fr and fr.kind == "abort" else None,
            )
        )
