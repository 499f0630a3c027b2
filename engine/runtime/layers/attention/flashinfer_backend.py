"""``flashinfer``: FlashInfer's paged attention kernels over the KV pool (the CUDA default).

The pool is read as a paged KV cache with pages of ONE slot (``NHD`` layout), so a request's
page list is just its slots. Per batch (``init_forward_metadata``) the backend gathers those
slots into a CSR list and ``plan()``s one wrapper; per layer it scatters the new K/V into the
pool and ``run()``s the planned wrapper:

    req_to_token                           kv_indptr  [0, 3, 5, 9]          [bs+1] int32, host
      row r0: [s7 s2 s9 . . .]  len 3      kv_indices [s7 s2 s9|s4 s1|s3 s8 s6 s5]  int32, device
      row r1: [s4 s1 . . . . ]  len 2                  |-- b0 --|-b1-|---- b2 ----|
      row r2: [s3 s8 s6 s5 . ]  len 4      kv_last_page_len [1, 1, 1]        [bs] int32, host
    per layer: k_buf [num_slots, kv_heads, head_dim] -> [num_slots, 1, kv_heads, head_dim]

    DECODE  BatchDecodeWithPagedKVCacheWrapper (tensor cores when heads / kv_heads >= 4 or fp8 KV)
    EXTEND  BatchPrefillWithPagedKVCacheWrapper, causal, qo_indptr = [0, cumsum(extend_seq_lens)]:
            FlashInfer aligns each request's queries to the END of its KV, so new token i of
            request b sees keys ``j <= prefix_len[b] + i`` (the new K/V are written first).

NOTE: ``plan()`` needs the indptrs on the host: they are built from ``seq_lens_cpu`` /
``extend_seq_lens_cpu`` so planning never waits on the device; only ``kv_indices`` is built on
device (one vectorized gather, no host sync).

Dtypes: FlashInfer computes in fp16/bf16. q is cast to the KV dtype when the pool is fp16/bf16
(and the output back to q's dtype); an fp8 pool is read as fp8 (``kv_data_type``) with q in
fp16/bf16; an fp32 pool is rejected (use ``--dtype bfloat16`` or another backend).

Deterministic inference (``deterministic_of``): prefill plans with ``fixed_split_size``
(PREFILL_SPLIT_SIZE keys per KV split, SGLang's default), decode with ``disable_split_kv`` on
tensor cores, in eager and CUDA-graph plans alike (flashinfer PR #1675, release 0.4.0; an older
flashinfer is refused, never silently run without them). That is meant to keep a batch's rows
independent; it does not make a token's prefill and decode outputs equal (different kernels),
and FlashInfer picks its prefill query tile by the batch (flashinfer issue #2424): the triton
backend is the one built for the whole property (engine/runtime/deterministic.py).

CUDA graphs (decode only): ``init_cuda_graph_state`` allocates fixed index buffers once; per
captured batch size a decode wrapper with ``use_cuda_graph=True`` lives on slices of them, and
``init_forward_metadata_replay`` re-plans it (copying the new indices into the same buffers)
before each replay. NOTE: both ``init_forward_metadata_capture`` and ``_replay`` call
``plan()``, which must run OUTSIDE graph capture.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from itertools import accumulate
from types import ModuleType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from engine.runtime.layers.attention import deterministic_of

if TYPE_CHECKING:
    from engine.runtime.forward_batch import ForwardBatch
    from engine.runtime.layers.radix_attention import RadixAttention

WORKSPACE_BYTES = 256 * 2**20  # float workspace shared by all wrappers (split-KV partials)
# Deterministic: a fixed split size no longer adapts the partials to the workspace; 2 GiB, as
# SGLang's and vLLM's deterministic modes size it
DETERMINISTIC_WORKSPACE_FACTOR = 8
PREFILL_SPLIT_SIZE = 4096  # deterministic prefill: KV keys per split
FIXED_SPLIT_OPTIONS = ("fixed_split_size", "disable_split_kv")  # plan() keywords, >= 0.4.0
_HALF = (torch.float16, torch.bfloat16)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_INSTALL_HINT = (
    "the flashinfer attention backend needs the flashinfer package and a CUDA GPU: "
    "pip install 'hicache[gpu]' (or choose --attention-backend triton / torch_native)"
)


class KVIndices(NamedTuple):
    kv_indptr: torch.Tensor  # [bs+1] int32, on seq_lens' device
    kv_indices: torch.Tensor  # [total] int32 slots, on req_to_token's device


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    total: int,
) -> KVIndices:
    """Each request's slots ``req_to_token[req_pool_indices[b], :seq_lens[b]]`` concatenated,
    and their CSR offsets. ``total == sum(seq_lens)`` (from the host list: no device sync)."""
    bs = seq_lens.shape[0]
    device = seq_lens.device
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(seq_lens, 0)
    token_req = torch.repeat_interleave(
        torch.arange(bs, device=device), seq_lens, output_size=total
    )  # [total]: request of each KV entry
    pos = torch.arange(total, device=device) - kv_indptr[token_req]  # [total] position in request
    kv_indices = req_to_token[req_pool_indices[token_req], pos]  # [total] int32
    return KVIndices(kv_indptr, kv_indices.to(torch.int32))


def host_indptr(lens: list[int]) -> torch.Tensor:
    """``[0, cumsum(lens)]`` as a ``[len(lens)+1]`` int32 CPU tensor (kv / qo indptr for plan)."""
    return torch.tensor([0, *accumulate(lens)], dtype=torch.int32)


def kernel_q_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype q (and the output) has inside FlashInfer for a pool of ``kv_dtype``."""
    if kv_dtype in _HALF:
        return kv_dtype
    if kv_dtype in _FP8:
        return q_dtype if q_dtype in _HALF else torch.bfloat16
    raise ValueError(
        f"flashinfer needs an fp16/bf16/fp8 KV cache, got {kv_dtype}; "
        "use --dtype bfloat16 (or --attention-backend triton)"
    )


