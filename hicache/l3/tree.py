"""L3Tree: the tree operations the L3 tier (``hicache.l3.tier``) calls. HiRadixCache implements
them; the L3 tier reaches the tree through nothing else (its bytes: the host pool and the
controller, given to it explicitly).

NOTE: every call runs on the scheduler thread, like the tree's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hicache.tree.base import MatchResult
    from hicache.tree.node import TreeNode


class L3Tree(Protocol):
    page_size: int
    root_node: TreeNode

    def tree_key(
        self, token_ids: list[int] | tuple[int, ...], namespace: str | None
    ) -> tuple[int, ...]:
        """The page-aligned, namespaced key the tree stores for ``token_ids``."""
        ...

    def split_key(self, key: tuple[int, ...]) -> tuple[str | None, list[int]]:
        """(namespace, token ids) of a tree key."""
        ...

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

    def evict_host(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` host slots if possible; returns the tokens freed."""
        ...

    def all_nodes(self) -> list[TreeNode]:
        """Every node of the tree, the root included."""
        ...

    def bump_version(self) -> None:
        """What the tree holds changed (matches kept by callers are stale)."""
        ...

    def writes_in_flight(self) -> bool:
        """Are device -> host writes not yet acknowledged?"""
        ...

    def check(self) -> None:
        """Take every finished copy's acknowledgement (writes queue their L3 backups)."""
        ...
