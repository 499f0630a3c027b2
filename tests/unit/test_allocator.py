"""TokenToKVPoolAllocator and ReqToTokenPool: behaviour and property tests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache import ReqToTokenPool, TokenToKVPoolAllocator


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_free_roundtrip(page_size: int) -> None:
    alloc = TokenToKVPoolAllocator(size=8 * page_size, page_size=page_size, device="cpu")
    assert alloc.available_size() == 8 * page_size
    slots = alloc.alloc(3 * page_size)
    assert slots is not None and slots.dtype == torch.int64
    assert slots.numel() == 3 * page_size
    # page-contiguous, never the padding page 0
    pages = slots.view(3, page_size)
    assert torch.equal(pages - pages[:, :1], torch.arange(page_size).expand(3, page_size))
    assert bool((pages[:, 0] % page_size == 0).all()) and int(slots.min()) >= page_size
    assert alloc.available_size() == 5 * page_size
    alloc.free(slots)
    assert alloc.available_size() == 8 * page_size
    assert torch.equal(alloc.debug_free_pages(), torch.arange(1, 9))


def test_freed_pages_come_back_sorted_in_runs() -> None:
    """Pages freed in any order are handed out again sorted, once the sorted free list runs
    short: what one allocation gets is runs of consecutive pages (slice copies between tiers)."""
    alloc = TokenToKVPoolAllocator(size=16, page_size=1, device="cpu")
    everything = alloc.alloc(16)
    order = torch.tensor([9, 3, 12, 4, 11, 10, 5, 2])
    alloc.free(everything[order - 1])  # scattered frees, two runs: 2..5, 9..12
    assert alloc.available_size() == 8
    assert alloc.alloc(8).tolist() == [2, 3, 4, 5, 9, 10, 11, 12]
    alloc.free(torch.tensor([7, 1, 6]))
    assert alloc.alloc(2).tolist() == [1, 6] and alloc.alloc(1).tolist() == [7]


def test_alloc_exhaustion_and_clear() -> None:
    alloc = TokenToKVPoolAllocator(size=16, page_size=4, device="cpu")
    assert alloc.alloc(20) is None
    assert alloc.alloc(16) is not None
    assert alloc.available_size() == 0 and alloc.alloc(4) is None
    alloc.clear()
    assert alloc.available_size() == 16


def test_alloc_requires_page_multiple() -> None:
    alloc = TokenToKVPoolAllocator(size=16, page_size=4, device="cpu")
    with pytest.raises(ValueError):
        alloc.alloc(3)
    with pytest.raises(ValueError):
        TokenToKVPoolAllocator(size=10, page_size=4, device="cpu")


def test_free_partial_slots_frees_whole_page() -> None:
    alloc = TokenToKVPoolAllocator(size=16, page_size=4, device="cpu")
    slots = alloc.alloc(8)
    assert slots is not None
    alloc.free(slots[1:3])  # two slots of the first page: the whole page returns
    assert alloc.available_size() == 12
    assert int(slots[0]) // 4 in alloc.debug_free_pages().tolist()


def test_alloc_pages_and_free_group() -> None:
    alloc = TokenToKVPoolAllocator(size=32, page_size=4, device="cpu")
    pages = alloc.alloc_pages(3)
    assert pages is not None and pages.tolist() == [1, 2, 3]
    slots = pages[:, None] * 4 + torch.arange(4)
    alloc.free_group_begin()
    alloc.free(slots[0])
    alloc.free(slots[1:].reshape(-1))
    assert alloc.available_size() == 20  # pending until the group ends
    alloc.free_group_end()
    assert alloc.available_size() == 32
    alloc.free(torch.empty(0, dtype=torch.int64))  # empty free is a no-op
    assert alloc.available_size() == 32


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40),
)
def test_alloc_free_property(page_size: int, ops: list[tuple[bool, int]]) -> None:
    """Held slots and free slots partition 1..num_pages, whatever the op order."""
    num_pages = 12
    alloc = TokenToKVPoolAllocator(size=num_pages * page_size, page_size=page_size, device="cpu")
    held: list[torch.Tensor] = []
    for do_alloc, n in ops:
        if do_alloc:
            out = alloc.alloc(n * page_size)
            if out is None:
                assert alloc.available_size() < n * page_size
            else:
                held.append(out)
        elif held:
            alloc.free(held.pop(n % len(held)))
        in_use = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        every = torch.cat((in_use, alloc.debug_free_slots()))
        assert torch.equal(
            torch.sort(every).values, torch.arange(page_size, (num_pages + 1) * page_size)
        )


def test_req_to_token_pool() -> None:
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    assert pool.req_to_token.shape == (3, 8) and pool.req_to_token.dtype == torch.int32
    rows = pool.alloc(2)
    assert rows is not None and len(set(rows)) == 2 and pool.available_size() == 1
    assert pool.alloc(2) is None
    pool.write((rows[0], slice(0, 3)), torch.tensor([5, 6, 7], dtype=torch.int64))
    assert pool.req_to_token[rows[0], :3].tolist() == [5, 6, 7]
    pool.free(rows[0])
    with pytest.raises(ValueError):
        pool.free(rows[0])
    pool.free([rows[1]])
    assert pool.available_size() == 3
    pool.alloc(3)
    pool.clear()
    assert pool.available_size() == 3
