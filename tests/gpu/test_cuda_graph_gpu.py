"""Decode through captured CUDA graphs (triton backend) == eager decode: per-step logits and KV
writes of a ModelRunner, and an Engine's greedy tokens with and without ``disable_cuda_graph``,
for batch sizes that replay a graph as is and ones that are padded up to a captured size."""

from __future__ import annotations

import pytest
import torch

from engine import Engine
from engine.config import ServerArgs
from engine.runtime.cuda_graph_runner import PAD_SLOT
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
ATOL = 1e-4  # float32; padded and unpadded GEMMs may pick different cuBLAS kernels
GRAPH_SIZES = [1, 2, 4, 8, 16]


def _runner(path: str, **kw) -> ModelRunner:
    args = ServerArgs(
        model_path=path,
        device="cuda",
        dtype="float32",
        attention_backend="triton",
        max_running_requests=16,
        cuda_graph_max_bs=16,
        max_total_tokens=4096,
        context_length=512,
        **kw,
    )
    return ModelRunner(args)


def _batch(
    runner: ModelRunner,
    mode: ForwardMode,
    rows: list[int],
    ids: list[int],
    pos: list[int],
    locs: torch.Tensor,
    seq: list[int],
    ext: list[int] | None,
):
    dev = runner.device
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64, device=dev)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(rows),
        input_ids=i64(ids),
        positions=i64(pos),
        out_cache_loc=locs.clone(),
        req_pool_indices=i64(rows),
        seq_lens=i64(seq),
        extend_prefix_lens=i64([0] * len(rows)) if ext else None,
        extend_seq_lens=i64(ext) if ext else None,
        seq_lens_cpu=list(seq),
        extend_prefix_lens_cpu=[0] * len(rows) if ext else None,
        extend_seq_lens_cpu=ext,
        req_to_token_pool=runner.req_to_token_pool,
        token_to_kv_pool=runner.kv_pool,
        attn_backend=runner.attn_backend,
    )


def _kv(runner: ModelRunner) -> list[torch.Tensor]:
    return [b.clone() for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer]


def test_graph_replay_matches_eager(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    cg = runner.cuda_graph_runner
    assert cg is not None and cg.capture_graphs
    assert cg.batch_sizes == GRAPH_SIZES and sorted(cg.graphs) == GRAPH_SIZES
    r2t, alloc, vocab = runner.req_to_token_pool, runner.allocator, runner.vocab_size
    gen = torch.Generator().manual_seed(0)
    lens = [int(n) for n in torch.randint(1, 40, (13,), generator=gen)]
    rows = r2t.alloc(len(lens))
    locs = alloc.alloc(sum(lens))
    start = 0
    for row, n in zip(rows, lens):
        r2t.write((row, slice(0, n)), locs[start : start + n])
        start += n
    prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lens]
    fb = _batch(
        runner,
        ForwardMode.EXTEND,
        rows,
        [t for p in prompts for t in p],
        [i for n in lens for i in range(n)],
        locs,
        lens,
        lens,
    )
    last = runner.forward(fb).argmax(-1).tolist()

    # bs 1, 4, 8, 13 replay as is or padded (13 -> 16, 3 -> 4, 5 -> 8, 7 -> 8)
    for bs in (13, 3, 5, 1, 8, 7, 4, 13):
        idx = torch.randperm(len(lens), generator=gen)[:bs].tolist()
        new = alloc.alloc(bs)
        for i, loc in zip(idx, new):
            r2t.write((rows[i], slice(lens[i], lens[i] + 1)), loc)
        pos = [lens[i] for i in idx]
        for i in idx:
            lens[i] += 1
        args = ([rows[i] for i in idx], [last[i] for i in idx], pos, new, [lens[i] for i in idx])
        fb_graph = _batch(runner, ForwardMode.DECODE, *args, None)
        fb_eager = _batch(runner, ForwardMode.DECODE, *args, None)
        for buf in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer:
            buf.add_(torch.randn_like(buf) * 0.01)  # a stale padding row cannot go unnoticed
        before = _kv(runner)
        assert cg.can_run(fb_graph)
        padded_bs = cg.padded_batch_size(bs)
        logits = runner.forward(fb_graph)
        assert logits.data_ptr() == cg.outputs[padded_bs].data_ptr()  # the graph's output
        logits = logits.clone()
        after_graph = _kv(runner)
        for dst, src in zip(runner.kv_pool.k_buffer + runner.kv_pool.v_buffer, before):
            dst.copy_(src)
        with torch.inference_mode():
            runner.attn_backend.init_forward_metadata(fb_eager)
            ref = runner.model(fb_eager)
        after_eager = _kv(runner)
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
        own = torch.zeros(before[0].shape[0], dtype=torch.bool, device="cuda")
        own[new] = True
        own[PAD_SLOT] = True
        for b, g, e in zip(before, after_graph, after_eager):
            # NOTE: the invariant: padding writes no slot but the padding slot
            assert torch.equal(g[~own], b[~own]) and torch.equal(e[~own], b[~own])
            torch.testing.assert_close(g[new], e[new], atol=ATOL, rtol=0)
        for i, tok in zip(idx, ref.argmax(-1).tolist()):
            last[i] = tok


def test_layerwise_wait_runs_eager(tiny_llama_dir):
    runner = _runner(tiny_llama_dir)
    cg = runner.cuda_graph_runner
    assert cg is not None
    row = runner.req_to_token_pool.alloc(1)[0]
    loc = runner.allocator.alloc(1)
    runner.req_to_token_pool.write((row, slice(0, 1)), loc)
    fb = _batch(runner, ForwardMode.DECODE, [row], [5], [0], loc, [1], None)
    waited: list[int] = []
    fb.wait_layer = waited.append
    assert not cg.can_run(fb)
    logits = runner.forward(fb)
    assert waited == list(range(runner.num_layers))
    assert all(logits.data_ptr() != out.data_ptr() for out in cg.outputs.values())


@pytest.mark.parametrize("extra", [{}, {"enable_hierarchical_cache": True, "page_size": 16}])
@pytest.mark.parametrize("num_prompts", [1, 3, 5, 11])
def test_greedy_tokens_with_and_without_graphs(tiny_llama_dir, num_prompts, extra):
    gen = torch.Generator().manual_seed(num_prompts)
    prompts = [
        torch.randint(3, 380, (int(n),), generator=gen).tolist()
        for n in torch.randint(4, 60, (num_prompts,), generator=gen)
    ]
    # different lengths: the decode batch shrinks step by step through padded sizes
    params = [
        {"max_new_tokens": 4 + 2 * i, "temperature": 0, "ignore_eos": True}
        for i in range(num_prompts)
    ]
    results = {}
    for disable in (False, True):
        with Engine(
            tiny_llama_dir,
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            max_running_requests=16,
            cuda_graph_max_bs=16,
            max_total_tokens=4096,
            disable_cuda_graph=disable,
            debug_check_invariants=True,
            **extra,
        ) as eng:
            assert (eng.runner.cuda_graph_runner is None) == disable
            results[disable] = [r.token_ids for r in eng.generate(prompts, params)]
    assert results[False] == results[True]
    assert [len(t) for t in results[False]] == [p["max_new_tokens"] for p in params]
