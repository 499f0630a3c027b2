"""Admin pins: each keeps the device-cached prefix of a key locked in the tree
(``hicache.tree.ops.lock_prefix``) until it is unpinned or its TTL passes.

The table is the engine's record of them (ids, TTL, owner); the locks are the tree's, taken and
released through its API only. A ``Pin`` is plain data (engine/admin_records.py: it crosses to
the API server process); the tree lock it stands for stays in the table.
"""

from __future__ import annotations

import itertools

from engine.admin_records import Pin
from hicache.tree.base import BasePrefixCache
from hicache.tree.ops import PrefixLock, unlock_prefix


class PinTable:
    """The pins of one scheduler (``Scheduler.admin_pins``), each holding one tree lock."""

    def __init__(self) -> None:
        self.pins: dict[str, Pin] = {}
        self._locks: dict[str, PrefixLock] = {}
        self._ids = itertools.count(1)

    def add(
        self, lock: PrefixLock, tokens: int, expires_at: float | None, owner: str | None
    ) -> Pin:
        """Record a lock the tree gave (``lock_prefix``) as a new pin."""
        pin = Pin(f"pin-{next(self._ids)}", tokens, expires_at, owner, lock.node.id)
        self.pins[pin.pin_id] = pin
        self._locks[pin.pin_id] = lock
        return pin

    def select(self, pin_id: str | None = None, owner: str | None = None) -> list[str]:
        """The ids of one pin (or all with pin_id=None); with an owner, only that owner's."""
        ids = list(self.pins) if pin_id is None else [pin_id] if pin_id in self.pins else []
        return ids if owner is None else [i for i in ids if self.pins[i].owner == owner]

    def expired(self, now: float) -> list[str]:
        return [i for i, p in self.pins.items() if p.expires_at is not None and p.expires_at <= now]

    def release(self, tree: BasePrefixCache, ids: list[str]) -> tuple[int, int]:
        """Unlock and forget these pins; returns (pins released, tokens they pinned)."""
        tokens = 0
        for i in ids:
            tokens += self.pins.pop(i).tokens
            unlock_prefix(tree, self._locks.pop(i))
        return len(ids), tokens

    def pinned_tokens(self) -> int:
        return sum(p.tokens for p in self.pins.values())

    def pinned_node_ids(self) -> set[int]:
        return {p.node_id for p in self.pins.values()}

    def owned_by(self, owner: str) -> list[Pin]:
        return [p for p in self.pins.values() if p.owner == owner]
