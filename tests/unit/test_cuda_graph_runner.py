"""CudaGraphRunner's static buffers and padding on CPU: ``replay`` with ``capture=False`` runs
the model eagerly over the padded static batch (the triton backend under TRITON_INTERPRET=1), and
must give the plain forward's logits while writing no KV slot but the batch's own and the
padding slot 0. Also: which batches it accepts, the capture sizes, the config options.

NOTE: TRITON_INTERPRET is set and the kernels module reloaded (tests/triton_interpreter.py);
with CUDA present the real graphs are tested in tests/gpu instead, and this module is skipped.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
from tests.triton_interpreter import interpreted

(triton_kernels,) = interpreted("engine.runtime.layers.attention.triton_kernels")

from engine.config import ServerArgs
from engine.runtime.cuda_graph_runner import (
    PAD_ROW,
    PAD_SEQ_LEN,
    PAD_SLOT,
    CudaGraphRunner,
    capture_batch_sizes,
)
from engine.runtime.forward_batch import ForwardBatch, ForwardMode
from engine.runtime.layers.attention import create_backend
from engine.runtime.model_runner import ModelRunner
from engine.server import settings
from tests.tiny_models import make_tiny_model_dir

ATOL = 1e-5
MAX_RUNNING = 8  # capture sizes [1, 2, 4, 8]
PROMPT_LENS = [3, 6, 2, 5, 4, 1]  # a request per length


class _Requests:
    """Rows, slots and lengths of a few requests, with ForwardBatches built like the scheduler's
    (slots handed out by the runner's allocator, req_to_token written before the forward)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.last: list[int] = []  # each request's last token (the next decode input)

    def _fb(
        self,
        mode: ForwardMode,
        rids: list[int],
        ids: list[int],
        pos: list[int],
        locs: torch.Tensor,
        ext: list[int] | None,
    ) -> ForwardBatch:
        i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
        seq = [self.lens[r] for r in rids]
        r = self.runner
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(rids),
            input_ids=i64(ids),
            positions=i64(pos),
            out_cache_loc=locs.clone(),
            req_pool_indices=i64([self.rows[i] for i in rids]),
            seq_lens=i64(seq),
            extend_prefix_lens=i64([0] * len(rids)) if ext else None,
            extend_seq_lens=i64(ext) if ext else None,
            seq_lens_cpu=seq,
            extend_prefix_lens_cpu=[0] * len(rids) if ext else None,
            extend_seq_lens_cpu=ext,
            req_to_token_pool=r.req_to_token_pool,
            token_to_kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
        )

    def prefill(self, prompts: list[list[int]]) -> None:
        r = self.runner
        rids = list(range(len(self.rows), len(self.rows) + len(prompts)))
        ext = [len(p) for p in prompts]
        locs = r.allocator.alloc(sum(ext))
        start = 0
        for p in prompts:
            row = r.req_to_token_pool.alloc(1)[0]
            r.req_to_token_pool.write((row, slice(0, len(p))), locs[start : start + len(p)])
            start += len(p)
            self.rows.append(row)
            self.lens.append(len(p))
        ids = [t for p in prompts for t in p]
        pos = [i for p in prompts for i in range(len(p))]
        fb = self._fb(ForwardMode.EXTEND, rids, ids, pos, locs, ext)
        self.last += r.forward(fb).argmax(-1).tolist()

    def decode(self, rids: list[int]) -> tuple[torch.Tensor, list[ForwardBatch]]:
        """Allocates each request's next slot; returns the slots and two identical batches."""
        r = self.runner
        locs = r.allocator.alloc(len(rids))
        pos = [self.lens[i] for i in rids]
        for i, loc in zip(rids, locs):
            r.req_to_token_pool.write((self.rows[i], slice(self.lens[i], self.lens[i] + 1)), loc)
            self.lens[i] += 1
        ids = [self.last[i] for i in rids]
        return locs, [self._fb(ForwardMode.DECODE, rids, ids, pos, locs, None) for _ in range(2)]


def _kv(runner: ModelRunner) -> list[torch.Tensor]:
    pool = runner.kv_pool
    return [b.clone() for b in pool.k_buffer + pool.v_buffer]  # [num_slots, kv_heads, head_dim]


def _restore(runner: ModelRunner, bufs: list[torch.Tensor]) -> None:
    pool = runner.kv_pool
    for dst, src in zip(pool.k_buffer + pool.v_buffer, bufs):
        dst.copy_(src)


def _changed_slots(before: list[torch.Tensor], after: list[torch.Tensor]) -> set[int]:
    changed = torch.zeros(before[0].shape[0], dtype=torch.bool)
    for b, a in zip(before, after):
        changed |= (b != a).flatten(1).any(1)
    return set(torch.nonzero(changed).flatten().tolist())


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    # one layer: the interpreter runs every kernel program in Python
    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("cg") / "m"), num_hidden_layers=1)
    args = ServerArgs(
        model_path=path,
        attention_backend="triton",
        max_running_requests=MAX_RUNNING,
        max_total_tokens=256,
        context_length=64,
    )
    return ModelRunner(args)


