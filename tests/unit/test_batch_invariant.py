"""batch_invariant's ops under TRITON_INTERPRET=1: a row's result is the same bits whatever the
row count (1..N) and wherever the row sits among the rows, and equals torch's within rounding.

NOTE: float32 only (bf16 runs in tests/gpu/test_deterministic_gpu.py). The interpreter's tile
products are ``tile_dot``'s per-row sums, not the host BLAS (see tile_dot.py): ``linear``'s
fixed tiles and k order are checked here, ``tl.dot``'s own row invariance on the device there.
TRITON_INTERPRET is set and the module reloaded (tests/triton_interpreter.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
from tests.triton_interpreter import interpreted

(bi,) = interpreted("engine.runtime.layers.batch_invariant")

from engine.runtime.layers.norm import RMSNorm

# row counts: 1, a few, one BLOCK_M tile (64) exactly, one row over it, all
ROW_COUNTS = [1, 2, 3, 7, 16, 33, 64, 65, 70]


def _subsets(n_rows: int, seed: int):
    """(row count, row indices in random order) for each of ROW_COUNTS."""
    gen = torch.Generator().manual_seed(seed)
    for m in ROW_COUNTS:
        yield m, torch.randperm(n_rows, generator=gen)[:m]


def test_linear_rows_are_invariant_to_the_row_count():
    gen = torch.Generator().manual_seed(0)
    # K off BLOCK_K (32) and N off BLOCK_N (64): the masked tails are in every row's sum
    x = torch.randn(70, 100, generator=gen)
    w = torch.randn(80, 100, generator=gen)
    b = torch.randn(80, generator=gen)
    full = bi.linear(x, w, b)  # [70, 80]
    torch.testing.assert_close(full, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    for m, idx in _subsets(70, seed=1):
        got = bi.linear(x[idx], w, b)
        assert got.shape == (m, 80)
        assert torch.equal(got, full[idx]), m


def test_linear_shapes_and_dtypes():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 40, generator=gen)
    w = torch.randn(24, 40, generator=gen)
    got = bi.linear(x[:, :, :], w)  # [..., K] without bias
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-5)
    strided = torch.randn(5, 80, generator=gen)[:, ::2]  # a non-contiguous [5, 40]
    torch.testing.assert_close(bi.linear(strided, w), F.linear(strided, w), atol=1e-4, rtol=1e-5)
    assert bi.linear(x[:0, 0], w).shape == (0, 24)
    with pytest.raises(ValueError, match="weight"):
        bi.linear(x, w.double())


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_rows_are_invariant_and_match_the_module(residual):
    gen = torch.Generator().manual_seed(3)
    hidden = 96  # off the power-of-two block (128)
    x = torch.randn(70, hidden, generator=gen)
    r = torch.randn(70, hidden, generator=gen)
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    res = r if residual else None
    full = bi.rms_norm(x, res, norm.weight, norm.eps)
    want = norm(x, res) if residual else norm(x)  # the torch path (no kernel attached)
    if residual:
        assert torch.equal(full[1], want[1])  # x + residual: one rounding, as torch's
        torch.testing.assert_close(full[0], want[0], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-5)
    for m, idx in _subsets(70, seed=4):
        got = bi.rms_norm(x[idx], r[idx] if residual else None, norm.weight, norm.eps)
        if residual:
            assert torch.equal(got[0], full[0][idx]) and torch.equal(got[1], full[1][idx]), m
        else:
            assert torch.equal(got, full[idx]), m


def test_rms_norm_keeps_leading_dims():
    """Qwen3's per-head norms: [tokens, heads, head_dim], a strided slice of qkv."""
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(4, 6, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    got = bi.rms_norm(qkv[:, :4], None, w, 1e-6)
    assert got.shape == (4, 4, 16)
    torch.testing.assert_close(got, F.rms_norm(qkv[:, :4], (16,), w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["softmax", "cumsum"])
def test_row_ops_are_invariant_and_match_torch(op):
    gen = torch.Generator().manual_seed(6)
    vocab = 2500  # three ROW_BLOCK chunks, the last one partial
    x = torch.randn(70, vocab, generator=gen) * 4
    if op == "cumsum":  # the sampler's use: a running sum of probabilities
        x = x.softmax(-1)
    fn = getattr(bi, op)
    full = fn(x)
    want = x.softmax(-1) if op == "softmax" else x.double().cumsum(-1).float()
    torch.testing.assert_close(full, want, atol=1e-6, rtol=1e-5)
    for m, idx in _subsets(70, seed=7):
        assert torch.equal(fn(x[idx]), full[idx]), m


def test_seeded_sampling_with_row_ops_does_not_depend_on_the_batch():
    from engine.runtime.sampling import Sampler
    from engine.sampling_params import SamplingParams

    sampler = Sampler(batch_invariant=True)
    assert sampler.row_ops is bi
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 2500, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50 * i or -1, seed=i) for i in range(6)
    ]

    def draw(s: Sampler, rows: list[int]) -> list[int]:
        gens = [torch.Generator().manual_seed(i) for i in rows]  # each request's own seed
        return s(logits[rows], [params[i] for i in rows], gens).tolist()

    full = draw(sampler, list(range(6)))
    assert full == draw(Sampler(), list(range(6)))  # the same distributions as torch's ops
    for rows in ([3], [5, 0], [2, 4, 1]):
        assert draw(sampler, rows) == [full[i] for i in rows]
