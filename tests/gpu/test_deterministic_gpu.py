"""Deterministic inference on CUDA (``enable_deterministic_inference``): the batch-invariant ops'
rows are the same bits for any row count; the triton backend's fixed-split attention gives a
token the same bits after a cached prefix, in chunks, at decode, beside any requests; FlashInfer
with fixed splits keeps a batch's rows independent; and end to end on a tiny model (bf16, CUDA
graphs on), a prompt's prefill logits and greedy tokens are the same alone, in a batch, after
its prefix was cached, and under other chunked-prefill sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine
from engine.config import ServerArgs
from engine.runtime.layers import batch_invariant as bi
from engine.runtime.layers.norm import RMSNorm
from engine.runtime.model_runner import ModelRunner
from tests.attention_worlds import AttentionWorld, assert_same_bits, make_seqs
from tests.runner_worlds import RunnerWorld, assert_same_logits
from tests.tiny_models import make_tiny_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float32]
ROW_COUNTS = [1, 2, 3, 7, 31, 64, 65, 127, 128, 129, 300]


def _subsets(n_rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for m in ROW_COUNTS:
        yield m, torch.randperm(n_rows, generator=gen)[:m].to(DEV)


# ---- batch-invariant ops ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(1000, 3000), (4096, 512)])
def test_linear_rows_are_invariant_on_cuda(dtype, k, n):
    torch.manual_seed(0)
    x = torch.randn(300, k, device=DEV).to(dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype)
    full = bi.linear(x, w, b)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(
        full.float(), F.linear(x.float(), w.float(), b.float()), atol=tol, rtol=tol
    )
    for m, idx in _subsets(300, seed=1):
        assert torch.equal(bi.linear(x[idx], w, b), full[idx]), m


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_are_invariant_on_cuda(dtype):
    torch.manual_seed(1)
    hidden = 4096
    x = torch.randn(300, hidden, device=DEV).to(dtype)
    r = torch.randn(300, hidden, device=DEV).to(dtype)
    norm = RMSNorm(hidden, 1e-6, device=DEV, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, device=DEV))
    out, summed = bi.rms_norm(x, r, norm.weight, norm.eps)
    want_out, want_summed = norm(x, r)  # the torch path
    assert torch.equal(summed, want_summed)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    for m, idx in _subsets(300, seed=2):
        got_out, got_summed = bi.rms_norm(x[idx], r[idx], norm.weight, norm.eps)
        assert torch.equal(got_out, out[idx]) and torch.equal(got_summed, summed[idx]), m


@pytest.mark.parametrize("op", ["softmax", "cumsum"])
def test_row_ops_are_invariant_on_cuda(op):
    torch.manual_seed(2)
    x = torch.randn(300, 151_936, device=DEV) * 4  # a Qwen vocab
    if op == "cumsum":
        x = x.softmax(-1)
    fn = getattr(bi, op)
    full = fn(x)
    want = x.softmax(-1) if op == "softmax" else x.double().cumsum(-1).float()
    torch.testing.assert_close(full, want, atol=1e-5, rtol=1e-4)
    for m, idx in _subsets(300, seed=3):
        assert torch.equal(fn(x[idx]), full[idx]), m


# ---- attention ----------------------------------------------------------------------------------

LENS = {"a": 1100, "b": 300, "c": 700}  # "a" spans 5 chunks of 256 keys


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geom", [(8, 8, 64), (32, 4, 128), (40, 2, 128)], ids=["mha", "g8", "g20"])
def test_triton_fixed_split_gives_a_token_the_same_bits(dtype, geom):
    seqs = make_seqs(geom, LENS, device=DEV, dtype=dtype)
    big = {"num_slots": 8192, "table_width": 2048}
    alone = AttentionWorld(seqs, geom, "triton", seed=1, **big)
    for rid, n in LENS.items():
        alone.extend([(rid, n)])
    cached = AttentionWorld(seqs, geom, "triton", seed=2, **big)
    cached.cached("a", 700)
    cached.cached("c", 100)
    cached.extend([("b", 300), ("a", 400), ("c", 600)])
    chunked = AttentionWorld(seqs, geom, "triton", seed=3, **big)
    for sizes in (
        [("a", 300), ("c", 512)],
        [("b", 77), ("a", 400), ("c", 188)],
        [("a", 400), ("b", 223)],
    ):
        chunked.extend(sizes)
    decoded = AttentionWorld(seqs, geom, "triton", seed=4, **big)
    decoded.cached("a", 1020)
    decoded.cached("b", 250)
    decoded.extend([("c", 500)])
    decoded.decode(["a", "b", "c"], 10)  # a across 1024, c across 512
    assert assert_same_bits(alone, [cached, chunked, decoded]) > 0
    ref = AttentionWorld(seqs, geom, "torch_native", seed=1, deterministic=False, **big)
    for rid, n in LENS.items():
        ref.extend([(rid, n)])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for key, want in ref.out.items():
        torch.testing.assert_close(alone.out[key].float(), want.float(), atol=tol, rtol=0)


def test_flashinfer_fixed_split_keeps_rows_batch_invariant():
    fi = pytest.importorskip("flashinfer")
    from engine.runtime.layers.attention.flashinfer_backend import check_fixed_split

    try:
        check_fixed_split(fi)
    except RuntimeError as e:
        pytest.skip(str(e))
    geom = (32, 4, 128)
    seqs = make_seqs(geom, LENS, device=DEV, dtype=torch.bfloat16)
    big = {"num_slots": 8192, "table_width": 2048}
    # each request alone: a cached prefix, the rest in one extend, then decode
    alone = {}
    for i, (rid, n) in enumerate(LENS.items()):
        w = AttentionWorld(seqs, geom, "flashinfer", seed=i, **big)
        w.cached(rid, n - 40)
        w.extend([(rid, 30)])
        w.decode([rid], 10)
        alone[rid] = w
    ref = alone["a"]
    for w in (alone["b"], alone["c"]):
        ref.out.update(w.out)
    batched = AttentionWorld(seqs, geom, "flashinfer", seed=9, **big)
    for rid, n in LENS.items():
        batched.cached(rid, n - 40)
    batched.extend([("c", 30), ("a", 30), ("b", 30)])
    batched.decode(["a", "b", "c"], 10)
    assert assert_same_bits(ref, [batched]) == 3 * 40


# ---- end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny Llama with head_dim 64 (FlashInfer has no kernels for the default's 16)."""
    path = str(tmp_path_factory.mktemp("det_gpu") / "m")
    return make_tiny_model_dir(path, hidden_size=256, intermediate_size=512)


