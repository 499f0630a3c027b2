"""HiCache on CUDA: the controller's copies on their own streams (pinned host pool, both io
backends, both layouts, page 1/16) land the exact bytes, layer by layer, behind per-layer events
the compute stream waits on; the engine's greedy tokens are equal whether a prefix is served
from L1, L2 or L3, for every GPU attention backend."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from engine import Engine
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.host_pool import MHATokenToKVPoolHost
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.transfer.controller import HiCacheController

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
L, H, D = 4, 2, 64
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
BACKENDS = ["triton", "torch_native"] + (
    ["flashinfer"] if importlib.util.find_spec("flashinfer") else []
)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_controller_streams_roundtrip(layout, io_backend, page_size):
    dev = torch.device("cuda")
    size = 512
    alloc = TokenToKVPoolAllocator(size, page_size, dev)
    pool = MHATokenToKVPool(size, page_size, torch.bfloat16, H, D, L, dev)
    host = MHATokenToKVPoolHost(2 * size, page_size, torch.bfloat16, H, D, L, layout=layout)
    assert host.kv_buffer.is_pinned()
    ctl = HiCacheController(pool, host, alloc, io_backend=io_backend)
    try:
        src = alloc.alloc(8 * page_size)  # scattered pages after a shuffle below
        for layer in range(L):
            k = torch.randn(len(src), H, D, device=dev).to(torch.bfloat16)
            pool.set_kv_buffer(layer, src, k, -k)
        want = [pool.k_buffer[layer][src].clone() for layer in range(L)]
        host_idx = ctl.write(src, node_id=1)
        assert host_idx is not None
        ctl.start_writing()  # issued after the writes above on the compute stream
        assert ctl.wait_idle(timeout=30)
        ctl.drain_write_acks()
        dst = ctl.load(host_idx, node_id=1)
        assert dst is not None and not torch.equal(dst, src)
        counter = ctl.start_loading()
        got = []
        for layer in range(L):  # as the forward does: the compute stream waits on layer i only
            assert counter.wait_until(layer, timeout=30)
            got.append(pool.k_buffer[layer][dst].clone())
        assert counter.wait_finished(timeout=30)
        torch.cuda.synchronize()
        for layer in range(L):
            assert torch.equal(got[layer], want[layer])
            assert torch.equal(pool.v_buffer[layer][dst], -want[layer])
        assert ctl.wait_idle(timeout=30)
        assert len(ctl.drain_load_acks()) == 1 and ctl.stats["errors"] == 0
    finally:
        ctl.shutdown()


def _prompts(n: int, seed: int, length: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("io_backend", ["kernel", "direct"])
def test_greedy_equal_across_tiers_on_cuda(tiny_llama_dir, tmp_path, backend, io_backend):
    conv = _prompts(1, seed=3)[0]
    fillers = _prompts(6, seed=4, length=70)
    common = {
        "device": "cuda",
        "dtype": "float32",
        "attention_backend": backend,
        "page_size": 16,
        "debug_check_invariants": True,
    }

    def two_turns(**opts):
        with Engine(tiny_llama_dir, **common, **opts) as eng:
            first = eng.generate(conv, GREEDY)
            for p in fillers:  # push the conversation out of a small L1
                eng.generate(p, GREEDY)
            second = eng.generate(conv + first.token_ids + [5, 6, 7], GREEDY)
            return first, second, eng.cache_stats()

    f1, s1, _ = two_turns(max_total_tokens=8192)  # everything stays in L1
    f2, s2, st2 = two_turns(
        max_total_tokens=256, enable_hierarchical_cache=True, hicache_io_backend=io_backend
    )
    assert st2.l2.hit_tokens > 0 and s2.cached_tokens == s1.cached_tokens > 0
    f3, s3, st3 = two_turns(
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_io_backend=io_backend,
        hicache_ratio=1.0,
        hicache_storage_backend="file",
        hicache_storage_dir=str(tmp_path / "kv"),
        hicache_storage_prefetch_policy="wait_complete",
    )
    assert st3.l3.hit_tokens > 0
    assert f1.token_ids == f2.token_ids == f3.token_ids
    assert s1.token_ids == s2.token_ids == s3.token_ids
