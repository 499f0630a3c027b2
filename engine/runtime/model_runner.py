"""ModelRunner: loads the model, sizes and owns the KV pools, runs one forward batch."""

from __future__ import annotations

import logging
from typing import Any

import torch

from engine.config import ServerArgs
from engine.runtime import deterministic
from engine.runtime.cuda_graph_runner import CudaGraphRunner
from engine.runtime.forward_batch import ForwardBatch
from engine.runtime.layers.attention import create_backend, default_backend
from engine.runtime.layers.attention.cpu_backend import CpuAttnBackend
from engine.runtime.layers.attention.cpu_backend import supports as cpu_attention_supports
from engine.runtime.layers.cpu_kernels import KERNELS, enable_cpu_kernels, kernel_status
from engine.runtime.layers.linear import prepack_linears, resolve_linear_backend
from engine.runtime.layers.quant import quantize_linears, resolve_quantization
from engine.runtime.models.llama_cpu_decode import install as install_fused_decode
from engine.runtime.models.loader import gguf_linear_types, load_model
from engine.runtime.request import Req
from engine.runtime.sampling import Sampler
from hicache.memory.allocator import TokenToKVPoolAllocator
from hicache.memory.kv_pool import MHATokenToKVPool
from hicache.memory.req_to_token import ReqToTokenPool

log = logging.getLogger(__name__)

DEFAULT_CPU_KV_GB = 2.0


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[
            name
        ]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} (auto, float32, float16, bfloat16)") from None


