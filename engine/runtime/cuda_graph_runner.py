"""CudaGraphRunner: decode batches replayed from CUDA graphs captured once per batch size.

A decode step launches hundreds of small kernels whose launch cost dominates at small batch
sizes; a captured graph replays all of them with one launch. Graphs have fixed shapes and fixed
addresses, so the runner owns static input buffers sized for the largest captured batch, and a
batch of ``bs`` requests replays the graph of the smallest captured size ``padded_bs >= bs``:

    static row:   0 ............ bs-1 | bs .......... padded_bs-1 | ... max_bs-1
    contents:     the batch's tensors | padding requests           | unused (stale)

Padding requests (their outputs are discarded; ``replay`` returns ``logits[:bs]``):
    input_ids 0, positions 0, seq_lens 1,
    out_cache_loc   ``PAD_SLOT`` (0): the allocator never hands out page 0, so the only KV a
                    padding request writes is the padding slot, which no request reads;
    req_pool_indices ``PAD_ROW`` (0): with seq_len 1 a padding request reads
                    ``req_to_token[0, 0]``, which is always a slot id inside the pool (the table
                    is zero-initialised, and a real request only ever writes allocator slots
                    there). Reading whatever KV sits at that slot is harmless: attention is
                    per request, so a padding row never mixes into a real row.

Capture sizes (SGLang's): ``[1, 2, 4, 8] + range(16, cuda_graph_max_bs + 1, 8)`` kept up to
``max_bs = min(cuda_graph_max_bs, max_running_requests)``, plus ``max_bs`` itself when it is off
that grid, so every decode batch the scheduler can build (<= max_running_requests) has a graph
when max_running_requests <= cuda_graph_max_bs. Larger batches run eagerly.

Deterministic inference: the backends give a replayed decode the same fixed KV splits as an
eager one (triton: its chunk grid sized by the table width; flashinfer: the same plan options),
so neither a graph nor its padding requests change a request's logits.

``capture=False`` runs the model eagerly on the padded static batch instead of replaying a graph:
the same buffers, padding and backend calls, without CUDA (how the CPU tests check them).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any, cast

import torch

from engine.runtime.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.runtime.layers.attention import CudaGraphAttentionBackend
    from engine.runtime.model_runner import ModelRunner

log = logging.getLogger(__name__)

PAD_SLOT = 0  # KV slot padding requests write (page 0 = the padding page)
PAD_ROW = 0  # req_to_token row padding requests read (``req_to_token[0, 0]``, see above)
PAD_SEQ_LEN = 1  # padding requests attend over one key
BASE_CAPTURE_SIZES = (1, 2, 4, 8)
CAPTURE_STEP = 8  # sizes from 16 on go in steps of 8
NUM_WARMUP = 2


def capture_batch_sizes(cuda_graph_max_bs: int, max_running_requests: int) -> list[int]:
    """Ascending decode batch sizes to capture (see the module docstring)."""
    max_bs = min(cuda_graph_max_bs, max_running_requests)
    grid = list(BASE_CAPTURE_SIZES) + list(range(16, cuda_graph_max_bs + 1, CAPTURE_STEP))
    return sorted({bs for bs in grid if bs <= max_bs} | {max_bs})


class CudaGraphRunner:
    """Runs DECODE batches of up to ``max_bs`` requests through per-batch-size CUDA graphs.

    ``capture=None``: capture real graphs iff the model runner's device is CUDA.
    NOTE: the logits ``replay`` returns are a view of the graph's static output: valid until the
    next ``replay``.
    """

    def __init__(self, model_runner: ModelRunner, capture: bool | None = None) -> None:
        self.model_runner = model_runner
        assert model_runner.model is not None, "built with the runner, before any shutdown"
        self.model = model_runner.model
        backend = model_runner.attn_backend
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.kv_pool = model_runner.kv_pool
        self.device = model_runner.device
        self.capture_graphs = self.device.type == "cuda" if capture is None else capture
        if self.capture_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if not backend.supports_cuda_graph:
            raise ValueError(f"attention backend {type(backend).__name__} has no graph support")
        self.backend = cast("CudaGraphAttentionBackend", backend)  # it says it supports graphs
        args = model_runner.args
        self.batch_sizes = capture_batch_sizes(args.cuda_graph_max_bs, args.max_running_requests)
        self.max_bs = self.batch_sizes[-1]

        # Static inputs [max_bs] int64 on device, allocated outside the graph pool; the graphs
        # read their first padded_bs rows.
        def buf(fill: int) -> torch.Tensor:
            return torch.full((self.max_bs,), fill, dtype=torch.int64, device=self.device)

        self.input_ids = buf(0)
        self.positions = buf(0)
        self.out_cache_loc = buf(PAD_SLOT)
        self.req_pool_indices = buf(PAD_ROW)
        self.seq_lens = buf(PAD_SEQ_LEN)
        # NOTE: an upper bound of sum(seq_lens) over a max_bs batch (prefix sharing lets the
        # sum exceed the pool, never max_bs full rows of req_to_token)
        max_num_kv_tokens = self.max_bs * self.req_to_token_pool.max_context_len
        self.backend.init_cuda_graph_state(self.max_bs, max_num_kv_tokens)

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bs -> [bs, vocab] logits in the graph pool
        if self.capture_graphs:
            start = time.perf_counter()
            self._capture_all()
            log.info(
                "captured CUDA graphs for decode batch sizes %s in %.2f s",
                self.batch_sizes,
                time.perf_counter() - start,
            )

    # --- batches over the static buffers ------------------------------------------------------
    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A DECODE ForwardBatch over the static buffers' first ``bs`` rows.

        NOTE: fresh slice objects on every call: RotaryEmbedding reuses its cos/sin while
        ``positions`` is the same tensor object, so a batch object must never be reused across
        forwards (e.g. warm-up then capture, or two eager replays)."""
        mr = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_prefix_lens=None,
            extend_seq_lens=None,
            seq_lens_cpu=seq_lens_cpu,
            extend_prefix_lens_cpu=None,
            extend_seq_lens_cpu=None,
            req_to_token_pool=mr.req_to_token_pool,
            token_to_kv_pool=mr.kv_pool,
            attn_backend=self.backend,
        )

    def padded_batch_size(self, bs: int) -> int:
        """The smallest captured batch size >= ``bs`` (``bs <= max_bs``)."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    # --- capture --------------------------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Largest first: it sizes the shared pool, the smaller graphs reuse its blocks.
        with torch.cuda.stream(stream):
            for bs in reversed(self.batch_sizes):
                self._capture_one(bs, pool, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    def _capture_one(self, bs: int, pool: Any, stream: torch.cuda.Stream) -> None:
        # The static buffers hold padding values here: every row is a padding request.
        pad_lens = [PAD_SEQ_LEN] * bs
        for _ in range(NUM_WARMUP):  # compiles the Triton kernels, sets up cuBLAS
            fb = self._static_batch(bs, pad_lens)
            self.backend.init_forward_metadata_capture(fb)
            self.model(fb)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        fb = self._static_batch(bs, pad_lens)
        self.backend.init_forward_metadata_capture(fb)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = self.model(fb)  # [bs, vocab] in the graph pool
        self.graphs[bs] = graph
        self.outputs[bs] = out

    # --- replay ---------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        """DECODE, 1..max_bs requests, no layer-wise HiCache load in flight (its per-layer waits
        are host calls a graph cannot hold), over this runner's pools and backend."""
        return (
            fb.forward_mode.is_decode()
            and 1 <= fb.batch_size <= self.max_bs
            and fb.wait_layer is None
            and not fb.return_all_logits
            and fb.req_to_token_pool is self.req_to_token_pool
            and fb.token_to_kv_pool is self.kv_pool
            and fb.attn_backend is self.backend
        )

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """``fb``'s logits ``[bs, vocab]`` on device; needs ``can_run(fb)``. No host syncs."""
        bs = fb.batch_size
        padded_bs = self.padded_batch_size(bs)
        # rows [0, bs): the batch; rows [bs, padded_bs): padding requests
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        if padded_bs > bs:
            self.input_ids[bs:padded_bs].fill_(0)
            self.positions[bs:padded_bs].fill_(0)
            self.out_cache_loc[bs:padded_bs].fill_(PAD_SLOT)
            self.req_pool_indices[bs:padded_bs].fill_(PAD_ROW)
            self.seq_lens[bs:padded_bs].fill_(PAD_SEQ_LEN)
        seq_lens_cpu = list(fb.seq_lens_cpu) + [PAD_SEQ_LEN] * (padded_bs - bs)
        padded = self._static_batch(padded_bs, seq_lens_cpu)
        self.backend.init_forward_metadata_replay(padded)
        if self.capture_graphs:
            self.graphs[padded_bs].replay()
            logits = self.outputs[padded_bs]
        else:
            logits = self.model(padded)  # [padded_bs, vocab]
        return logits[:bs]
