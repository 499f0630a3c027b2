"""The ``triton`` attention backend under TRITON_INTERPRET=1 on CPU == ``torch_native``.

NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
engine.runtime.layers.attention.triton_kernels is imported; so this module sets it first and re-imports
the kernels module if something imported it earlier (the backend looks the kernels up through
the module at call time, so it picks up the reloaded ones). With CUDA present the real kernels
are tested in tests/gpu instead, and this module is skipped.
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
from tests.triton_interpreter import interpreted

(triton_kernels,) = interpreted("engine.runtime.layers.attention.triton_kernels")

from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import available_backends, create_backend
from engine.runtime.layers.radix_attention import RadixAttention
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

ATOL = 1e-4
NUM_SLOTS = 256


class _Harness:
    """Real pools, shuffled slots; runs one attention layer with two backends on the same batch."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.req_pool = ReqToTokenPool(8, 128, "cpu")
        self.pools = {
            name: MHATokenToKVPool(NUM_SLOTS, 1, torch.float32, kv_heads, head_dim, 2, "cpu")
            for name in ("torch_native", "triton")
        }
        self.backends = {name: create_backend(name, None) for name in self.pools}
        self.free_slots = (torch.randperm(NUM_SLOTS, generator=self.gen) + 1).tolist()
        self.layer = RadixAttention(1, heads, kv_heads, head_dim)
        self.rows: dict[int, int] = {}
        self.lens: dict[int, int] = {}

    def step(self, mode: ForwardMode, rids: list[int], ext: list[int]) -> None:
        """One batch: rids get ext[i] new tokens; asserts both backends agree (output and pool)."""
        prefix = [self.lens.get(r, 0) for r in rids]
        seq = [p + n for p, n in zip(prefix, ext)]
        locs = []
        for rid, p, n in zip(rids, prefix, ext):
            if rid not in self.rows:
                self.rows[rid] = self.req_pool.alloc(1)[0]
            loc = torch.tensor([self.free_slots.pop() for _ in range(n)], dtype=torch.int64)
            self.req_pool.write((self.rows[rid], slice(p, p + n)), loc)
            self.lens[rid] = p + n
            locs.append(loc)
        n_tok = sum(ext)
        lay = self.layer
        q = torch.randn(n_tok, lay.num_heads * lay.head_dim, generator=self.gen)
        k = torch.randn(n_tok, lay.num_kv_heads * lay.head_dim, generator=self.gen)
        v = torch.randn(n_tok, lay.num_kv_heads * lay.head_dim, generator=self.gen)
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
        is_extend = mode == ForwardMode.EXTEND
        outs = {}
        for name, backend in self.backends.items():
            fb = ForwardBatch(
                forward_mode=mode,
                batch_size=len(rids),
                input_ids=torch.zeros(n_tok, dtype=torch.int64),
                positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]),
                out_cache_loc=torch.cat(locs),
                req_pool_indices=i64([self.rows[r] for r in rids]),
                seq_lens=i64(seq),
                extend_prefix_lens=i64(prefix) if is_extend else None,
                extend_seq_lens=i64(ext) if is_extend else None,
                seq_lens_cpu=seq,
                extend_prefix_lens_cpu=prefix if is_extend else None,
                extend_seq_lens_cpu=ext if is_extend else None,
                req_to_token_pool=self.req_pool,
                token_to_kv_pool=self.pools[name],
                attn_backend=backend,
            )
            backend.init_forward_metadata(fb)
            outs[name] = backend.forward(q, k, v, lay, fb)
        ref, got = outs["torch_native"], outs["triton"]
        assert got.shape == ref.shape == (n_tok, lay.num_heads * lay.head_dim)
        torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
        a, b = self.pools["torch_native"], self.pools["triton"]
        assert torch.equal(a.k_buffer[1], b.k_buffer[1]) and torch.equal(
            a.v_buffer[1], b.v_buffer[1]
        )


GEOMS = [(2, 2, 16), (6, 2, 16), (3, 1, 64), (2, 2, 24)]  # (heads, kv_heads, head_dim)
IDS = ["g1-d16", "g3-d16", "g3-d64", "g1-d24"]


def test_registered_lazily():
    assert "triton" in available_backends()


@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_extend_then_decode_match_torch_native(geom):
    h = _Harness(*geom)
    E, D = ForwardMode.EXTEND, ForwardMode.DECODE
    h.step(E, [0, 1, 2], [5, 1, 37])  # no prefix; ragged; one request with 1 token; > BLOCK_M/N
    h.step(D, [0, 1, 2], [1, 1, 1])
    h.step(E, [0, 1, 3], [20, 1, 3])  # with prefix (0, 1), none (3)
    h.step(D, [2, 0, 3, 1], [1, 1, 1, 1])


def test_single_request_shapes():
    h = _Harness(4, 2, 16, seed=3)
    h.step(ForwardMode.EXTEND, [0], [1])
    h.step(ForwardMode.DECODE, [0], [1])
    h.step(ForwardMode.EXTEND, [0], [33])  # prefix 2, new tokens span 3 query blocks


def test_engine_end_to_end_matches_hf_greedy(tiny_llama_dir):
    from engine import Engine
    from tests.tiny_models import hf_greedy

    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], [40, 41, 42, 43, 44]]
    ref = hf_greedy(tiny_llama_dir, prompts, 4)
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_llama_dir, attention_backend="triton", max_total_tokens=512) as eng:
        outs = eng.generate(prompts, greedy)
    assert [o.token_ids for o in outs] == ref
