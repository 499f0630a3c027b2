"""The ``cpu`` attention backend (csrc/attention.h): one numeric path for EXTEND and DECODE. A
query row's output is the same bits whatever shares the forward (other requests, their lengths,
its place in the batch), however its request's tokens are split into forwards (one prefill,
chunks of any size, decode steps), and wherever its keys are read from (the device pool, or the
host pool for slots still loading); and it equals SDPA's up to float rounding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers import cpu_kernels
from engine.runtime.layers.attention import create_backend
from engine.runtime.layers.radix_attention import RadixAttention
from hicache.l2.tier import HostReads
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

pytestmark = pytest.mark.skipif(
    cpu_kernels.KERNELS.get() is None, reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}"
)


class World:
    """Requests with fixed q / k / v per token, their KV at scattered slots of a pool."""

    def __init__(self, lens: list[int], heads: int, kv_heads: int, hd: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lens, self.heads, self.kv_heads, self.hd = lens, heads, kv_heads, hd
        total = sum(lens)
        self.pool = MHATokenToKVPool(total + 16, 1, torch.float32, kv_heads, hd, 1, "cpu")
        self.r2t = ReqToTokenPool(len(lens) + 2, max(lens) + 8, "cpu")
        perm = torch.randperm(total, generator=g) + 1
        self.rows = (torch.randperm(len(lens) + 2, generator=g)[: len(lens)]).tolist()
        self.slots, start = [], 0
        for row, n in zip(self.rows, lens, strict=True):
            s = perm[start : start + n]
            self.r2t.req_to_token[row, :n] = s.to(torch.int32)
            self.slots.append(s)
            start += n
        self.q = [torch.randn(n, heads * hd, generator=g) for n in lens]
        self.k = [torch.randn(n, kv_heads * hd, generator=g) for n in lens]
        self.v = [torch.randn(n, kv_heads * hd, generator=g) for n in lens]
        self.layer = RadixAttention(0, heads, kv_heads, hd)
        self.backend = create_backend("cpu", None)

    def forward(
        self, parts: list[tuple[int, int, int]], decode: bool = False, host: HostReads | None = None
    ) -> dict[tuple[int, int], torch.Tensor]:
        """One forward of ``(request, first, end)`` query ranges (each request's tokens before
        ``first`` already in the pool); returns ``{(request, position): output row}``."""
        cat = torch.cat
        q = cat([self.q[b][a:e] for b, a, e in parts])
        k = cat([self.k[b][a:e] for b, a, e in parts])
        v = cat([self.v[b][a:e] for b, a, e in parts])
        ext = [e - a for _, a, e in parts]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            batch_size=len(parts),
            input_ids=torch.zeros(len(q), dtype=torch.int64),
            positions=cat([torch.arange(a, e) for _, a, e in parts]),
            out_cache_loc=cat([self.slots[b][a:e] for b, a, e in parts]),
            req_pool_indices=torch.tensor([self.rows[b] for b, _, _ in parts]),
            seq_lens=torch.tensor([e for _, _, e in parts]),
            extend_prefix_lens=None if decode else torch.tensor([a for _, a, _ in parts]),
            extend_seq_lens=None if decode else torch.tensor(ext),
            seq_lens_cpu=[e for _, _, e in parts],
            extend_prefix_lens_cpu=None if decode else [a for _, a, _ in parts],
            extend_seq_lens_cpu=None if decode else ext,
            req_to_token_pool=self.r2t,
            token_to_kv_pool=self.pool,
            attn_backend=self.backend,
            host_reads=host,
        )
        self.backend.init_forward_metadata(fb)
        out = self.backend.forward(q, k, v, self.layer, fb)
        rows, i = {}, 0
        for b, a, e in parts:
            for pos in range(a, e):
                rows[b, pos] = out[i]
                i += 1
        return rows

    def sdpa(self, b: int) -> torch.Tensor:
        """Causal SDPA over request b's tokens: [n, heads * hd]."""
        n, group = self.lens[b], self.heads // self.kv_heads
        q = self.q[b].view(n, self.heads, self.hd).transpose(0, 1)
        k = self.k[b].view(n, self.kv_heads, self.hd).repeat_interleave(group, 1).transpose(0, 1)
        v = self.v[b].view(n, self.kv_heads, self.hd).repeat_interleave(group, 1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(0, 1).reshape(n, -1)


def _cuts(draw, n: int) -> list[int]:
    """Random chunk boundaries 0 < c1 < ... < n."""
    inner = draw(st.lists(st.integers(1, max(1, n - 1)), max_size=4, unique=True))
    return sorted({0, n, *(c for c in inner if 0 < c < n)})


@settings(max_examples=30, deadline=None)
@given(
    data=st.data(),
    nreq=st.integers(1, 4),
    group=st.sampled_from([1, 3, 4]),
    hd=st.sampled_from([8, 64, 72]),
    seed=st.integers(0, 2**16),
)
def test_a_row_is_the_same_in_any_forward(data, nreq, group, hd, seed):
    lens = data.draw(st.lists(st.integers(1, 700), min_size=nreq, max_size=nreq))
    w = World(lens, heads=2 * group, kv_heads=2, hd=hd, seed=seed)
    # reference: each request alone, one prefill of all its tokens
    ref: dict[tuple[int, int], torch.Tensor] = {}
    for b, n in enumerate(lens):
        ref.update(w.forward([(b, 0, n)]))
        torch.testing.assert_close(
            torch.stack([ref[b, p] for p in range(n)]), w.sdpa(b), rtol=1e-4, atol=1e-5
        )
    # all requests in one forward, in a random order
    order = data.draw(st.permutations(range(nreq)))
    got = w.forward([(b, 0, lens[b]) for b in order])
    assert all(torch.equal(got[key], ref[key]) for key in got)
    # each request in random chunks, chunk i of every request in the same forward
    cuts = [_cuts(data.draw, n) for n in lens]
    for i in range(max(len(c) for c in cuts) - 1):
        parts = [(b, c[i], c[i + 1]) for b, c in enumerate(cuts) if i + 1 < len(c)]
        got = w.forward(parts)
        assert all(torch.equal(got[key], ref[key]) for key in got), (i, parts)
    # decode steps of every request's last tokens, batched
    for back in (3, 2, 1):
        parts = [(b, n - back, n - back + 1) for b, n in enumerate(lens) if n >= back]
        if not parts:
            continue
        got = w.forward(parts, decode=True)
        assert all(torch.equal(got[key], ref[key]) for key in got)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), n=st.integers(2, 900), seed=st.integers(0, 2**16), page_first=st.booleans())
