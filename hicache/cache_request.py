"""CacheRequest: a request as the prefix caches see it. engine's ``Req`` satisfies it; the caches
read and write these fields and nothing else of a request.

    positions: 0 ............ len(prefix_indices) ........... len(fill_ids)
               | tree slots the request uses  | its own slots | (req_to_token[req_pool_idx])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hicache.base_prefix_cache import MatchResult
    from hicache.radix_cache import TreeNode


class CacheRequest(Protocol):
    rid: str  # unique among the requests in flight
    req_pool_idx: int | None  # its req_to_token row; None until admitted
    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]  # tokens whose KV is (or will be, this step) in its row
    prefix_indices: torch.Tensor  # [n] int64: slots of the cached prefix it uses
    last_node: TreeNode | None  # the node it holds a lock on (its match's, while it waits)
    cache_namespace: str | None  # the namespace its keys are salted with (key_of)
    # its L1 + L2 match while it waits (set by the scheduler from ``match_prefix``)
    match_result: MatchResult | None
    host_hit_length: int  # tokens of that match on host (L2)

    @property
    def kv_committed_len(self) -> int | None:
        """Tokens whose KV is in its row; None: every token but the last sampled one."""
        ...


def row_of(req: CacheRequest) -> int:
    """The req_to_token row of a request whose KV the cache is given (an admitted one)."""
    if req.req_pool_idx is None:
        raise AssertionError(f"request {req.rid} has no req_to_token row")
    return req.req_pool_idx


def locked_node(req: CacheRequest) -> TreeNode:
    """The node an admitted request holds a lock on."""
    if req.last_node is None:
        raise AssertionError(f"request {req.rid} holds no lock")
    return req.last_node
