"""L3Tree: the tree operations the L3 tier (``hicache.l3.tier``, its backups and prefetches)
calls. HiRadixCache implements them; the L3 tier reaches the tree through nothing else (its
bytes: the host pool and the controller, given to it explicitly; L2's room and acks: the tree's
host tier).

NOTE: every call runs on the scheduler thread, like the tree's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hicache.l2.tier import HostTier
    from hicache.tree.base import MatchResult
    from hicache.tree.keys import TreeKeys
    from hicache.tree.node import TreeNode


class L3Tree(Protocol):
    page_size: int
    root_node: TreeNode
    keys: TreeKeys  # tree keys of token ids, (namespace, token ids) of a tree key
    host: HostTier  # L2: its room (eviction) and its acks (check)

    def path_of(self, node: TreeNode) -> list[TreeNode]:
        """Root-exclusive path root -> ``node``, cut where a node is no longer in the tree (so
        ``path[-1] is node`` iff ``node`` is in the tree)."""
        ...

    def match_node(self, key: tuple[int, ...]) -> tuple[TreeNode, int]:
        """The deepest node matching ``key`` and the tokens matched; splits the node the match
        ends inside, touches no access time or hit count."""
        ...

    def match_prefix(
        self, key: list[int] | tuple[int, ...], namespace: str | None = None, touch: bool = True
    ) -> MatchResult:
        """The L1 + L2 match of ``key`` (BasePrefixCache.match_prefix)."""
        ...

    def hang_host_node(
        self, parent: TreeNode, key: tuple[int, ...], host_indices: torch.Tensor
    ) -> TreeNode:
        """Add a host-only child of ``parent`` holding ``key`` in ``host_indices`` (an L3 read:
        its objects are in L3)."""
        ...

    def all_nodes(self) -> list[TreeNode]:
        """Every node of the tree, the root included."""
        ...

    def bump_version(self) -> None:
        """What the tree holds changed (matches kept by callers are stale)."""
        ...