def test_keys_read_from_the_host_pool_give_the_same_rows(data, n, seed, page_first):
    """Slots still loading are read in place from the host copy (host_row table), as the CPU's
    hold-and-read does for an L2 hit: the same bytes, so the same bits; the device pool's
    stale rows there are never read."""
    w = World([n], heads=6, kv_heads=2, hd=64, seed=seed)
    ref = w.forward([(0, 0, n)])
    prefix = data.draw(st.integers(1, n - 1))
    loading = w.slots[0][:prefix][
        torch.rand(prefix, generator=torch.Generator().manual_seed(seed)) < 0.6
    ]
    layers = 3
    shape = (
        (loading.numel() + 5, layers, 2, 64) if page_first else (layers, loading.numel() + 5, 2, 64)
    )
    hk, hv = torch.randn(shape), torch.randn(shape)
    host_rows = torch.randperm(loading.numel() + 5)[: loading.numel()]
    k_buf, v_buf = w.pool.get_kv_buffer(0)

    def layer_kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (hk[:, layer], hv[:, layer]) if page_first else (hk[layer], hv[layer])

    lk, lv = layer_kv(0)
    lk[host_rows], lv[host_rows] = k_buf[loading], v_buf[loading]
    k_buf[loading] = float("nan")  # the device copy has not landed
    v_buf[loading] = float("nan")
    got = w.forward([(0, prefix, n)], host=HostReads(loading, host_rows, layer_kv))
    assert all(torch.equal(got[key], ref[key]) for key in got)


def test_shapes_the_kernel_does_not_take_are_refused():
    with pytest.raises(ValueError, match="head_dim"):
        create_backend(
            "cpu",
            type(
                "R",
                (),
                {
                    "hf_config": type(
                        "C",
                        (),
                        {
                            "num_attention_heads": 4,
                            "num_key_value_heads": 4,
                            "head_dim": 12,
                            "hidden_size": 48,
                        },
                    )()
                },
            )(),
        )


@pytest.mark.skipif(cpu_kernels.isa() == "avx2", reason="the CPU has no AVX-512 / VNNI build")
def test_avx2_build_gives_the_same_rows(tmp_path_factory):
    """The AVX-512VL build attends three rows at a time (sharing each K / V load), AVX2 one:
    the same chains per row, so the same bits."""
    w = World([300, 41, 700], heads=12, kv_heads=4, hd=64, seed=5)
    parts = [(0, 0, 300), (1, 0, 41), (2, 0, 700)]
    ref = w.forward(parts)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HICACHE_CPU_ISA", "avx2")
        mp.setenv("HICACHE_KERNEL_CACHE", str(tmp_path_factory.mktemp("avx2")))
        w.backend.lib = cpu_kernels._load(cpu_kernels._build())
    got = w.forward(parts)
    assert all(torch.equal(got[key], ref[key]) for key in got)
