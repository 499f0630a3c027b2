"""CacheRequest: a request as the prefix caches see it: who it is, its tokens, and its KV
(``CacheKV``). engine's ``Req`` satisfies it (its ``kv`` record, engine's ``KVState``, satisfies
``CacheKV``); the caches read and write these fields and nothing else of a request.

    positions: 0 ........... len(kv.prefix_indices) ............ len(kv.fill_ids)
               | tree slots the request uses  | its own slots | (req_to_token[kv.req_pool_idx])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hicache.tree.base import MatchResult
    from hicache.tree.node import TreeNode


class CacheKV(Protocol):
    """A request's KV as the caches see it: its row, the prefix it uses, its match."""

    req_pool_idx: int | None  # its req_to_token row; None until admitted
    fill_ids: list[int]  # tokens whose KV is (or will be, this step) in its row
    prefix_indices: torch.Tensor  # [n] int64: slots of the cached prefix it uses
    last_node: TreeNode | None  # the node it holds a lock on (its match's, while it waits)
    # its L1 + L2 match while it waits (set by the scheduler from ``match_prefix``)
    match_result: MatchResult | None
    host_hit_length: int  # tokens of that match on host (L2)

    @property
    def kv_committed_len(self) -> int | None:
        """Tokens whose KV is in its row; None: every token but the last sampled one."""
        ...


class CacheRequest(Protocol):
    rid: str  # unique among the requests in flight
    origin_input_ids: list[int]
    output_ids: list[int]
    cache_namespace: str | None  # the namespace its keys are salted with (key_of)

    @property
    def kv(self) -> CacheKV:
        """Its KV (the caches write ``prefix_indices`` / ``last_node`` back into it)."""
        ...


def row_of(req: CacheRequest) -> int:
    """The req_to_token row of a request whose KV the cache is given (an admitted one)."""
    if req.kv.req_pool_idx is None:
        raise AssertionError(f"request {req.rid} has no req_to_token row")
    return req.kv.req_pool_idx


def locked_node(req: CacheRequest) -> TreeNode:
    """The node an admitted request holds a lock on."""
    if req.kv.last_node is None:
        raise AssertionError(f"request {req.rid} holds no lock")
    return req.kv.last_node


def finished_kv_len(req: CacheRequest) -> int:
    """Tokens of a finished request with KV in the pool: ``len(input) + len(output) - 1`` (the
    last sampled token has none); ``req.kv.kv_committed_len``, if set, overrides it (abort)."""
    committed = req.kv.kv_committed_len
    if committed is not None:
        return int(committed)
    return len(req.origin_input_ids) + len(req.output_ids) - 1
