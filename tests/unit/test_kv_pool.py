"""MHATokenToKVPool: layout, set/get, sizing from a memory budget."""

from __future__ import annotations

import pytest
import torch

from hicache import MHATokenToKVPool


def _pool(dtype: torch.dtype = torch.float32, page_size: int = 4) -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=16, page_size=page_size, dtype=dtype, head_num=2, head_dim=8, layer_num=3, device="cpu"
    )


def test_buffer_layout() -> None:
    pool = _pool()
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    for layer in range(3):
        k, v = pool.get_kv_buffer(layer)
        assert k.shape == v.shape == (16 + 4, 2, 8)  # padding page included
        assert k.dtype == torch.float32
        assert pool.get_key_buffer(layer) is k and pool.get_value_buffer(layer) is v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_set_get_roundtrip(dtype: torch.dtype) -> None:
    pool = _pool(dtype)
    loc = torch.tensor([4, 9, 17], dtype=torch.int64)
    k = torch.randn(3, 2 * 8)  # flat [n, heads*head_dim] is accepted
    v = torch.randn(3, 2, 8)
    pool.set_kv_buffer(1, loc, k, v)
    got_k, got_v = pool.get_kv(1, loc)
    assert torch.equal(got_k, k.view(3, 2, 8).to(dtype))
    assert torch.equal(got_v, v.to(dtype))
    assert not pool.get_key_buffer(0).any() and not pool.get_key_buffer(2).any()
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[loc] = False
    assert not pool.get_value_buffer(1)[untouched].any()


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="no fp8 dtype")
def test_fp8_storage() -> None:
    pool = _pool(torch.float8_e4m3fn)
    assert pool.k_buffer[0].dtype == torch.uint8
    loc = torch.tensor([5, 6], dtype=torch.int64)
    k = torch.tensor([0.5, -2.0]).repeat_interleave(16).view(2, 2, 8)
    pool.set_kv_buffer(0, loc, k, k)
    got_k, _ = pool.get_kv(0, loc)
    assert got_k.dtype == torch.float8_e4m3fn
    assert torch.equal(got_k.float(), k)


def test_bytes_per_token_and_budget() -> None:
    pool = _pool(torch.bfloat16)
    assert pool.bytes_per_token() == 2 * 3 * 2 * 8 * 2
    per_token = pool.bytes_per_token()
    args = {"page_size": 4, "dtype": torch.bfloat16, "head_num": 2, "head_dim": 8, "layer_num": 3}
    size = MHATokenToKVPool.size_for_budget(per_token * 103, **args)
    assert size == 96  # 103 slots - 4 padding = 99 -> rounded down to a page multiple
    assert (size + 4) * per_token <= per_token * 103
    assert MHATokenToKVPool.size_for_budget(per_token * 7, **args) == 0
    assert MHATokenToKVPool.size_for_budget(0, **args) == 0