def test_replay_matches_eager_and_writes_only_the_padding_slot(runner):
    assert runner.cuda_graph_runner is None  # CPU: no graphs
    cg = CudaGraphRunner(runner, capture=False)
    assert cg.batch_sizes == [1, 2, 4, 8] and not cg.capture_graphs and cg.graphs == {}
    reqs = _Requests(runner)
    gen = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    reqs.prefill([torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS])
    # 5 -> 8, then 3 -> 4 (row 3 still holds the previous batch's request: must become
    # padding), 4 (no padding), 1
    steps = [[0, 1, 2, 3, 4], [4, 0, 5], [1, 2, 3, 0], [3]]
    for rids in steps:
        locs, (fb_eager, fb_graph) = reqs.decode(rids)
        # Perturb every slot: a stale row that rewrote a previous step's slot with that step's
        # (bit-identical) K/V would otherwise go unnoticed. Both paths see the same pool.
        for buf in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer:
            buf.add_(torch.randn(buf.shape, generator=gen) * 0.01)
        before = _kv(runner)
        assert cg.can_run(fb_graph)
        logits = cg.replay(fb_graph)
        after_graph = _kv(runner)
        bs, padded_bs = len(rids), cg.padded_batch_size(len(rids))
        assert cg.out_cache_loc[bs:padded_bs].eq(PAD_SLOT).all()
        assert cg.seq_lens[bs:padded_bs].eq(PAD_SEQ_LEN).all()
        assert cg.req_pool_indices[bs:padded_bs].eq(PAD_ROW).all()
        _restore(runner, before)
        ref = runner.forward(fb_eager)  # the plain path: no graph runner on CPU
        after_eager = _kv(runner)

        assert logits.shape == ref.shape == (len(rids), vocab)
        torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
        own = set(locs.tolist())
        assert _changed_slots(before, after_eager) == own
        padded = padded_bs > bs
        # NOTE: the invariant: padding never writes a real request's KV, only slot 0
        assert _changed_slots(before, after_graph) - {PAD_SLOT} == own
        assert PAD_SLOT not in _changed_slots(before, after_graph) or padded
        for g, e in zip(after_graph, after_eager):
            torch.testing.assert_close(g[1:], e[1:], atol=ATOL, rtol=0)
        for i, tok in zip(rids, ref.argmax(-1).tolist()):
            reqs.last[i] = tok


def test_can_run_refuses(runner):
    cg = CudaGraphRunner(runner, capture=False)
    reqs = _Requests(runner)
    reqs.prefill([[5, 6, 7]] * (MAX_RUNNING + 1))
    base = len(reqs.rows) - (MAX_RUNNING + 1)
    rids = list(range(base, base + MAX_RUNNING + 1))
    _, (fb, _) = reqs.decode(rids[:2])
    assert cg.can_run(fb)
    # a layer-wise HiCache load in flight: per-layer host waits cannot be in a graph
    assert not cg.can_run(replace(fb, wait_layer=lambda layer_id: None))
    assert not cg.can_run(replace(fb, return_all_logits=True))
    assert not cg.can_run(replace(fb, attn_backend=create_backend("triton", None)))
    _, (big, _) = reqs.decode(rids)  # 9 > the largest captured size
    assert not cg.can_run(big)
    extend = reqs._fb(ForwardMode.EXTEND, [rids[0]], [5], [3], torch.tensor([0]), [1])
    assert not cg.can_run(extend)


def test_runner_needs_graph_support_and_cuda(runner):
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphRunner(runner, capture=True)
    assert CudaGraphRunner(runner).capture_graphs is False  # capture=None: CUDA only
    saved = runner.attn_backend
    runner.attn_backend = create_backend("torch_native", None)
    try:
        with pytest.raises(ValueError, match="graph support"):
            CudaGraphRunner(runner, capture=False)
    finally:
        runner.attn_backend = saved


@pytest.mark.parametrize(
    "max_bs,running,expected",
    [
        (160, 64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        (160, 12, [1, 2, 4, 8, 12]),  # the cap is always captured
        (20, 4096, [1, 2, 4, 8, 16, 20]),
        (1, 64, [1]),
        (3, 64, [1, 2, 3]),
    ],
)
def test_capture_batch_sizes(max_bs, running, expected):
    assert capture_batch_sizes(max_bs, running) == expected


def test_config_options():
    args = ServerArgs()
    assert args.disable_cuda_graph is False and args.cuda_graph_max_bs == 160
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=0)
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser)
    ns = parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "32"])
    _, engine_args = settings.load(ns, {})
    assert engine_args.disable_cuda_graph is True and engine_args.cuda_graph_max_bs == 32
    _, engine_args = settings.load(parser.parse_args([]), {"HICACHE_CUDA_GRAPH_MAX_BS": "8"})
    assert engine_args.cuda_graph_max_bs == 8 and engine_args.disable_cuda_graph is False
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        settings.load(parser.parse_args(["--cuda-graph-max-bs", "0"]), {})


def test_unknown_io_backend_is_rejected_up_front():
    with pytest.raises(ValueError, match="hicache_io_backend"):
        ServerArgs(hicache_io_backend="dma")
