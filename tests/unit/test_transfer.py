"""Torch reference transfers vs naive per-token loops; ``direct`` == ``kernel`` reference."""

from __future__ import annotations

import pytest
import torch

from hicache.transfer.kernels import (
    copy_plan,
    gather_tokens,
    merge_runs,
    scatter_tokens,
    transfer,
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


# ---- the torch path's copy plans, on bigger index patterns -----------------------------------
BIG_L, BIG_HOST_PAGES, BIG_DEV_PAGES = 3, 96, 80


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same bytes, as integers: NaN payloads compare too."""
    return t.view(torch.uint8)


def _random_kv(shape, dtype, g):
    """Every bit pattern (NaNs with payloads, -0.0, denormals) for floating dtypes."""
    raw = torch.randint(
        0,
        256,
        (*shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
        generator=g,
        dtype=torch.uint8,
    )
    return raw.view(dtype)


def big_patterns(num_pages: int, g: torch.Generator) -> dict[str, tuple[list[int], list[int]]]:
    """(host pages, device pages) that steer copy plans into each branch."""
    host = torch.randperm(BIG_HOST_PAGES, generator=g)[:num_pages].tolist()
    dev = (torch.randperm(BIG_DEV_PAGES - 1, generator=g)[:num_pages] + 1).tolist()
    run_host = list(range(10, 10 + num_pages))
    run_dev = list(range(3, 3 + num_pages))
    with_neg = [p if i % 7 else -1 for i, p in enumerate(host)]
    chunks = [run_host[i : i + 8] for i in range(0, num_pages, 8)]  # runs of 8 pages, shuffled
    order = torch.randperm(len(chunks), generator=g).tolist()
    return {
        "random": (host, dev),
        "runs": (
            [p for i in order for p in chunks[i]],
            [p for i in order for p in [run_dev[j : j + 8] for j in range(0, num_pages, 8)][i]],
        ),
        "host consecutive": (run_host, dev),
        "device consecutive": (host, run_dev),
        "both consecutive": (run_host, run_dev),
        "negatives": (with_neg, dev[::-1]),
    }


BIG_CASES = [
    (lay, ps, dt, pat)
    for lay in ("layer_first", "page_first")
    for ps in (1, 4)
    for dt in (torch.float32, torch.bfloat16, torch.uint8)
    for pat in (
        "random",
        "runs",
        "host consecutive",
        "device consecutive",
        "both consecutive",
        "negatives",
    )
    if dt == torch.float32 or pat in ("random", "runs")
]  # dtypes: views, not plans


def _big(layout, page_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    size = BIG_HOST_PAGES * page_size
    shape = (2, BIG_L, size, H, D) if layout == "layer_first" else (2, size, BIG_L, H, D)
    host = _random_kv(shape, dtype, g)
    dk = [_random_kv((BIG_DEV_PAGES * page_size, H, D), dtype, g) for _ in range(BIG_L)]
    dv = [_random_kv((BIG_DEV_PAGES * page_size, H, D), dtype, g) for _ in range(BIG_L)]
    return host, dk, dv, g


# Module constants (copy_plan, transfer) per mode. RUN_BYTES / FLAT_RUN_PAGES 1 copy every
# joint run as a slice, 1 << 60 never (the indexed branches); FLAT_SMALL_ROW decides whether
# host <-> flat copies consider runs at all (0: only a single run); SMALL_PLAN 0 plans with
# tensor ops, 1 << 20 on Python lists.
PLAN_MODES = {
    "slices-lists": {
        "RUN_BYTES": 1,
        "FLAT_RUN_PAGES": 1,
        "FLAT_SMALL_ROW": 1 << 60,
        "SMALL_PLAN": 1 << 20,
    },
    "slices-tensors": {
        "RUN_BYTES": 1,
        "FLAT_RUN_PAGES": 1,
        "FLAT_SMALL_ROW": 1 << 60,
        "SMALL_PLAN": 0,
    },
    "indexed-lists": {"RUN_BYTES": 1 << 60, "FLAT_RUN_PAGES": 1 << 60, "SMALL_PLAN": 1 << 20},
    "indexed-tensors": {"RUN_BYTES": 1 << 60, "FLAT_RUN_PAGES": 1 << 60, "SMALL_PLAN": 0},
    "big-flat-rows-tensors": {"FLAT_SMALL_ROW": 0, "SMALL_PLAN": 0},
}


def _set_mode(monkeypatch, mode: str) -> None:
    for name, value in PLAN_MODES[mode].items():
        module = copy_plan if hasattr(copy_plan, name) else transfer
        monkeypatch.setattr(module, name, value)


@pytest.fixture(params=list(PLAN_MODES))
def plan_mode(request, monkeypatch):
    _set_mode(monkeypatch, request.param)
    return request.param


@pytest.mark.parametrize("layout,page_size,dtype,pattern", BIG_CASES)
def test_big_patterns_match_loop(layout, page_size, dtype, pattern, plan_mode):
    """Both directions, every plan branch, bit for bit (random bytes: NaN payloads included)."""
    host, dk, dv, g = _big(layout, page_size, dtype, seed=page_size + len(pattern))
    host_pages, dev_pages = big_patterns(64, g)[pattern]
    hi, di = slots(host_pages, page_size), slots(dev_pages, page_size)
    pairs = [(h, d) for h, d in zip(hi.tolist(), di.tolist()) if h >= 0 and d >= 0]

    want_host = host.clone()
    for layer in range(BIG_L):
        for h, d in pairs:
            host_row(want_host, 0, layer, h, layout).copy_(dk[layer][d])
            host_row(want_host, 1, layer, h, layout).copy_(dv[layer][d])
    got_host = host.clone()
    transfer_all_layer(dk, dv, got_host, di, hi, layout, page_size)
    assert torch.equal(_bits(got_host), _bits(want_host))

    for layer in range(BIG_L):
        want_k, want_v = dk[layer].clone(), dv[layer].clone()
        for h, d in pairs:
            want_k[d] = host_row(host, 0, layer, h, layout)
            want_v[d] = host_row(host, 1, layer, h, layout)
        got_k, got_v = dk[layer].clone(), dv[layer].clone()
        transfer_per_layer(host, got_k, got_v, hi, di, layer, layout, page_size)
        assert torch.equal(_bits(got_k), _bits(want_k)) and torch.equal(_bits(got_v), _bits(want_v))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("pattern", ["random", "runs", "host consecutive", "few"])
def test_flat_gather_scatter_pages(layout, page_size, pattern, plan_mode):
    """gather_tokens / scatter_tokens over whole pages, every branch, vs a loop ("few": the
    unplanned path of the controller's one-page-per-call L3 loops)."""
    host, _, _, g = _big(layout, page_size, torch.float32, seed=3)
    if pattern == "few":
        host_pages = big_patterns(48, g)["random"][0][: transfer.FLAT_FEW_PAGES]
    else:
        host_pages = big_patterns(48, g)[pattern][0]
    idx = slots(host_pages, page_size)
    flat = gather_tokens(host, idx, layout, page_size=page_size)
    assert flat.is_contiguous()
    for j, s in enumerate(idx.tolist()):
        for kv in (0, 1):
            for layer in range(BIG_L):
                row = flat[kv, layer, j] if layout == "layer_first" else flat[kv, j, layer]
                assert torch.equal(_bits(row), _bits(host_row(host, kv, layer, s, layout)))
    assert torch.equal(_bits(gather_tokens(host, idx, layout, page_size=1)), _bits(flat))
    other = torch.zeros_like(host)
    scatter_tokens(other, idx, layout, flat, page_size=page_size)
    assert torch.equal(_bits(gather_tokens(other, idx, layout, page_size=page_size)), _bits(flat))
    dim = 2 if layout == "layer_first" else 1
    untouched = torch.ones(host.shape[dim], dtype=torch.bool)
    untouched[idx] = False
    assert not other.index_select(dim, torch.nonzero(untouched).flatten()).any()


def test_plan_branches():
    def plan(src, dst, row_bytes=1024):
        return copy_plan.plan_copy(torch.tensor(src), torch.tensor(dst), row_bytes)

    long_runs = plan(list(range(100)) + list(range(300, 400)), list(range(200)))
    assert long_runs.runs == [(0, 0, 100), (300, 100, 100)]
    short = plan([5, 1, 9, 2], [7, 8, 9, 10])
    assert short.runs is None and short.dst_start == 7 and short.src_start is None
    short = plan([4, 5, 6, 7], [9, 1, 3, 2])
    assert short.runs is None and short.src_start == 4 and short.dst_start is None
    assert plan([4, -1, 6], [1, 2, -3]).runs == [(4, 1, 1)]  # negatives dropped, one row left
    assert plan([], []).runs == []


def test_out_of_range_raises_and_never_resizes():
    host, dk, dv = make("layer_first", 1)
    storage = dk[0].untyped_storage().nbytes()
    with pytest.raises(IndexError):  # device-consecutive destination past the end
        transfer_per_layer(
            host,
            dk[0],
            dv[0],
            torch.tensor([1, 9, 3]),
            torch.tensor([46, 47, 48]),
            0,
            "layer_first",
            1,
        )
    assert dk[0].untyped_storage().nbytes() == storage
    with pytest.raises((IndexError, RuntimeError)):
        gather_tokens(host, torch.tensor([3, HOST_SIZE]), "layer_first")
    with pytest.raises((IndexError, RuntimeError)):
        gather_tokens(host, torch.tensor([3, -1]), "layer_first")


@pytest.mark.parametrize("mode", list(PLAN_MODES))
def test_flat_negative_index_raises(monkeypatch, mode):
    _set_mode(monkeypatch, mode)
    host, _, _ = make("page_first", 1)
    for idx in (torch.arange(-1, 20), torch.tensor([5, 3, -2, 9] * 5), torch.tensor([-1])):
        with pytest.raises((IndexError, RuntimeError)):
            gather_tokens(host, idx, "page_first")
        with pytest.raises((IndexError, RuntimeError)):
            scatter_tokens(host, idx, "page_first", torch.zeros(2, idx.numel(), L, H, D))
