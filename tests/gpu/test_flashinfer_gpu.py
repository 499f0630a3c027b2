"""The ``flashinfer`` attention backend on CUDA == ``torch_native`` (bf16 and fp16; ragged extend
without and with a cached prefix, then decode; GQA with and without tensor-core decode;
shuffled slots), and its decode replayed from a CUDA graph through the capture protocol."""

from __future__ import annotations

from types import SimpleNamespace

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
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

DEV = "cuda"
NUM_SLOTS = 4096
# (heads, kv_heads, head_dim): MHA, GQA 3 (CUDA-core decode), GQA 8 (tensor-core decode)
GEOMS = [(8, 8, 64), (12, 4, 128), (32, 4, 128)]


def i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64, device=DEV)


class _Harness:
    """Real pools (one per backend), shuffled slots; the same batches through every backend."""

    def __init__(self, names, heads, kv_heads, head_dim, dtype, runner=False):
        torch.manual_seed(0)
        self.dtype = dtype
        self.req_pool = ReqToTokenPool(8, 1024, DEV)
        self.pools = {
            n: MHATokenToKVPool(NUM_SLOTS, 1, dtype, kv_heads, head_dim, 1, DEV) for n in names
        }
        self.backends = {}
        for n in names:
            stub = SimpleNamespace(  # what the backend reads off a ModelRunner
                hf_config=SimpleNamespace(num_attention_heads=heads),
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                dtype=dtype,
                kv_pool=self.pools[n],
                device=torch.device(DEV),
            )
            self.backends[n] = create_backend(n, stub if runner and n == "flashinfer" else None)
        self.layer = RadixAttention(0, heads, kv_heads, head_dim)
        self.free = (torch.randperm(NUM_SLOTS) + 1).tolist()
        self.rows = self.req_pool.alloc(4)
        self.lens = [0, 0, 0, 0]

    def grow(self, ext: list[int]) -> tuple[list[int], list[int], torch.Tensor]:
        """Allocate ``ext[b]`` new slots per request; (prefix, seq, out_cache_loc)."""
        prefix = list(self.lens)
        seq = [p + n for p, n in zip(prefix, ext)]
        locs = []
        for r, p, n in zip(self.rows, prefix, ext):
            loc = i64([self.free.pop() for _ in range(n)])
            self.req_pool.write((r, slice(p, p + n)), loc)
            locs.append(loc)
        self.lens = seq
        return prefix, seq, torch.cat(locs)

    def qkv(self, n: int) -> list[torch.Tensor]:
        lay = self.layer
        heads = [lay.num_heads, lay.num_kv_heads, lay.num_kv_heads]
        return [torch.randn(n, h * lay.head_dim, device=DEV).to(self.dtype) for h in heads]

    def batch(self, name, mode, prefix, seq, locs, n: int = 4) -> ForwardBatch:
        """The batch of the first ``n`` requests."""
        prefix, seq = prefix[:n], seq[:n]
        ext = [s - p for p, s in zip(prefix, seq)]
        is_extend = mode == ForwardMode.EXTEND
        return ForwardBatch(
            forward_mode=mode,
            batch_size=n,
            input_ids=torch.zeros(len(locs), dtype=torch.int64, device=DEV),
            positions=torch.cat([torch.arange(p, s, device=DEV) for p, s in zip(prefix, seq)]),
            out_cache_loc=locs,
            req_pool_indices=i64(self.rows[:n]),
            seq_lens=i64(seq),
            extend_prefix_lens=i64(prefix) if is_extend else None,
            extend_seq_lens=i64(ext) if is_extend else None,
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=prefix if is_extend else None,
            extend_seq_lens_cpu=ext if is_extend else None,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pools[name],
            attn_backend=self.backends[name],
        )

    def step(self, mode: ForwardMode, ext: list[int]) -> dict[str, torch.Tensor]:
        prefix, seq, locs = self.grow(ext)
        q, k, v = self.qkv(len(locs))
        outs = {}
        for name, backend in self.backends.items():
            fb = self.batch(name, mode, prefix, seq, locs)
            backend.init_forward_metadata(fb)
            outs[name] = backend.forward(q, k, v, self.layer, fb)
        return outs


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2)])
@pytest.mark.parametrize("heads,kv_heads,head_dim", GEOMS)
def test_flashinfer_matches_torch_native_on_cuda(dtype, atol, heads, kv_heads, head_dim):
    h = _Harness(["torch_native", "flashinfer"], heads, kv_heads, head_dim, dtype)
    steps = [
        (ForwardMode.EXTEND, [129, 1, 64, 300]),  # no prefix, ragged
        (ForwardMode.EXTEND, [17, 1, 200, 33]),  # with a cached prefix
        (ForwardMode.DECODE, [1, 1, 1, 1]),
        (ForwardMode.DECODE, [1, 1, 1, 1]),
    ]
    for mode, ext in steps:
        outs = h.step(mode, ext)
        got, ref = outs["flashinfer"], outs["torch_native"]
        assert got.dtype == dtype and got.shape == ref.shape == (sum(ext), heads * head_dim)
        torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=0)
    a, b = h.pools["torch_native"], h.pools["flashinfer"]
    assert torch.equal(a.k_buffer[0], b.k_buffer[0]) and torch.equal(a.v_buffer[0], b.v_buffer[0])


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 64), (32, 4, 128)])
def test_flashinfer_decode_cuda_graph_replay(heads, kv_heads, head_dim):
    """Capture one decode layer for bs 4 through the capture protocol, replay it with new
    seq lens (the last replay with 3 real requests + 1 padding request) == torch_native."""
    dtype, atol = torch.bfloat16, 3e-2
    h = _Harness(["torch_native", "flashinfer"], heads, kv_heads, head_dim, dtype, runner=True)
    fi, ref = h.backends["flashinfer"], h.backends["torch_native"]
    h.step(ForwardMode.EXTEND, [100, 7, 250, 31])
    bs = 4
    fi.init_cuda_graph_state(max_bs=8, max_num_kv_tokens=8 * 1024)

    # static inputs, as the graph runner keeps them
    lay = h.layer
    s_q = torch.zeros(bs, heads * head_dim, dtype=dtype, device=DEV)
    s_k = torch.zeros(bs, kv_heads * head_dim, dtype=dtype, device=DEV)
    s_v = torch.zeros_like(s_k)
    s_loc = torch.zeros(bs, dtype=torch.int64, device=DEV)  # padding slot 0
    s_rows = i64(h.rows)
    s_seq = torch.ones(bs, dtype=torch.int64, device=DEV)

    def static_batch(seq_lens_cpu: list[int]) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=torch.zeros(bs, dtype=torch.int64, device=DEV),
            positions=torch.zeros(bs, dtype=torch.int64, device=DEV),
            out_cache_loc=s_loc,
            req_pool_indices=s_rows,
            seq_lens=s_seq,
            extend_prefix_lens=None,
            extend_seq_lens=None,
            seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=None,
            extend_seq_lens_cpu=None,
            req_to_token_pool=h.req_pool,
            token_to_kv_pool=h.pools["flashinfer"],
            attn_backend=fi,
        )

    # capture (metadata outside the graph; one eager warm-up on the capture stream)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fb = static_batch([1] * bs)
        fi.init_forward_metadata_capture(fb)
        fi.forward(s_q, s_k, s_v, lay, fb)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        fb = static_batch([1] * bs)
        fi.init_forward_metadata_capture(fb)
        with torch.cuda.graph(graph, stream=stream):
            s_out = fi.forward(s_q, s_k, s_v, lay, fb)  # [bs, heads*head_dim]
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    for n_real in (4, 4, 3):
        ext = [1] * n_real + [0] * (bs - n_real)
        prefix, seq, locs = h.grow(ext)
        q, k, v = h.qkv(n_real)
        # replay: copy the batch into the static rows, pad the rest, re-plan, replay
        rows = h.rows[:n_real] + [0] * (bs - n_real)
        seq_pad = seq[:n_real] + [1] * (bs - n_real)
        s_q.zero_()
        s_k.zero_()
        s_v.zero_()
        s_q[:n_real].copy_(q)
        s_k[:n_real].copy_(k)
        s_v[:n_real].copy_(v)
        s_loc.zero_()
        s_loc[:n_real].copy_(locs)
        s_rows.copy_(i64(rows))
        s_seq.copy_(i64(seq_pad))
        fi.init_forward_metadata_replay(static_batch(seq_pad))
        graph.replay()
        torch.cuda.synchronize()
        # the reference: the real requests only, eagerly
        fb_ref = h.batch("torch_native", ForwardMode.DECODE, prefix, seq, locs, n_real)
        ref.init_forward_metadata(fb_ref)
        want = ref.forward(q, k, v, lay, fb_ref)
        torch.testing.assert_close(s_out[:n_real].float(), want.float(), atol=atol, rtol=0)
