"""Torch reference transfers vs naive per-token loops; ``direct`` == ``kernel`` reference."""

from __future__ import annotations

import pytest
import torch

from hicache.kernels import (
    gather_tokens,
    merge_runs,
    scatter_tokens,
    transfer_all_layer,
    transfer_per_layer,
)

L, H, D = 3, 2, 4
HOST_SIZE = 64


def make(layout: str, page_size: int, dev_slots: int = 48):
    g = torch.Generator().manual_seed(page_size * 7 + len(layout))
    shape = (2, L, HOST_SIZE, H, D) if layout == "layer_first" else (2, HOST_SIZE, L, H, D)
    host = torch.randn(shape, generator=g)
    dk = [torch.randn(dev_slots, H, D, generator=g) for _ in range(L)]
    dv = [torch.randn(dev_slots, H, D, generator=g) for _ in range(L)]
    return host, dk, dv


def host_row(host, kv, layer, slot, layout):
    return host[kv, layer, slot] if layout == "layer_first" else host[kv, slot, layer]


def patterns(page_size: int) -> list[tuple[list[int], list[int]]]:
    """(host pages, device pages): contiguous, reversed, scattered, with skipped negatives."""
    return [
        ([0, 1, 2], [1, 2, 3]),
        ([3, 2, 1, 0], [2, 1, 5, 4]),
        ([1, 3, 2], [4, 1, 2]),
        ([0, -1, 2, 3], [1, 2, -1, 4]),
        ([], []),
    ]


def slots(pages: list[int], page_size: int) -> torch.Tensor:
    """Page ids -> token slots (negative pages -> -1 slots), int64."""
    out = [p * page_size + i if p >= 0 else -1 for p in pages for i in range(page_size)]
    return torch.tensor(out, dtype=torch.int64)


CASES = [(lay, ps, i) for lay in ("layer_first", "page_first") for ps in (1, 16) for i in range(5)]


@pytest.mark.parametrize("layout,page_size,case", CASES)
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_per_layer_matches_loop(layout, page_size, case, io_backend):
    host_pages, dev_pages = patterns(page_size)[case]
    host, dk, dv = make(layout, page_size, dev_slots=6 * page_size)
    hi, di = slots(host_pages, page_size), slots(dev_pages, page_size)
    want_k, want_v = [b.clone() for b in dk], [b.clone() for b in dv]
    for layer in range(L):
        for h, d in zip(hi.tolist(), di.tolist()):
            if h >= 0 and d >= 0:
                want_k[layer][d] = host_row(host, 0, layer, h, layout)
                want_v[layer][d] = host_row(host, 1, layer, h, layout)
        transfer_per_layer(host, dk[layer], dv[layer], hi, di, layer, layout, page_size, io_backend)
    for layer in range(L):
        assert torch.equal(dk[layer], want_k[layer]) and torch.equal(dv[layer], want_v[layer])


@pytest.mark.parametrize("layout,page_size,case", CASES)
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_all_layer_matches_loop(layout, page_size, case, io_backend):
    host_pages, dev_pages = patterns(page_size)[case]
    host, dk, dv = make(layout, page_size, dev_slots=6 * page_size)
    hi, di = slots(host_pages, page_size), slots(dev_pages, page_size)
    want = host.clone()
    for layer in range(L):
        for h, d in zip(hi.tolist(), di.tolist()):
            if h >= 0 and d >= 0:
                host_row(want, 0, layer, h, layout).copy_(dk[layer][d])
                host_row(want, 1, layer, h, layout).copy_(dv[layer][d])
    transfer_all_layer(dk, dv, host, di, hi, layout, page_size, io_backend)
    assert torch.equal(host, want)
    if hi.numel() and bool((hi >= 0).all()) and bool((di >= 0).all()):
        assert not torch.equal(host, make(layout, page_size, 6 * page_size)[0])


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_flat_gather_scatter_roundtrip(layout):
    host, _, _ = make(layout, 1)
    idx = torch.tensor([5, 0, 63, 17, 18], dtype=torch.int64)
    flat = gather_tokens(host, idx, layout)
    assert flat.is_contiguous()
    for j, s in enumerate(idx.tolist()):
        for layer in range(L):
            row = flat[0, layer, j] if layout == "layer_first" else flat[0, j, layer]
            assert torch.equal(row, host_row(host, 0, layer, s, layout))
    out = torch.empty_like(flat)
    assert torch.equal(gather_tokens(host, idx, layout, out=out), flat)
    other = torch.zeros_like(host)
    scatter_tokens(other, idx, layout, flat)
    assert torch.equal(gather_tokens(other, idx, layout), flat)
    untouched = torch.ones(HOST_SIZE, dtype=torch.bool)
    untouched[idx] = False
    dim = 2 if layout == "layer_first" else 1
    assert not other.index_select(dim, torch.nonzero(untouched).flatten()).any()


def test_merge_runs():
    src = torch.tensor([4, 5, 6, 9, -1, 10, 3, 2])
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8])
    # (9,3),(10,5) are not a run: dst steps by 2 after dropping the negative pair
    assert merge_runs(src, dst) == [(4, 0, 3), (9, 3, 1), (10, 5, 1), (3, 7, 1), (2, 8, 1)]
    assert (
        merge_runs(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)) == []
    )


def test_bad_backend_and_layout():
    host, dk, dv = make("layer_first", 1)
    idx = torch.tensor([1])
    with pytest.raises(ValueError):
        transfer_per_layer(host, dk[0], dv[0], idx, idx, 0, "layer_first", 1, "magic")
    with pytest.raises(ValueError):
        transfer_per_layer(host, dk[0], dv[0], idx, idx, 0, "page_middle", 1)
