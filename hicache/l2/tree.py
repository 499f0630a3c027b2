"""TierTree: the tree operations HiRadixCache's host tier calls: the writes and loads between
device and host (``hicache.l2.tier``) and the eviction from both tiers
(``hicache.l2.eviction``). HiRadixCache implements them; the host tier reaches the tree through
nothing else (the pools and the controller are given to it explicitly).

Every change of a node's tiers goes through ``set_value`` / ``drop_value`` / ``set_host`` /
``evict_leaf`` / ``delete_leaf``, so the tree's size counters and ``version`` stay true.
NOTE: every call runs on the scheduler thread, like the tree's own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from hicache.tree.node import TreeNode


class TierTree(Protocol):
    root_node: TreeNode
    disable: bool
    evicted_tokens: int  # cumulative L1 tokens freed (demoted or deleted)

    def all_nodes(self) -> list[TreeNode]:
        """Every node of the tree, the root included."""
        ...

    def path_of(self, node: TreeNode) -> list[TreeNode]:
        """Root-exclusive path root -> ``node``, cut where a node is no longer in the tree (so
        ``path[-1] is node`` iff ``node`` is in the tree)."""
        ...

    def eviction_priority(self, node: TreeNode) -> tuple[int, ...]:
        """Smallest first: the order in which unlocked leaves are evicted."""
        ...

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Lock ``node`` and its ancestors against eviction."""
        ...

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unlock ``node`` and its ancestors."""
        ...

    def set_value(self, node: TreeNode, value: torch.Tensor) -> None:
        """Give ``node`` device slots (``[len(node.key)]`` int64 on device)."""
        ...

    def drop_value(self, node: TreeNode) -> None:
        """Forget ``node``'s device slots (the caller frees them)."""
        ...

    def set_host(self, node: TreeNode, host_value: torch.Tensor | None) -> None:
        """``node``'s host slots (None: no L2 copy; the caller frees them)."""
        ...

    def evict_leaf(self, node: TreeNode) -> int:
        """Free a device leaf's device slots and drop it; returns the tokens freed."""
        ...

    def delete_leaf(self, node: TreeNode) -> None:
        """Drop a leaf from the tree (its slots: freed by the caller)."""
        ...

    def emit(self, kind: str, tier: str, num_tokens: int, node: TreeNode | None = None) -> None:
        """Report a cache event (stored, removed, promoted, demoted) to the event log."""
        ...

    def device_prefix(self, device: list[TreeNode]) -> tuple[torch.Tensor, TreeNode]:
        """The device slots of ``device`` (the device part of a path), and its last node (the
        root when empty)."""
        ...

    def evict(self, num_tokens: int) -> int:
        """Free >= ``num_tokens`` device slots if possible; returns the tokens freed."""
        ...
