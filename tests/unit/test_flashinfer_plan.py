"""The ``flashinfer`` backend on CPU: its index building == a naive per-request loop, the clear
errors without flashinfer / CUDA, the default-backend rule, and its plan/run/CUDA-graph wiring
against a torch model of FlashInfer's paged wrappers (``_FakeFlashInfer``) == ``torch_native``.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers import attention
from engine.runtime.layers.attention import available_backends, create_backend, default_backend
from engine.runtime.layers.attention import flashinfer_backend as fib
from engine.runtime.layers.radix_attention import RadixAttention
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool


def i64(xs: list[int]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def naive_kv_indices(req_to_token, rows, lens):
    indptr, indices = [0], []
    for r, n in zip(rows, lens):
        indices += req_to_token[r, :n].tolist()
        indptr.append(indptr[-1] + n)
    return indptr, indices


def shuffled_table(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randperm(rows * cols, generator=gen) + 1).to(torch.int32).view(rows, cols)


def check_indices(table, rows, lens):
    got = fib.build_kv_indices(table, i64(rows), i64(lens), sum(lens))
    indptr, indices = naive_kv_indices(table, rows, lens)
    assert got.kv_indptr.dtype == got.kv_indices.dtype == torch.int32
    assert got.kv_indptr.tolist() == indptr and got.kv_indices.tolist() == indices
    assert fib.host_indptr(lens).tolist() == indptr
    assert fib.host_indptr(lens).device.type == "cpu"


def test_build_kv_indices_matches_naive():
    table = shuffled_table(8, 16, seed=0)
    check_indices(table, [3, 0, 7], [5, 1, 16])
    check_indices(table, [2], [1])


@settings(max_examples=200, deadline=None)
@given(
    data=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 24)), min_size=1, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_build_kv_indices_property(data, seed):
    rows, lens = [r for r, _ in data], [n for _, n in data]  # rows may repeat (padding)
    check_indices(shuffled_table(8, 24, seed), rows, lens)


def test_padded_graph_replay_indices():
    """Padded requests (seq_len 1) read ``req_to_token[row, 0]``."""
    table = shuffled_table(8, 32, seed=1)
    rows, lens = [4, 1, 0, 0], [9, 30, 1, 1]  # 2 real + 2 padded on row 0
    got = fib.build_kv_indices(table, i64(rows), i64(lens), sum(lens))
    assert got.kv_indptr.tolist() == [0, 9, 39, 40, 41]
    assert got.kv_indices[-2:].tolist() == [table[0, 0].item()] * 2
    check_indices(table, rows, lens)


def test_extend_qo_indptr():
    assert fib.host_indptr([5, 1, 37]).tolist() == [0, 5, 6, 43]


def test_kernel_dtypes():
    bf16, fp16 = torch.bfloat16, torch.float16
    assert fib.kernel_q_dtype(bf16, bf16) == bf16
    assert fib.kernel_q_dtype(torch.float32, fp16) == fp16  # q is cast to the pool's dtype
    if fib._FP8:
        assert fib.kernel_q_dtype(fp16, fib._FP8[0]) == fp16
        assert fib.kernel_q_dtype(torch.float32, fib._FP8[0]) == bf16
    with pytest.raises(ValueError, match="bfloat16"):
        fib.kernel_q_dtype(torch.float32, torch.float32)


def test_registry_and_default_backend(monkeypatch):
    assert "flashinfer" in available_backends()
    assert default_backend(torch.device("cpu")) == "torch_native"
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: None)
    assert default_backend(torch.device("cuda")) == "triton"
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name: object())
    assert default_backend(torch.device("cuda")) == "flashinfer"
    assert default_backend(torch.device("cuda"), torch.float32) == "triton"  # no fp32 kernels


def test_create_without_flashinfer_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'hicache\[gpu\]'.*") as e:
        create_backend("flashinfer", None)
    assert "CUDA" in str(e.value)


def test_create_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        create_backend("flashinfer", None)


# ---- the backend's wiring against a torch model of FlashInfer ------------------------------


class _FakeWrapper:
    """FlashInfer's paged wrappers (page_size 1, NHD) in torch; asserts the plan/run contract.
    In CUDA-graph mode ``run`` reads the fixed buffers, as a replayed graph would."""

    plans = 0

    def __init__(
        self,
        float_workspace_buffer,
        kv_layout="NHD",
        use_cuda_graph=False,
        use_tensor_cores=False,
        paged_kv_indptr_buffer=None,
        paged_kv_indices_buffer=None,
        paged_kv_last_page_len_buffer=None,
    ):
        assert kv_layout == "NHD" and float_workspace_buffer.dtype == torch.uint8
        self.graph = use_cuda_graph
        self.use_tensor_cores = use_tensor_cores
        if use_cuda_graph:
            self.fixed_bs = len(paged_kv_last_page_len_buffer)
            assert len(paged_kv_indptr_buffer) == self.fixed_bs + 1
            self.indptr_buf = paged_kv_indptr_buffer
            self.indices_buf = paged_kv_indices_buffer
            self.last_buf = paged_kv_last_page_len_buffer

    def _plan(self, qo_indptr, indptr, indices, last, geom, causal, q_dtype, kv_dtype):
        _FakeWrapper.plans += 1
        for t in (qo_indptr, indptr, last):  # host: planning never syncs on the device
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        assert indices.dtype == torch.int32 and len(indices) == indptr[-1].item()
        assert geom[3] == 1 and bool((last == 1).all())  # page size 1
        if self.graph:
            assert len(last) == self.fixed_bs
            self.indptr_buf.copy_(indptr)
            self.indices_buf[: len(indices)].copy_(indices)
            self.last_buf.copy_(last)
            indptr, indices = self.indptr_buf, self.indices_buf
        self.qo_indptr, self.indptr, self.indices = qo_indptr, indptr, indices
        self.heads, self.kv_heads, self.head_dim = geom[:3]
        self.causal, self.q_dtype, self.kv_dtype = causal, q_dtype, kv_dtype

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache  # [num_pages, 1, kv_heads, head_dim]
        assert q.dtype == self.q_dtype and k_cache.dtype == v_cache.dtype == self.kv_dtype
        assert k_cache.shape[1:] == (1, self.kv_heads, self.head_dim)
        assert q.shape[1:] == (self.heads, self.head_dim) and q.is_contiguous()
        group = self.heads // self.kv_heads
        out = torch.empty_like(q)
        for b in range(len(self.qo_indptr) - 1):
            q0, q1 = self.qo_indptr[b].item(), self.qo_indptr[b + 1].item()
            kv0, kv1 = self.indptr[b].item(), self.indptr[b + 1].item()
            slots = self.indices[kv0:kv1].long()
            kk = k_cache[slots, 0].float().repeat_interleave(group, 1)  # [kv_len, heads, hd]
            vv = v_cache[slots, 0].float().repeat_interleave(group, 1)
            s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), kk) * self.sm_scale
            if self.causal:  # queries aligned to the end of the KV
                qi = torch.arange(q1 - q0)[:, None] + (kv1 - kv0) - (q1 - q0)
                s = s.masked_fill(torch.arange(kv1 - kv0)[None, :] > qi, float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", s.softmax(-1), vv).to(q.dtype)
        return out


class _FakeDecode(_FakeWrapper):
    def plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        *,
        q_data_type,
        kv_data_type,
        data_type=None,
        sm_scale=None,
    ):
        assert data_type == kv_data_type
        self.sm_scale = sm_scale
        qo = torch.arange(len(last_page_len) + 1, dtype=torch.int32)
        geom = (num_qo_heads, num_kv_heads, head_dim, page_size)
        self._plan(qo, indptr, indices, last_page_len, geom, False, q_data_type, kv_data_type)


class _FakePrefill(_FakeWrapper):
    def plan(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        *,
        causal=False,
        sm_scale=None,
        q_data_type="float16",
        kv_data_type=None,
    ):
        self.sm_scale = sm_scale
        geom = (num_qo_heads, num_kv_heads, head_dim_qk, page_size)
        self._plan(
            qo_indptr,
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            geom,
            causal,
            q_data_type,
            kv_data_type,
        )


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecode
    mod.BatchPrefillWithPagedKVCacheWrapper = _FakePrefill
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    monkeypatch.setattr(fib, "_check_cuda", lambda device: None)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 1024)
    _FakeWrapper.plans = 0
    return mod


NUM_SLOTS = 512
DTYPE = torch.bfloat16
ATOL = 2e-2


class _Harness:
    """Two layers, two backends (flashinfer over the fake, torch_native), real pools."""

    def __init__(
        self, heads, kv_heads, head_dim, runner=False, q_dtype=DTYPE, seed=0, deterministic=False
    ):
        self.gen = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(8, 128, "cpu")
        self.pools = {
            n: MHATokenToKVPool(NUM_SLOTS, 1, DTYPE, kv_heads, head_dim, 2, "cpu")
            for n in ("torch_native", "flashinfer")
        }
        stub = SimpleNamespace(
            hf_config=SimpleNamespace(num_attention_heads=heads),
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=q_dtype,
            kv_pool=self.pools["flashinfer"],
            device="cpu",
            deterministic=deterministic,
        )
        self.backends = {
            "torch_native": create_backend("torch_native", None),
            "flashinfer": create_backend("flashinfer", stub if runner else None),
        }
        self.free = (torch.randperm(NUM_SLOTS, generator=self.gen) + 1).tolist()
        self.layers = [RadixAttention(i, heads, kv_heads, head_dim) for i in range(2)]
        self.q_dtype = q_dtype
        self.rows: dict[int, int] = {}
        self.lens: dict[int, int] = {}

    def batch(self, mode, rids, ext, name, pad_rows=0):
        """The batch both backends see (DECODE may be padded with ``pad_rows`` requests of
        seq_len 1 on row 0 writing the padding slot 0, as a graph replay is)."""
        prefix = [self.lens[r] - n for r, n in zip(rids, ext)]
        seq = [self.lens[r] for r in rids]
        locs = torch.cat(
            [
                self.req_pool.req_to_token[self.rows[r], p:s].long()
                for r, p, s in zip(rids, prefix, seq)
            ]
        )
        rows = [self.rows[r] for r in rids] + [0] * pad_rows
        seq = seq + [1] * pad_rows
        locs = torch.cat([locs, torch.zeros(pad_rows, dtype=torch.int64)])
        is_extend = mode == ForwardMode.EXTEND
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(rows),
            input_ids=torch.zeros(len(locs), dtype=torch.int64),
            positions=torch.zeros(len(locs), dtype=torch.int64),
            out_cache_loc=locs,
            req_pool_indices=i64(rows),
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

    def grow(self, rids, ext):
        for rid, n in zip(rids, ext):
            if rid not in self.rows:
                self.rows[rid] = self.req_pool.alloc(1)[0]
            p = self.lens.get(rid, 0)
            loc = i64([self.free.pop() for _ in range(n)])
            self.req_pool.write((self.rows[rid], slice(p, p + n)), loc)
            self.lens[rid] = p + n

    def qkv(self, n_tok, pad_rows=0):
        lay = self.layers[0]
        shapes = [lay.num_heads, lay.num_kv_heads, lay.num_kv_heads]
        real = [torch.randn(n_tok, h * lay.head_dim, generator=self.gen) for h in shapes]
        pad = [torch.zeros(pad_rows, t.shape[1]) for t in real]
        return [torch.cat([t, p]).to(self.q_dtype) for t, p in zip(real, pad)]

    def step(self, mode, rids, ext, plans_per_batch=1):
        self.grow(rids, ext)
        qkv = self.qkv(sum(ext))
        outs = {}
        for name, backend in self.backends.items():
            fb = self.batch(mode, rids, ext, name)
            before = _FakeWrapper.plans
            backend.init_forward_metadata(fb)
            outs[name] = [backend.forward(*qkv, lay, fb) for lay in self.layers]
            if name == "flashinfer":
                assert _FakeWrapper.plans - before == plans_per_batch  # per batch, not per layer
        for got, ref in zip(outs["flashinfer"], outs["torch_native"]):
            assert got.dtype == self.q_dtype and got.shape == ref.shape
            torch.testing.assert_close(got.float(), ref.float(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 2, 16), (6, 2, 32), (8, 1, 16)])
def test_wiring_matches_torch_native(fake_flashinfer, heads, kv_heads, head_dim):
    h = _Harness(heads, kv_heads, head_dim)
    E, D = ForwardMode.EXTEND, ForwardMode.DECODE
    h.step(E, [0, 1, 2], [5, 1, 37])  # geometry learnt from the first layer: still one plan
    h.step(D, [0, 1, 2], [1, 1, 1])
    h.step(E, [0, 1, 3], [20, 1, 3])  # with prefix (0, 1), none (3)
    h.step(D, [2, 0, 3, 1], [1, 1, 1, 1])
    tc = heads // kv_heads >= 4
    assert list(h.backends["flashinfer"].decode_wrappers) == [tc]


def test_wiring_with_runner_casts_fp32_q(fake_flashinfer):
    h = _Harness(4, 2, 16, runner=True, q_dtype=torch.float32)
    h.step(ForwardMode.EXTEND, [0, 1], [7, 3])  # planned in init_forward_metadata
    h.step(ForwardMode.DECODE, [0, 1], [1, 1])


def test_cuda_graph_protocol(fake_flashinfer):
    h = _Harness(8, 2, 16, runner=True)
    fi, ref = h.backends["flashinfer"], h.backends["torch_native"]
    h.step(ForwardMode.EXTEND, [0, 1, 2], [12, 30, 4])
    fi.init_cuda_graph_state(max_bs=4, max_num_kv_tokens=256)
    for bs in (2, 4):  # capture: plan each bs's graph wrapper on the shared fixed buffers
        rids = [0, 1, 2][: bs - 1]  # + 1 padded request
        fb = h.batch(ForwardMode.DECODE, rids, [1] * len(rids), "flashinfer", pad_rows=1)
        fi.init_forward_metadata_capture(fb)
        assert fi.meta is not None and fi.meta.wrapper is fi.graph_wrappers[bs]
        assert fi.graph_wrappers[bs].graph
        wrapper = fi.graph_wrappers[bs]
        fi.init_forward_metadata_capture(fb)  # warm-up and capture share the wrapper
        assert fi.graph_wrappers[bs] is wrapper
    assert fi.decode_wrappers == {}
    lay = h.layers[0]
    for rids, pad, bs in (([0, 1, 2], 1, 4), ([2], 1, 2), ([1, 0, 2], 1, 4)):
        h.grow(rids, [1] * len(rids))
        q, k, v = h.qkv(len(rids), pad)
        fb = h.batch(ForwardMode.DECODE, rids, [1] * len(rids), "flashinfer", pad)
        assert fb.batch_size == bs
        fi.init_forward_metadata_replay(fb)
        got = fi.forward(q, k, v, lay, fb)[: len(rids)]  # what the replayed graph computes
        fb_ref = h.batch(ForwardMode.DECODE, rids, [1] * len(rids), "torch_native")
        ref.init_forward_metadata(fb_ref)
        n = len(rids)
        want = ref.forward(q[:n], k[:n], v[:n], lay, fb_ref)
        torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=0)
    # a graph batch is never re-planned inside forward (that would break capture)
    other = RadixAttention(1, 8, 2, 16, scaling=0.5)
    with pytest.raises(RuntimeError, match="CUDA-graph"):
        fi.forward(q, k, v, other, fb)


# ---- deterministic inference: the fixed-split plan options -------------------------------


class _FixedSplitDecode(_FakeDecode):
    """flashinfer >= 0.4.0: plan() takes the fixed-split options (recorded, then ignored: the
    torch model has no splits)."""

    def plan(self, *args, fixed_split_size=None, disable_split_kv=False, **kw):
        self.split_options = {
            "fixed_split_size": fixed_split_size,
            "disable_split_kv": disable_split_kv,
        }
        super().plan(*args, **kw)


class _FixedSplitPrefill(_FakePrefill):
    def plan(self, *args, fixed_split_size=None, disable_split_kv=False, **kw):
        self.split_options = {
            "fixed_split_size": fixed_split_size,
            "disable_split_kv": disable_split_kv,
        }
        super().plan(*args, **kw)


@pytest.fixture
def fixed_split_flashinfer(fake_flashinfer):
    fake_flashinfer.BatchDecodeWithPagedKVCacheWrapper = _FixedSplitDecode
    fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper = _FixedSplitPrefill
    return fake_flashinfer


def test_deterministic_plans_fix_the_splits(fixed_split_flashinfer):
    h = _Harness(4, 2, 16, runner=True, deterministic=True)  # group 2: no tensor cores by default
    fi = h.backends["flashinfer"]
    assert fi.deterministic
    h.step(ForwardMode.EXTEND, [0, 1], [9, 40])
    assert fi.prefill_wrapper.split_options == {
        "fixed_split_size": fib.PREFILL_SPLIT_SIZE,
        "disable_split_kv": False,
    }
    h.step(ForwardMode.DECODE, [0, 1], [1, 1])
    assert list(fi.decode_wrappers) == [True]  # tensor cores whatever the group
    decode = fi.decode_wrappers[True]
    assert decode.split_options == {"fixed_split_size": None, "disable_split_kv": True}
    # the captured decode is planned with the same options
    fi.init_cuda_graph_state(max_bs=2, max_num_kv_tokens=256)
    h.grow([0, 1], [1, 1])
    fb = h.batch(ForwardMode.DECODE, [0, 1], [1, 1], "flashinfer")
    fi.init_forward_metadata_capture(fb)
    graph = fi.graph_wrappers[2]
    assert graph.use_tensor_cores and graph.split_options == decode.split_options
    assert fi.workspace.numel() == fib.WORKSPACE_BYTES * fib.DETERMINISTIC_WORKSPACE_FACTOR


def test_without_the_flag_plans_keep_flashinfers_splits(fixed_split_flashinfer):
    h = _Harness(4, 2, 16, runner=True)
    h.step(ForwardMode.EXTEND, [0], [9])
    h.step(ForwardMode.DECODE, [0], [1])
    fi = h.backends["flashinfer"]
    assert not fi.deterministic and list(fi.decode_wrappers) == [False]
    assert fi.prefill_wrapper.split_options == {"fixed_split_size": None, "disable_split_kv": False}
    assert fi.workspace.numel() == fib.WORKSPACE_BYTES


def test_deterministic_refuses_a_flashinfer_without_fixed_splits(fake_flashinfer):
    fake_flashinfer.__version__ = "0.3.1"
    config = SimpleNamespace(enable_deterministic_inference=True)
    with pytest.raises(RuntimeError, match=r"flashinfer >= 0\.4\.0.*installed: 0\.3\.1"):
        create_backend("flashinfer", config)
    create_backend("flashinfer", SimpleNamespace(enable_deterministic_inference=False))
