"""The C kernels of the fast CPU path against their torch references: fused residual + RMSNorm,
RoPE in place, and the ``cpu`` attention backend's decode (straight from the paged pool) against
``torch_native`` over random batches of ragged, scattered requests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers import cpu_kernels
from engine.runtime.layers.attention import create_backend
from engine.runtime.layers.norm import RMSNorm
from engine.runtime.layers.radix_attention import RadixAttention
from engine.runtime.layers.rotary import RotaryEmbedding
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

HD = 32
LIB = cpu_kernels.KERNELS.get()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no CPU kernels: {cpu_kernels.KERNELS.error}")


@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 64), (3, 100)])
def test_fused_rms_norm_equals_torch(rows, hidden):
    ref = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.rand(hidden) + 0.5)
    fast = RMSNorm(hidden, 1e-5)
    fast.load_state_dict(ref.state_dict())
    fast.kernel = LIB
    x, res = torch.randn(rows, hidden), torch.randn(rows, hidden)
    torch.testing.assert_close(fast(x), ref(x), rtol=1e-5, atol=1e-5)
    out, summed = fast(x, res)
    ref_out, ref_summed = ref(x, res)
    assert torch.equal(summed, ref_summed)  # the add is exact
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    assert torch.equal(res, res.clone())  # inputs untouched


def test_rope_in_place_equals_torch():
    rope = RotaryEmbedding(64, 512, 10000.0)
    tokens, heads, kv = 7, 9, 3
    qkv = torch.randn(tokens, heads + 2 * kv, 64)
    positions = torch.tensor([0, 1, 5, 100, 511, 3, 3])
    ref = rope(positions, qkv[:, : heads + kv].clone())
    rope.kernel = LIB
    view = qkv[:, : heads + kv]  # rows strided by the whole qkv row, as in the decoder
    v_before = qkv[:, heads + kv :].clone()
    out = rope(positions, view)
    assert out.data_ptr() == view.data_ptr()  # in place
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, heads + kv :], v_before)  # V untouched


def _decode_batch(seq_lens: list[int], heads: int, kv_heads: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hd, total = HD, sum(seq_lens)
    pool = MHATokenToKVPool(total + 8, 1, torch.float32, kv_heads, hd, 2, "cpu")
    for layer in range(2):
        k, v = pool.get_kv_buffer(layer)
        k.copy_(torch.randn(k.shape, generator=g))
        v.copy_(torch.randn(v.shape, generator=g))
    r2t = ReqToTokenPool(len(seq_lens) + 3, max(seq_lens) + 4, "cpu")
    # each request's KV at scattered slots (a permutation of the pool), rows not in order
    perm = torch.randperm(total, generator=g) + 1
    rows = torch.randperm(len(seq_lens) + 3, generator=g)[: len(seq_lens)]
    start, out_loc = 0, []
    for row, n in zip(rows.tolist(), seq_lens, strict=True):
        r2t.req_to_token[row, :n] = perm[start : start + n].to(torch.int32)
        out_loc.append(int(perm[start + n - 1]))  # the new token's slot is the last one
        start += n
    bs = len(seq_lens)
    q = torch.randn(bs, heads * hd, generator=g)
    k_new = torch.randn(bs, kv_heads * hd, generator=g)
    v_new = torch.randn(bs, kv_heads * hd, generator=g)
    layer = RadixAttention(1, heads, kv_heads, hd)

    def run(backend_name: str) -> torch.Tensor:
        backend = create_backend(backend_name, None)
        fb = ForwardBatch(
            ForwardMode.DECODE,
            bs,
            torch.zeros(bs, dtype=torch.int64),
            torch.tensor(seq_lens) - 1,
            torch.tensor(out_loc),
            rows,
            torch.tensor(seq_lens),
            None,
            None,
            list(seq_lens),
            None,
            None,
            r2t,
            pool,
            backend,
        )
        backend.init_forward_metadata(fb)
        return backend.forward(q, k_new, v_new, layer, fb)

    return run


@settings(max_examples=25, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    group=st.sampled_from([(4, 4), (6, 2), (9, 3), (8, 1)]),
    seed=st.integers(0, 1000),
)
def test_cpu_decode_attention_equals_torch_native(seq_lens, group, seed):
    heads, kv_heads = group
    run = _decode_batch(seq_lens, heads, kv_heads, seed)
    ref = run("torch_native")
    out = run("cpu")
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seq_lens", [[3000], [1500, 3, 700], [2048, 1]])
def test_cpu_decode_attention_long_rows_split_into_spans(seq_lens):
    """Rows longer than 4 x 64 keys are split into spans run on both threads and merged (empty
    spans of a short row beside a long one included): still equal to torch_native."""
    run = _decode_batch(seq_lens, 9, 3, 7)
    torch.testing.assert_close(run("cpu"), run("torch_native"), rtol=1e-4, atol=1e-5)


def test_cpu_attention_backend_refuses_heads_it_cannot_take():
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        num_attention_heads=64, num_key_value_heads=2, head_dim=64, hidden_size=4096
    )
    with pytest.raises(ValueError, match="query heads per kv head"):
        create_backend("cpu", SimpleNamespace(hf_config=cfg))


@pytest.mark.parametrize("rows,inter", [(1, 1536), (3, 13), (40, 200)])
def test_silu_mul_equals_torch(rows, inter):
    """SiLU(gate) * up by the C kernel (vectorised exp, a scalar tail, threads above 64k
    elements) against torch's, over a range that reaches exp's under- and overflow."""
    lib = cpu_kernels.KERNELS.get()
    gate_up = torch.randn(rows, 2 * inter) * 30
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    act = torch.empty(rows, inter)
    lib.silu_mul(gate_up.data_ptr(), rows, inter, act.data_ptr(), cpu_kernels.threads())
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=1e-6)


def test_a_cached_build_is_used_without_a_compiler(tmp_path, monkeypatch):
    """The daemon image compiles the kernels at build time into HICACHE_KERNEL_CACHE and ships
    no compiler: the cached build must be found before a compiler is looked for."""
    built = cpu_kernels.cached_path()  # what this process loaded
    assert built.is_file()
    monkeypatch.setenv("HICACHE_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_kernels._build()
    target = cpu_kernels.cached_path()
    assert target.parent == tmp_path / "kernels" and target.name == built.name
    target.parent.mkdir()
    target.write_bytes(built.read_bytes())
    assert cpu_kernels._build() == target
    assert cpu_kernels._load(target).rms_norm_residual is not None
