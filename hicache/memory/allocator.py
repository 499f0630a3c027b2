"""Paged free list of KV slots (the L1 device allocator).

Slot ids are ``0 .. size + page_size - 1``; page ``p`` owns slots ``[p*page_size, (p+1)*page_size)``.

    slot:  | 0 .. page_size-1 | page_size .. 2*page_size-1 | ... | size .. size+page_size-1 |
    page:  |  0 (padding)     |  1                         | ... |  size // page_size       |

NOTE: page 0 is the padding page (writes of padded tokens land there) and is never handed out, so
``size`` usable slots means the KV pool holds ``size + page_size`` slots.
The allocator only keeps the free list; it knows nothing of requests, trees or bytes.

Freed pages wait in ``released``; ``free_pages`` is handed out in order and, when it runs short,
refilled with everything released, sorted (SGLang's merge-and-sort): one allocation then gets
mostly runs of consecutive pages, and the tier copies of a prefix (L2 loads into those slots,
device->host writes out of them) are a few slice copies instead of a gather per page.
"""

from __future__ import annotations

import torch


class TokenToKVPoolAllocator:
    """Free list of page ids on ``device``; alloc/free are O(batch) tensor ops, no Python loops."""

    def __init__(self, size: int, page_size: int, device: torch.device | str) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if size < 0 or size % page_size != 0:
            raise ValueError(
                f"size {size} must be a non-negative multiple of page_size {page_size}"
            )
        self.size = size
        self.page_size = page_size
        self.device = torch.device(device)
        self.num_pages = size // page_size  # usable pages: ids 1 .. num_pages
        # [page_size] int64 on device: slot offsets inside one page
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.free_pages: torch.Tensor  # [n] int64 page ids on device, sorted: handed out first
        self.released: torch.Tensor  # [m] int64 page ids freed since the last merge
        self._free_group: list[torch.Tensor] | None = None
        self.clear()

    def clear(self) -> None:
        """Every usable page free again (page 0 stays reserved)."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.released = self.free_pages[:0]
        self._free_group = None

    def available_size(self) -> int:
        """Free slots (= free pages * page_size); frees pending in an open group do not count."""
        return int(self.free_pages.numel() + self.released.numel()) * self.page_size

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Take ``num_pages`` page ids off the free list; None when not enough are free."""
        if num_pages > self.free_pages.numel():
            if num_pages > self.free_pages.numel() + self.released.numel():
                return None
            self.free_pages = torch.sort(torch.cat((self.free_pages, self.released))).values
            self.released = self.released[:0]
        out = self.free_pages[:num_pages]  # [num_pages] int64 on device
        self.free_pages = self.free_pages[num_pages:]
        return out

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` slots (a multiple of page_size) as whole pages, page-contiguous."""
        if need_size % self.page_size != 0:
            raise ValueError(f"need_size {need_size} is not a multiple of {self.page_size}")
        pages = self.alloc_pages(need_size // self.page_size)
        if pages is None:
            return None
        if self.page_size == 1:
            return pages
        # [num_pages, page_size] -> [need_size] int64 slots on device
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages ``slots`` belong to.

        NOTE: each page touched by ``slots`` must be wholly owned by the caller: freeing one slot
        of a page frees the whole page.
        """
        if slots.numel() == 0:
            return
        slots = slots.to(device=self.device, dtype=torch.int64)
        pages = slots if self.page_size == 1 else torch.unique(slots // self.page_size)
        if self._free_group is not None:
            self._free_group.append(pages)
        else:
            self.released = torch.cat((self.released, pages))

    def free_group_begin(self) -> None:
        """Start batching frees; they reach the free list in one ``cat`` at ``free_group_end``."""
        if self._free_group is None:
            self._free_group = []

    def free_group_end(self) -> None:
        group, self._free_group = self._free_group, None
        if group:
            self.released = torch.cat((self.released, *group))

    def debug_free_pages(self) -> torch.Tensor:
        """Sorted free page ids ([num_free_pages] int64 on CPU), for invariant checks."""
        return torch.sort(torch.cat((self.free_pages, self.released)).cpu()).values

    def debug_free_slots(self) -> torch.Tensor:
        """Sorted free slot ids ([num_free_pages * page_size] int64 on CPU)."""
        pages = self.debug_free_pages()
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