class _Geometry(NamedTuple):
    """What a plan is specialized for; a layer that differs needs a new plan."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    q_dtype: torch.dtype  # inside the kernel (see kernel_q_dtype)
    kv_dtype: torch.dtype

    def use_tensor_cores(self) -> bool:
        return self.kv_dtype in _FP8 or self.num_qo_heads // self.num_kv_heads >= 4


@dataclass
class _Metadata:
    is_decode: bool
    qo_indptr: torch.Tensor | None  # [bs+1] int32 on host (EXTEND)
    kv_indptr: torch.Tensor  # [bs+1] int32 on host
    kv_indices: torch.Tensor  # [total] int32 slots on device
    kv_last_page_len: torch.Tensor  # [bs] int32 on host, all 1 (pages of one slot)
    wrapper: Any = None  # the FlashInfer wrapper planned for this batch
    graph: bool = False  # a CUDA-graph wrapper: fixed buffers, never re-planned in forward
    planned: _Geometry | None = None


def _import_flashinfer() -> ModuleType:
    try:
        import flashinfer
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return flashinfer


def check_fixed_split(fi: ModuleType) -> None:
    """Refuses a flashinfer whose plan() lacks the fixed-split options deterministic inference
    needs (added in 0.4.0)."""
    wrappers = (fi.BatchPrefillWithPagedKVCacheWrapper, fi.BatchDecodeWithPagedKVCacheWrapper)
    if all(
        set(FIXED_SPLIT_OPTIONS) <= inspect.signature(w.plan).parameters.keys() for w in wrappers
    ):
        return
    raise RuntimeError(
        f"enable_deterministic_inference with the flashinfer attention backend needs "
        f"flashinfer >= 0.4.0 (plan() options {', '.join(FIXED_SPLIT_OPTIONS)}); installed: "
        f"{getattr(fi, '__version__', 'unknown')}. Upgrade flashinfer-python, or use "
        f"--attention-backend triton"
    )


def _check_cuda(device: torch.device) -> None:
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"{_INSTALL_HINT}; got device {device}")


class FlashInferAttnBackend:
    """FlashInfer decode / prefill over the pool as pages of one slot; CUDA-graph capable."""

    reads_host_kv = False  # loads land on the device before the forward reads them

    supports_cuda_graph = True

    def __init__(self, model_runner_or_config: Any = None) -> None:
        self.fi = _import_flashinfer()
        runner = model_runner_or_config
        self.deterministic = deterministic_of(runner)
        if self.deterministic:
            check_fixed_split(self.fi)
        self.device: torch.device | None = None
        # Geometry known up front (from the model runner) lets init_forward_metadata plan
        # eagerly; without it the first forward() plans and the geometry is remembered.
        self.geom: _Geometry | None = None
        if runner is not None and hasattr(runner, "hf_config"):
            self.device = torch.device(runner.device)
            _check_cuda(self.device)
            head_dim = runner.head_dim
            kv_dtype = runner.kv_pool.dtype
            self.geom = _Geometry(
                runner.hf_config.num_attention_heads,
                runner.num_kv_heads,
                head_dim,
                head_dim**-0.5,  # RadixAttention's default scaling
                kernel_q_dtype(runner.dtype, kv_dtype),
                kv_dtype,
            )
        elif not torch.cuda.is_available():
            _check_cuda(torch.device("cpu"))
        self.workspace: torch.Tensor | None = None
        self.prefill_wrapper: Any = None
        self.decode_wrappers: dict[bool, Any] = {}  # use_tensor_cores -> eager decode wrapper
        self.meta: _Metadata | None = None
        # CUDA graphs: fixed buffers (init_cuda_graph_state) and one decode wrapper per bs
        self.graph_kv_indptr: torch.Tensor | None = None  # [max_bs+1] int32 on device
        self.graph_kv_indices: torch.Tensor | None = None  # [max_num_kv_tokens] int32 on device
        self.graph_last_page_len: torch.Tensor | None = None  # [max_bs] int32 on device, ones
        self.graph_wrappers: dict[int, Any] = {}

    # ---- wrappers -------------------------------------------------------------------------
    def _workspace(self, device: torch.device) -> torch.Tensor:
        if self.workspace is None:
            _check_cuda(device)
            self.device = device
            size = WORKSPACE_BYTES * (DETERMINISTIC_WORKSPACE_FACTOR if self.deterministic else 1)
            # NOTE: FlashInfer wants it zeroed before first use
            self.workspace = torch.zeros(size, dtype=torch.uint8, device=device)
        return self.workspace

    def _eager_wrapper(self, is_decode: bool, geom: _Geometry, device: torch.device) -> Any:
        ws = self._workspace(device)
        if not is_decode:
            if self.prefill_wrapper is None:
                self.prefill_wrapper = self.fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            return self.prefill_wrapper
        tc = self._tensor_cores(geom)
        if tc not in self.decode_wrappers:
            self.decode_wrappers[tc] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=tc
            )
        return self.decode_wrappers[tc]

    def _tensor_cores(self, geom: _Geometry) -> bool:
        # deterministic: decode on the tensor-core kernels, as SGLang's deterministic mode does
        return self.deterministic or geom.use_tensor_cores()

    def _plan(self, meta: _Metadata, geom: _Geometry, device: torch.device) -> None:
        if not meta.graph:
            meta.wrapper = self._eager_wrapper(meta.is_decode, geom, device)
        g = geom
        args = (
            meta.kv_indptr,
            meta.kv_indices,
            meta.kv_last_page_len,
            g.num_qo_heads,
            g.num_kv_heads,
            g.head_dim,
            1,
        )  # page_size 1
        kw: dict[str, Any] = {
            "sm_scale": g.sm_scale,
            "q_data_type": g.q_dtype,
            "kv_data_type": g.kv_dtype,
        }
        if self.deterministic:  # the same in eager and CUDA-graph plans
            kw.update(
                {"disable_split_kv": True}
                if meta.is_decode
                else {"fixed_split_size": PREFILL_SPLIT_SIZE}
            )
        if meta.is_decode:
            # NOTE: data_type too: in some 0.2 releases its "float16" default overrode q/kv
            meta.wrapper.plan(*args, data_type=g.kv_dtype, **kw)
        else:
            meta.wrapper.plan(meta.qo_indptr, *args, causal=True, **kw)
        meta.planned = geom
        self.geom = geom

    # ---- per batch --------------------------------------------------------------------------
    def _metadata(self, fb: ForwardBatch, graph: bool = False) -> _Metadata:
        is_decode = fb.forward_mode.is_decode()
        seq_lens_cpu = fb.seq_lens_cpu
        _, kv_indices = build_kv_indices(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, sum(seq_lens_cpu)
        )
        qo_indptr = None
        if not is_decode:
            assert fb.extend_seq_lens_cpu is not None
            qo_indptr = host_indptr(fb.extend_seq_lens_cpu)
        last_page_len = torch.ones(fb.batch_size, dtype=torch.int32)
        return _Metadata(
            is_decode, qo_indptr, host_indptr(seq_lens_cpu), kv_indices, last_page_len, graph=graph
        )

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.meta = self._metadata(fb)
        if self.geom is not None:
            self._plan(self.meta, self.geom, fb.seq_lens.device)

    # ---- CUDA graphs (decode) -----------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_kv_tokens: int) -> None:
        """Fixed index buffers every captured batch size shares (one replay at a time)."""
        device = self.device or torch.device("cuda", torch.cuda.current_device())
        self._workspace(device)
        self.graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self.graph_kv_indices = torch.zeros(max_num_kv_tokens, dtype=torch.int32, device=device)
        self.graph_last_page_len = torch.ones(max_bs, dtype=torch.int32, device=device)

    def init_forward_metadata_capture(self, fb: ForwardBatch) -> None:
        """DECODE batch of the padded static tensors for ``fb.batch_size``: create that batch
        size's graph wrapper on the fixed buffers and plan it (call outside graph capture)."""
        assert fb.forward_mode.is_decode(), "CUDA graphs capture DECODE batches only"
        if self.graph_kv_indptr is None or self.workspace is None:
            raise RuntimeError("init_cuda_graph_state must be called before capture")
        if self.geom is None:
            raise RuntimeError("capture needs the model geometry: pass the model runner")
        bs = fb.batch_size
        assert self.graph_kv_indices is not None and self.graph_last_page_len is not None
        if bs not in self.graph_wrappers:  # warm-up runs and the capture share one wrapper
            self.graph_wrappers[bs] = self.fi.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores(self.geom),
                paged_kv_indptr_buffer=self.graph_kv_indptr[: bs + 1],
                paged_kv_indices_buffer=self.graph_kv_indices,
                paged_kv_last_page_len_buffer=self.graph_last_page_len[:bs],
            )
        self.init_forward_metadata_replay(fb)

    def init_forward_metadata_replay(self, fb: ForwardBatch) -> None:
        """Before each replay: re-plan ``fb.batch_size``'s graph wrapper with the current
        (padded) batch; the plan copies the new indices into the captured buffers."""
        assert self.geom is not None and self.graph_kv_indices is not None
        total = sum(fb.seq_lens_cpu)
        if total > self.graph_kv_indices.shape[0]:
            raise ValueError(f"{total} KV tokens exceed max_num_kv_tokens of the graph state")
        meta = self._metadata(fb, graph=True)
        meta.wrapper = self.graph_wrappers[fb.batch_size]
        self._plan(meta, self.geom, fb.seq_lens.device)
        self.meta = meta

    # ---- per layer ----------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta = self.meta
        assert meta is not None, "init_forward_metadata was not called for this batch"
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)  # [num_slots, kv_heads, head_dim]
        heads, head_dim = layer.num_heads, layer.head_dim
        q_dtype = kernel_q_dtype(q.dtype, k_buf.dtype)
        geom = _Geometry(heads, layer.num_kv_heads, head_dim, layer.scaling, q_dtype, k_buf.dtype)
        if meta.planned != geom:
            if meta.graph:
                raise RuntimeError(f"CUDA-graph batch planned for {meta.planned}, layer is {geom}")
            self._plan(meta, geom, q.device)
        q3 = q.reshape(-1, heads, head_dim).to(q_dtype).contiguous()  # [num_tokens, heads, hd]
        # pages of one slot: [num_slots, 1, kv_heads, head_dim] (NHD)
        out = meta.wrapper.run(q3, (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        return out.reshape(-1, heads * head_dim).to(q.dtype)  # [num_tokens, heads*head_dim]