def _runner(path: str, **kw) -> ModelRunner:
    return ModelRunner(
        ServerArgs(
            model_path=path,
            device=DEV,
            enable_deterministic_inference=True,
            max_running_requests=16,
            cuda_graph_max_bs=16,
            max_total_tokens=8192,
            context_length=2048,
            **kw,
        )
    )


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_prefill_logits_do_not_depend_on_batch_prefix_chunks_or_decode(model_dir, backend):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    runner = _runner(model_dir, attention_backend=backend)
    assert runner.deterministic and runner.cuda_graph_runner is not None
    assert runner.attn_backend.deterministic
    gen = torch.Generator().manual_seed(0)
    lens = {"p": 600, "q": 300, "r": 90}
    tokens = {
        rid: torch.randint(3, runner.vocab_size, (n + 8,), generator=gen).tolist()
        for rid, n in lens.items()
    }
    alone = RunnerWorld(runner, tokens)  # prompts alone, then each decoded alone
    for rid, n in lens.items():
        alone.extend([(rid, n)])
        alone.decode([rid], 8)
    batched = RunnerWorld(runner, tokens)
    batched.extend([("q", 300), ("p", 600), ("r", 90)])
    batched.decode(["p", "q", "r"], 8)  # graphs of 3 (padded to 4) requests
    assert assert_same_logits(alone, [batched]) == 990 + 24
    if backend == "flashinfer":  # batch invariance only: prefill and decode differ in kernels
        return
    whole = RunnerWorld(runner, tokens)  # prompt and decode inputs in one prefill
    for rid, toks in tokens.items():
        whole.extend([(rid, len(toks))])
    prefixed = RunnerWorld(runner, tokens)
    prefixed.extend([("p", 333)])
    prefixed.extend([("r", 90), ("p", 267)])
    chunked = RunnerWorld(runner, tokens)
    chunked.extend([("p", 100), ("q", 64)])
    chunked.extend([("q", 236), ("p", 257), ("r", 90)])
    chunked.extend([("p", 243)])
    assert assert_same_logits(whole, [alone, prefixed, chunked]) > 0


def test_greedy_tokens_alone_batched_cached_and_chunked(model_dir):
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 380, (n,), generator=gen).tolist() for n in (700, 150, 40, 333)]
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    common = {
        "device": DEV,
        "enable_deterministic_inference": True,
        "max_total_tokens": 16384,
        "max_running_requests": 16,
        "cuda_graph_max_bs": 16,
    }
    with Engine(model_dir, **common) as eng:
        alone = [eng.generate([p], greedy)[0].token_ids for p in prompts]
        assert [o.token_ids for o in eng.generate(prompts, greedy)] == alone  # batched, cached
        # a multi-turn prefix: the prompt plus its first answer tokens, computed at decode
        turn2 = prompts[0] + alone[0][:10]
        assert eng.generate([turn2], greedy)[0].token_ids[:14] == alone[0][10:]
    for chunk in (64, 200):
        with Engine(
            model_dir, chunked_prefill_size=chunk, disable_radix_cache=True, **common
        ) as eng:
            assert [o.token_ids for o in eng.generate(prompts, greedy)] == alone, chunk
