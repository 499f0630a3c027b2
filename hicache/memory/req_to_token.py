"""ReqToTokenPool: the request -> KV slot table.

``req_to_token[row, pos]`` is the KV slot of token ``pos`` of the request that owns ``row``.
"""

from __future__ import annotations

import torch


class ReqToTokenPool:
    """Rows of a ``[size, max_context_len]`` int32 slot table on ``device``, one per request."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        # [size, max_context_len] int32 slot ids on device
        self.req_to_token = torch.zeros(
            (size, max_context_len), dtype=torch.int32, device=self.device
        )
        self.free_slots: list[int] = []
        self._is_free: list[bool] = []
        self.clear()

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, n: int = 1) -> list[int] | None:
        """``n`` free rows, or None when fewer than ``n`` are free."""
        if n > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        for r in rows:
            self._is_free[r] = False
        return rows

    def free(self, idx: int | list[int]) -> None:
        """Return rows to the pool; freeing a free row raises ``ValueError`` (double free)."""
        rows = [idx] if isinstance(idx, int) else list(idx)
        for r in rows:
            if self._is_free[r]:
                raise ValueError(f"req_to_token row {r} freed twice")
            self._is_free[r] = True
        self.free_slots.extend(rows)

    def write(self, indices: tuple[int, slice], values: torch.Tensor) -> None:
        """``req_to_token[indices] = values`` (values: int64/int32 slots, cast to int32)."""
        self.req_to_token[indices] = values.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))
        self._is_free = [True] * self.size
