"""The ``triton`` backend's deterministic (fixed split size) kernels under TRITON_INTERPRET=1: a
token's attention output is the same bits whether its prefix's K/V came from the cache or were
extended in the same forward, whatever the chunked-extend sizes, at decode as in an extend, and
whichever requests share the batch; and it is attention (== torch_native within fp32 rounding).

NOTE: float32 only: the interpreter's bfloat16 is stored as uint16; tests/gpu/
test_deterministic_gpu.py runs bf16. Under the interpreter the tile products are ``tile_dot``'s
per-row sums, not the host BLAS (whose AVX2 sgemm gives a row bits that depend on its place in
the tile), so what these tests check bit for bit is the kernels' own structure; that ``tl.dot``
keeps a row's bits on the device is the GPU tests' part (``test_triton_fixed_split_gives_a_token_
the_same_bits``: GQA groups 8 and 20, wider than a tile, the default 256-key split, decode vs
extend). TRITON_INTERPRET is set and the kernel module reloaded (tests/triton_interpreter.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
from tests.triton_interpreter import interpreted

(triton_fixed_split,) = interpreted("engine.runtime.layers.attention.triton_fixed_split")

from engine.runtime.layers.attention import create_backend
from tests.attention_worlds import AttentionWorld, assert_same_bits, make_seqs

SPLIT = 64  # NOTE: shrunk from 256 (two BLOCK_N blocks per chunk) so "a" spans 3 chunks
LENS = {"a": 140, "b": 40, "c": 70}  # tokens per request
GEOMS = [(2, 1, 16), (6, 2, 24)]  # (heads, kv_heads, head_dim): GQA groups 2 and 3
IDS = ["g2-d16", "g3-d24"]


def _world(seqs: dict, geom: tuple[int, int, int], seed: int, **kw) -> AttentionWorld:
    return AttentionWorld(seqs, geom, "triton", seed, **{"split": SPLIT, **kw})


@pytest.mark.parametrize("geom", GEOMS, ids=IDS)
def test_a_token_gets_the_same_bits_however_its_prefix_and_batch_came(geom):
    seqs = make_seqs(geom, LENS)
    # every request prefilled alone, in one extend
    alone = _world(seqs, geom, seed=1)
    for rid, n in LENS.items():
        alone.extend([(rid, n)])
    # a's first 100 tokens and c's first 20 from the cache; one batch with b
    cached = _world(seqs, geom, seed=2)
    cached.cached("a", 100)
    cached.cached("c", 20)
    cached.extend([("b", 40), ("a", 40), ("c", 50)])
    # chunked extends of other sizes (their edges off the chunks'), other companions
    chunked = _world(seqs, geom, seed=3)
    chunked.extend([("a", 17), ("c", 64)])
    chunked.extend([("b", 5), ("a", 64), ("c", 6)])
    chunked.extend([("a", 59), ("b", 35)])
    # decode after a cached prefix and after an extend, across chunk edges (128, 64), in batches
    decoded = _world(seqs, geom, seed=4)
    decoded.cached("a", 125)
    decoded.cached("b", 30)
    decoded.extend([("c", 62)])
    decoded.decode(["a", "b", "c"], 5)
    assert {pos for rid, pos in decoded.out if rid == "a"} == set(range(125, 130))
    assert assert_same_bits(alone, [cached, chunked, decoded]) == 130 + 250 + (62 + 15)
    # ... and it is attention
    ref = AttentionWorld(seqs, geom, "torch_native", seed=1, deterministic=False)
    for rid, n in LENS.items():
        ref.extend([(rid, n)])
    assert set(ref.out) == set(alone.out)
    for key, want in ref.out.items():
        torch.testing.assert_close(alone.out[key], want, atol=1e-5, rtol=0)


def test_decode_of_a_group_wider_than_a_tile_equals_extend():
    """18 query heads on one kv head: decode puts them in two tiles of 16 rows."""
    geom = (18, 1, 16)
    seqs = make_seqs(geom, {"a": 70})
    prefill = _world(seqs, geom, seed=1)
    prefill.extend([("a", 70)])
    decoded = _world(seqs, geom, seed=2)
    decoded.cached("a", 63)
    decoded.decode(["a"], 3)  # 63, 64, 65: across the chunk edge at 64
    assert assert_same_bits(prefill, [decoded]) == 3


def test_default_split_size_decode_equals_extend():
    """The production split (256 keys), the backend's default."""
    geom = (2, 1, 16)
    seqs = make_seqs(geom, {"a": 300}, seed=5)
    prefill = AttentionWorld(seqs, geom, "triton", seed=1)
    assert prefill.backend.split_size == triton_fixed_split.SPLIT_SIZE == 256
    prefill.extend([("a", 300)])
    decoded = AttentionWorld(seqs, geom, "triton", seed=2)
    decoded.cached("a", 253)
    decoded.decode(["a"], 6)  # 253 .. 258: across the chunk edge at 256
    assert assert_same_bits(prefill, [decoded]) == 6


def test_split_must_be_a_multiple_of_the_key_block():
    seqs = make_seqs((2, 1, 16), LENS)
    w = _world(seqs, (2, 1, 16), seed=0, split=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        w.extend([("a", 4)])


def test_without_the_flag_the_backend_keeps_its_kernels():
    assert not create_backend("triton", None).deterministic
    off = SimpleNamespace(enable_deterministic_inference=False)
    assert not create_backend("triton", off).deterministic
    runner = SimpleNamespace(deterministic=False, enable_deterministic_inference=True)
    assert not create_backend("triton", runner).deterministic  # the runner's resolved value wins
