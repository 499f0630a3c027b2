"""MHATokenToKVPoolHost: sizing, layouts, paged allocator with protect/release, copies."""

from __future__ import annotations

import random

import pytest
import torch

from hicache.memory.host_pool import MHATokenToKVPoolHost, host_pool_size
from hicache.memory.kv_pool import MHATokenToKVPool

L, H, D = 3, 2, 4


def pool(layout="layer_first", size=64, page_size=4, dtype=torch.float32) -> MHATokenToKVPoolHost:
    return MHATokenToKVPoolHost(size, page_size, dtype, H, D, L, layout=layout)


def check_invariant(p: MHATokenToKVPoolHost, in_use: int) -> None:
    assert p.available_size() + p.pending_free_size() + in_use == p.size
    assert len(set(p.debug_free_pages().tolist())) == p.debug_free_pages().numel()


def test_shapes_and_size():
    assert pool("layer_first", size=66).kv_buffer.shape == (2, L, 64, H, D)
    assert pool("page_first").kv_buffer.shape == (2, 64, L, H, D)
    assert not pool().kv_buffer.is_pinned()  # no CUDA here
    with pytest.raises(ValueError):
        pool(layout="sideways")
    with pytest.raises(ValueError):
        pool(size=3)
    assert host_pool_size(1000, 16, 1024, hicache_ratio=2.0) == 2000
    assert host_pool_size(1000, 16, 1000, hicache_ratio=2.0, hicache_size_gb=0.001) == 992
    assert pool(dtype=torch.float8_e4m3fn).kv_buffer.dtype == torch.uint8


def test_freed_pages_come_back_sorted_in_runs():
    p = pool(size=32, page_size=4)  # 8 pages
    everything = p.alloc(32)
    for page in (6, 1, 7, 2):  # freed scattered; one released while a copy protects it
        p.free(everything[page * 4 : page * 4 + 4])
    p.protect(everything[12:16])
    p.free(everything[12:16])  # page 3: pending until released
    assert p.alloc(20) is None
    p.release(everything[12:16])
    assert (p.alloc(20) // 4).tolist()[::4] == [1, 2, 3, 6, 7]
    check_invariant(p, 32)


def test_alloc_free_pages():
    p = pool()
    a = p.alloc(8)
    assert a.dtype == torch.int64 and a.tolist() == list(range(8))
    with pytest.raises(ValueError):
        p.alloc(6)
    assert p.alloc(64) is None
    check_invariant(p, 8)
    p.free(a)
    assert p.available_size() == 64
    with pytest.raises(ValueError):
        p.free(a)  # double free


def test_free_of_protected_page_is_deferred():
    p = pool()
    a = p.alloc(8)
    p.protect(a[:4])
    p.protect(a[:4])
    assert p.protected_size() == 4
    p.free(a)
    assert p.available_size() == 60 and p.pending_free_size() == 4
    p.release(a[:4])
    assert p.available_size() == 60  # still one copy in flight
    p.release(a[:4])
    assert p.available_size() == 64 and p.pending_free_size() == 0 and p.protected_size() == 0
    with pytest.raises(ValueError):
        p.release(a[:4])
    with pytest.raises(ValueError):
        p.protect(a[:4])  # free pages cannot be protected


def test_random_ops_keep_invariant():
    rng = random.Random(0)
    p = pool(size=128, page_size=4)
    owned: list[torch.Tensor] = []
    protected: list[torch.Tensor] = []
    for _ in range(400):
        op = rng.random()
        if op < 0.4:
            got = p.alloc(4 * rng.randint(1, 5))
            if got is not None:
                owned.append(got)
        elif op < 0.6 and owned:
            x = owned[rng.randrange(len(owned))]
            p.protect(x)
            protected.append(x)
        elif op < 0.8 and protected:
            p.release(protected.pop(rng.randrange(len(protected))))
        elif owned:
            p.free(owned.pop(rng.randrange(len(owned))))
        check_invariant(p, sum(x.numel() for x in owned))
        live = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        free_slots = {s for pg in p.debug_free_pages().tolist() for s in range(pg * 4, pg * 4 + 4)}
        assert not set(live.tolist()) & free_slots
    for x in protected:
        p.release(x)
    for x in owned:
        p.free(x)
    assert p.available_size() == p.size


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_backup_then_load_roundtrip(layout, page_size, io_backend):
    dev = MHATokenToKVPool(128, page_size, torch.float32, H, D, L, "cpu")
    for layer in range(L):
        dev.k_buffer[layer].normal_()
        dev.v_buffer[layer].normal_()
    p = pool(layout, size=64, page_size=page_size)
    dev_idx = torch.arange(page_size, page_size + 12, dtype=torch.int64)  # 12 tokens, page 1 on
    host_idx = p.alloc(dev_idx.numel())
    p.backup_from_device_all_layer(dev, host_idx, dev_idx, io_backend)
    flat = p.get_flat_data(host_idx)
    tdim = p.flat_token_dim
    assert flat.shape[tdim] == dev_idx.numel() and flat.is_contiguous()
    k0 = flat[0, 1] if layout == "layer_first" else flat[0, :, 1]
    assert torch.equal(k0, dev.k_buffer[1][dev_idx])
    # load back into other device slots, layer by layer
    target = torch.arange(16 * page_size, 16 * page_size + dev_idx.numel(), dtype=torch.int64)
    for layer in range(L):
        p.load_to_device_per_layer(dev, host_idx, target, layer, io_backend)
        assert torch.equal(dev.k_buffer[layer][target], dev.k_buffer[layer][dev_idx])
        assert torch.equal(dev.v_buffer[layer][target], dev.v_buffer[layer][dev_idx])
    # flat data into fresh host slots reproduces it
    other = p.alloc(dev_idx.numel())
    p.set_from_flat_data(other, flat)
    assert torch.equal(p.get_flat_data(other), flat)
    other_layout = "page_first" if layout == "layer_first" else "layer_first"
    assert p.storage_fingerprint() != pool(other_layout, page_size=page_size).storage_fingerprint()


def test_oversized_host_pool_is_refused_before_allocating(monkeypatch):
    monkeypatch.setattr("hicache.memory.host_pool.available_host_memory", lambda: 3 << 30)
    # 2 (K, V) x 4 layers x 2**22 tokens x 8 x 16 x 4 B = 16 GiB > 3 GiB - 2 GiB reserve
    with pytest.raises(
        ValueError,
        match="host KV pool of 4194304 tokens needs 16.0 GiB but only "
        "3.0 GiB .* lower hicache_ratio or set hicache_size",
    ):
        MHATokenToKVPoolHost(1 << 22, 1, torch.float32, 8, 16, 4)
    MHATokenToKVPoolHost(1 << 10, 1, torch.float32, 8, 16, 4)  # 32 MiB fits
