"""TreeNode: one node of the radix tree: a run of token ids (a multiple of page_size) and where
their KV lives in each tier (``value``: L1 device slots, ``host_value``: L2 host slots,
``in_storage``: L3), with its locks and access figures. The trees (``hicache.tree``) and the
tiers' parts (``hicache.l2``, ``hicache.l3``) read and write these fields.
"""

from __future__ import annotations

import itertools

import torch

_node_ids = itertools.count()
_clock = itertools.count(1)  # monotonic logical access time: deterministic LRU order


def access_time() -> int:
    """The next logical access time (LRU order)."""
    return next(_clock)


class TreeNode:
    def __init__(self, key: tuple[int, ...] = (), value: torch.Tensor | None = None) -> None:
        self.key = key  # token ids, len % page_size == 0
        self.value = value  # [len(key)] int64 slots on device; None = not on device
        self.host_value: torch.Tensor | None = None  # HiRadixCache: [len(key)] int64 host slots
        # HiRadixCache: the device->host write still filling host_value (shared by the parts of
        # a split node); None once its bytes landed
        self.host_pending: object | None = None
        self.host_ref = 0  # HiRadixCache: protections against host eviction (prefetch anchors)
        self.in_storage = False  # HiRadixCache: the L3 objects ending inside this node are stored
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent: TreeNode | None = None
        self.lock_ref = 0
        self.last_access_time = access_time()
        self.hit_count = 0
        self.id = next(_node_ids)

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def subtree(node: TreeNode) -> list[TreeNode]:
    """``node`` and its descendants, parents first."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def device_value(node: TreeNode) -> torch.Tensor:
    """The device slots of a node known to be on device."""
    if node.value is None:
        raise AssertionError(f"{node!r} is not on device")
    return node.value


def host_value(node: TreeNode) -> torch.Tensor:
    """The host slots of a node known to have an L2 copy (HiRadixCache)."""
    if node.host_value is None:
        raise AssertionError(f"{node!r} has no host copy")
    return node.host_value