class ModelRunner:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.device = torch.device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
        torch.manual_seed(args.random_seed)
        model, self.hf_config, self.tokenizer = load_model(
            args.model_path, self.device, self.dtype, args.load_format, args.random_seed
        )
        # None once Engine.shutdown gave the weights back
        self.model: torch.nn.Module | None = model
        self.quantization = resolve_quantization(
            args.quantization, self.device, self.dtype, gguf_linear_types(args.model_path)
        )
        if self.quantization != "none":
            count = quantize_linears(self.model, self.quantization)
            log.info(
                "quantized %d linear layers to %s (kernels: %s)",
                count,
                self.quantization,
                kernel_status(),
            )
        self.linear_backend = resolve_linear_backend(args.linear_backend, self.device, self.dtype)
        if self.linear_backend in ("cpu", "onednn"):
            log.info(
                "prepacked %d dense linear layers for %s",
                prepack_linears(self.model, self.linear_backend),
                self.linear_backend,
            )
        self.deterministic = deterministic.enabled(args, self.device)
        if self.deterministic:
            log.info(
                "deterministic inference: %d layers batch-invariant",
                deterministic.install(self.model),
            )
        cfg = self.hf_config
        self.num_layers = cfg.num_hidden_layers
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.max_context_len: int = (
            args.context_length
            if args.context_length
            else getattr(cfg, "max_position_embeddings", 4096)
        )
        self._init_pools()
        # The CPU path: norms, RoPE, SiLU, products and attention on the C kernels, one numeric
        # path per token row (batch-invariant) for every quantization mode
        self.cpu_kernels = (
            self.device.type == "cpu" and self.dtype == torch.float32 and KERNELS.get() is not None
        )
        self._torch_ops = (
            enable_cpu_kernels(self.model, self.max_context_len) if self.cpu_kernels else []
        )
        cpu_attn = self.cpu_kernels and cpu_attention_supports(
            cfg.num_attention_heads, self.num_kv_heads, self.head_dim
        )
        default_attn = "cpu" if cpu_attn else default_backend(self.device, self.dtype)
        attn = args.attention_backend or default_attn
        if self.deterministic:
            attn = deterministic.attention_backend(args.attention_backend)
        self.attn_backend = create_backend(attn, self)
        self.batch_invariant = self._batch_invariant()
        # what computed the KV, for the L3 fingerprint: another numeric path's objects never match
        self.numerics = (
            "cpu-invariant-1"
            if self.batch_invariant
            else f"{self.device.type}|{self.linear_backend}|{type(self.attn_backend).__name__}"
            f"{'|deterministic' if self.deterministic else ''}"
        )
        if self.device.type == "cpu" and not self.batch_invariant:
            log.warning(
                "CPU path not batch-invariant (%s): a prompt's tokens may depend on the "
                "batch it runs in and on where its prefix's KV came from",
                self._why_not_invariant,
            )
        # one C call per decode step for the whole stack, where the model and setup allow
        self.fused_decode = (
            self.cpu_kernels
            and (why_not := install_fused_decode(self.model, self.kv_pool, self.attn_backend))
            is None
        )
        if self.cpu_kernels and not self.fused_decode:
            log.info("fused CPU decode off: %s", why_not)
        self.cuda_graph_runner: CudaGraphRunner | None = None
        if (
            self.device.type == "cuda"
            and not args.disable_cuda_graph
            and self.attn_backend.supports_cuda_graph
        ):
            self.cuda_graph_runner = CudaGraphRunner(self)
        self.sampler = Sampler(batch_invariant=self.deterministic)

    def _batch_invariant(self) -> bool:
        """Whether every op of this CPU setup is one of the C kernels (``cpu_kernels``); sets
        ``_why_not_invariant`` when not."""
        why = None
        if KERNELS.get() is None:
            why = f"no C kernels: {KERNELS.error}"
        elif not self.cpu_kernels:
            why = f"dtype {self.dtype} (the kernels are float32)"
        elif not isinstance(self.attn_backend, CpuAttnBackend):
            why = f"attention backend {type(self.attn_backend).__name__}"
        elif self.quantization == "none" and self.linear_backend != "cpu":
            why = f"linear_backend {self.linear_backend!r}"
        elif self._torch_ops:
            why = f"on torch ops: {', '.join(self._torch_ops[:3])}"
        self._why_not_invariant = why
        return why is None

    def _init_pools(self) -> None:
        args, ps = self.args, self.args.page_size
        bytes_per_token = (
            2
            * self.num_layers
            * self.num_kv_heads
            * self.head_dim
            * torch.tensor([], dtype=self.dtype).element_size()
        )
        if args.max_total_tokens is not None:
            size = args.max_total_tokens
        else:
            gb = args.kv_cache_memory_gb or DEFAULT_CPU_KV_GB
            if self.device.type == "cuda" and args.kv_cache_memory_gb is None:
                free, _ = torch.cuda.mem_get_info(self.device)
                gb = free * 0.8 / 2**30
            size = int(gb * 2**30 // bytes_per_token)
            # A pool larger than every running request at full context buys nothing.
            size = min(size, args.max_running_requests * self.max_context_len)
        size = max(ps, (size // ps) * ps)
        self.max_total_tokens = size
        # The context can never exceed the pool: one request must fit on its own.
        self.max_context_len = min(self.max_context_len, size)
        self.req_to_token_pool = ReqToTokenPool(
            args.max_running_requests + 8, self.max_context_len + ps, self.device
        )
        self.allocator = TokenToKVPoolAllocator(size, ps, self.device)
        self.kv_pool = MHATokenToKVPool(
            size, ps, self.dtype, self.num_kv_heads, self.head_dim, self.num_layers, self.device
        )
        log.info(
            "KV pool: %d tokens (%.2f GB), page size %d", size, size * bytes_per_token / 2**30, ps
        )

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits of ``fb`` (see the model's forward); DECODE batches a captured CUDA graph can
        run are replayed from it (logits valid until the next forward)."""
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(fb):
            return self.cuda_graph_runner.replay(fb)
        self.attn_backend.init_forward_metadata(fb)
        assert self.model is not None, "the engine was shut down"
        return self.model(fb)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        return self.sampler(logits, [r.params for r in reqs], [r.generator for r in reqs])

    def model_info(self) -> dict[str, Any]:
        cfg = self.hf_config
        return {
            "model_path": self.args.model_path or "embedded:SmolLM2-135M-Instruct",
            "architecture": (getattr(cfg, "architectures", None) or ["?"])[0],
            "vocab_size": self.vocab_size,
            "max_context_len": self.max_context_len,
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_size": cfg.hidden_size,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "max_total_tokens": self.max_total_tokens,
            "page_size": self.args.page_size,
            "linear_backend": self.linear_backend,
            "quantization": self.quantization,
            "cpu_kernels": kernel_status() if self.cpu_kernels else "off",
            "batch_invariant": self.batch_invariant,
            "fused_decode": self.fused_decode,
            "deterministic_inference": self.deterministic,
            "cuda_graph_batch_sizes": (
                self.cuda_graph_runner.batch_sizes if self.cuda_graph_runner else []
            ),
        }
