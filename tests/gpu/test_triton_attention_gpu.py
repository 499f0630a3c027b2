"""The ``triton`` attention backend's compiled kernels on CUDA == ``torch_native`` (fp32 and
bf16; ragged extend without and with a cached prefix, then decode; GQA; shuffled slots)."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import create_backend
from engine.runtime.layers.radix_attention import RadixAttention
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
NUM_SLOTS = 4096


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (12, 4, 128), (6, 2, 80)])
def test_triton_matches_torch_native_on_cuda(dtype, atol, heads, kv_heads, head_dim):
    dev = "cuda"
    torch.manual_seed(0)
    req_pool = ReqToTokenPool(8, 1024, dev)
    pools = {
        name: MHATokenToKVPool(NUM_SLOTS, 1, dtype, kv_heads, head_dim, 1, dev)
        for name in ("torch_native", "triton")
    }
    backends = {name: create_backend(name, None) for name in pools}
    layer = RadixAttention(0, heads, kv_heads, head_dim)
    free = (torch.randperm(NUM_SLOTS) + 1).tolist()
    rows = req_pool.alloc(4)
    lens = [0, 0, 0, 0]
    steps = [
        (ForwardMode.EXTEND, [129, 1, 64, 300]),
        (ForwardMode.EXTEND, [17, 1, 200, 33]),
        (ForwardMode.DECODE, [1, 1, 1, 1]),
    ]
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)
    for mode, ext in steps:
        prefix = list(lens)
        seq = [p + n for p, n in zip(prefix, ext)]
        locs = []
        for r, p, n in zip(rows, prefix, ext):
            loc = i64([free.pop() for _ in range(n)])
            req_pool.write((r, slice(p, p + n)), loc)
            locs.append(loc)
        lens = seq
        t = sum(ext)
        q = torch.randn(t, heads * head_dim, device=dev).to(dtype)
        k = torch.randn(t, kv_heads * head_dim, device=dev).to(dtype)
        v = torch.randn(t, kv_heads * head_dim, device=dev).to(dtype)
        is_extend = mode == ForwardMode.EXTEND
        outs = {}
        for name, backend in backends.items():
            fb = ForwardBatch(
                forward_mode=mode,
                batch_size=len(rows),
                input_ids=torch.zeros(t, dtype=torch.int64, device=dev),
                positions=torch.cat([torch.arange(p, s, device=dev) for p, s in zip(prefix, seq)]),
                out_cache_loc=torch.cat(locs),
                req_pool_indices=i64(rows),
                seq_lens=i64(seq),
                extend_prefix_lens=i64(prefix) if is_extend else None,
                extend_seq_lens=i64(ext) if is_extend else None,
                seq_lens_cpu=seq,
                extend_prefix_lens_cpu=prefix if is_extend else None,
                extend_seq_lens_cpu=ext if is_extend else None,
                req_to_token_pool=req_pool,
                token_to_kv_pool=pools[name],
                attn_backend=backend,
            )
            backend.init_forward_metadata(fb)
            outs[name] = backend.forward(q, k, v, layer, fb)
        torch.testing.assert_close(
            outs["triton"].float(), outs["torch_native"].float(), atol=atol, rtol=0
        )
