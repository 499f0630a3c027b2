"""ServerArgs: the one source of truth for engine options. An option SGLang has is spelled and
means as SGLang's (sglang/srt/server_args.py); where SGLang spells one of ours differently, its
name is accepted too (``ALIASES``, ``SGLANG_EXTRA_CONFIG``) and stored under ours. docs/daemon.md
"Option names and SGLang's" lists them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache.storage.redis.url import parse_target, redact_url

STORAGE_BACKENDS = (None, "file", "redis")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_SPELLINGS = {"float": "float32", "half": "float16"}  # SGLang's other names of the same

# Other names of our options, each meaning exactly what its target means: accepted wherever
# options are given (Engine(...) / ServerArgs.from_kwargs, flags, HICACHE_* env vars, TOML).
ALIASES: dict[str, str] = {
    "model": "model_path",  # Engine(model=...), --model, HICACHE_MODEL (SGLang: --model too)
    "disable_overlap_schedule": "disable_overlap",  # SGLang's name
}
# SGLang's --hicache-storage-backend-extra-config: a JSON object; the keys of it we have as
# options of our own set those (any other key is refused: nothing is silently ignored).
SGLANG_EXTRA_CONFIG = "hicache_storage_backend_extra_config"
EXTRA_CONFIG_KEYS = {
    "prefetch_threshold": "hicache_prefetch_threshold",
    "prefetch_timeout_base": "hicache_prefetch_timeout_base",
    "prefetch_timeout_per_ki_token": "hicache_prefetch_timeout_per_ki_token",
}


@dataclass
class ServerArgs:
    model_path: str | None = None  # HF dir, .gguf file, or None = embedded SmolLM2
    load_format: str = "auto"  # auto (checkpoint weights) | dummy (random weights, config only)
    device: str = "cpu"
    dtype: str = "auto"  # auto = float32 on CPU, bfloat16 on CUDA
    random_seed: int = 0
    context_length: int | None = None  # default: the model's max_position_embeddings
    # Memory
    page_size: int = 1
    max_total_tokens: int | None = None  # KV slots in the device pool (L1)
    kv_cache_memory_gb: float | None = None  # alternative to max_total_tokens
    max_running_requests: int = 64
    max_queued_requests: int = 4096
    # Scheduling
    chunked_prefill_size: int = 2048  # <= 0 disables chunking
    max_prefill_tokens: int = 16384
    schedule_policy: str = "lpm"  # lpm | dfs-weight | fcfs | lof | random
    schedule_conservativeness: float = 1.0
    # lpm / dfs-weight: a waiting request that this many later arrivals have overtaken goes
    # first, in arrival order (no starvation); 0 disables aging
    schedule_max_bypass: int = 20
    # Overlap scheduling: each forward runs on its own thread while the scheduler builds the next
    # batch and handles the previous one's results. None (auto): on where the forward runs on an
    # accelerator (SGLang's default), off on the CPU, where the forward already uses every core
    # and overlap measured ~5-25% slower (docs/benchmarks.md). True: off; False: on anywhere.
    disable_overlap: bool | None = None
    # Prefix cache
    disable_radix_cache: bool = False
    radix_eviction_policy: str = "lru"  # lru | lfu
    # Attention
    # torch_native | triton | flashinfer; None: torch_native on CPU, flashinfer on CUDA (triton
    # without flashinfer or for float32)
    attention_backend: str | None = None
    # Dense weights' products: auto | cpu (the C kernels: batch-invariant) | onednn | torch (auto
    # = cpu on a float32 CPU with the kernels; onednn and torch are not batch-invariant)
    linear_backend: str = "auto"
    # Weights held block-quantized on CPU: none | int8 (q8_0) | int4 (q4_1, lm_head q8_0) | auto
    # (a GGUF's own format on CPU: the embedded Q4_1 model runs int4; none otherwise)
    quantization: str = "auto"
    # Deterministic inference (SGLang's --enable-deterministic-inference): a prompt's tokens do
    # not depend on which requests share its forwards nor on whether its prefix came from the
    # cache. On CUDA: batch-invariant matmul / RMSNorm / sampling softmax and attention with
    # fixed KV split sizes (engine/runtime/deterministic.py; the attention backend defaults to
    # triton). On the CPU it changes nothing: the CPU path is batch-invariant always.
    enable_deterministic_inference: bool = False
    # CUDA graphs for decode batches (CUDA only, backends with supports_cuda_graph)
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160  # largest captured decode batch (also capped by running reqs)
    # Hierarchical cache (L2 host / L3 storage)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0  # GB; overrides hicache_ratio when > 0
    hicache_write_policy: str = (
        "write_through"  # write_through | write_through_selective | write_back
    )
    hicache_mem_layout: str = "layer_first"  # layer_first | page_first
    hicache_io_backend: str = "kernel"  # kernel | direct
    hicache_storage_backend: str | None = None  # file | redis
    hicache_storage_dir: str | None = None  # file: the directory
    hicache_storage_size_gb: float = 16.0  # file: the cap (redis: the server's maxmemory)
    # redis: redis://[user:pass@]host:port/db, rediss:// (TLS), unix://path,
    # redis-cluster://host:port[,host:port...] (a Redis / Valkey Cluster)
    hicache_storage_url: str | None = None
    # redis: keys live under "<prefix>:<model scope>:"; Flush of L3 deletes only those
    hicache_storage_key_prefix: str = "hicache"
    # Tokens per L3 object, a multiple of page_size. A tail shorter than one object is not
    # stored, so a turn read back from L3 misses its tail below the last object boundary. None
    # (auto), rounded up to a multiple of page_size: 64 on CUDA (not measured here), 16
    # elsewhere: on a CPU with chat prompts of 150-250 tokens 64-token objects cost 0.09-0.11 of
    # all prompt tokens in those tails (gateway bench under pressure with a shared Valkey: 0.87
    # of the ideal with 64, 0.93 with 32, 0.96 with 16, side by side; docs/benchmarks.md).
    hicache_storage_page_size: int | None = None
    # best_effort | wait_complete | timeout (SGLang's default too). NOTE: best_effort admits a
    # request with whatever arrived when it is scheduled: on an idle server that is nothing.
    # timeout admits as soon as the prefetch is complete, at most base + per-1k-token later.
    hicache_storage_prefetch_policy: str = "timeout"
    hicache_prefetch_timeout_base: float = 1.0  # seconds
    hicache_prefetch_timeout_per_ki_token: float = 0.25  # seconds per 1,024 prefetched tokens
    # Fewest tokens an L3 hit must add beyond the L1 + L2 match to be prefetched (fewer are
    # recomputed). None (auto): 256 on CUDA (SGLang's default, where a short prefill is cheap;
    # not measured here), 0 elsewhere: on a CPU reading a hit back is never slower than
    # recomputing it (as fast at 16 tokens, 5x faster at 224), and a prefix shared with other
    # prompts (a chat template's header, a system prompt) sitting in L1 would otherwise keep a
    # conversation's first 256 tokens in L3 from being read (docs/benchmarks.md, Gateway).
    hicache_prefetch_threshold: int | None = None
    # Debug
    debug_check_invariants: bool = False  # KV accounting + tree integrity after every step

    def overlap_enabled(self) -> bool:
        """Whether forwards run on the ForwardWorker thread (``disable_overlap``)."""
        if self.disable_overlap is None:
            return not self.device.startswith("cpu")
        return not self.disable_overlap

    def __post_init__(self) -> None:
        self.dtype = DTYPE_SPELLINGS.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} ({', '.join(DTYPES)})")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.schedule_policy not in ("lpm", "dfs-weight", "fcfs", "lof", "random"):
            raise ValueError(f"unknown schedule_policy {self.schedule_policy!r}")
        if self.radix_eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown radix_eviction_policy {self.radix_eviction_policy!r}")
        if self.schedule_max_bypass < 0:
            raise ValueError(f"schedule_max_bypass must be >= 0, got {self.schedule_max_bypass}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r} (auto, dummy)")
        if self.linear_backend not in ("auto", "torch", "onednn", "cpu"):
            raise ValueError(
                f"unknown linear_backend {self.linear_backend!r} (auto, cpu, onednn, torch)"
            )
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"unknown quantization {self.quantization!r} (auto, none, int8, int4)")
        if self.hicache_write_policy not in (
            "write_through",
            "write_through_selective",
            "write_back",
        ):
            raise ValueError(f"unknown hicache_write_policy {self.hicache_write_policy!r}")
        if self.hicache_io_backend not in ("kernel", "direct"):
            raise ValueError(f"unknown hicache_io_backend {self.hicache_io_backend!r}")
        if self.hicache_mem_layout not in ("layer_first", "page_first"):
            raise ValueError(f"unknown hicache_mem_layout {self.hicache_mem_layout!r}")
        if self.hicache_storage_prefetch_policy not in ("best_effort", "wait_complete", "timeout"):
            raise ValueError(
                f"unknown hicache_storage_prefetch_policy {self.hicache_storage_prefetch_policy!r}"
            )
        if self.hicache_storage_backend not in STORAGE_BACKENDS:
            raise ValueError(
                f"unknown hicache_storage_backend {self.hicache_storage_backend!r} (file, redis)"
            )
        if self.hicache_storage_backend == "redis":
            if not self.hicache_storage_url:
                raise ValueError(
                    "hicache_storage_backend='redis' needs hicache_storage_url "
                    "(redis://host:port/db, rediss://..., redis-cluster://h:p,h:p)"
                )
            parse_target(self.hicache_storage_url)  # ValueError naming what is wrong
        if self.hicache_storage_page_size is None:
            tokens = 64 if self.device.startswith("cuda") else 16
            self.hicache_storage_page_size = -(-tokens // self.page_size) * self.page_size
        sps = self.hicache_storage_page_size
        if sps < 1 or sps % self.page_size:
            raise ValueError(
                f"hicache_storage_page_size must be a positive multiple of page_size "
                f"({self.page_size}), got {sps}"
            )
        if self.hicache_prefetch_timeout_base < 0 or self.hicache_prefetch_timeout_per_ki_token < 0:
            raise ValueError("hicache_prefetch_timeout_base / _per_ki_token must be >= 0")
        if self.hicache_prefetch_threshold is None:
            self.hicache_prefetch_threshold = 256 if self.device.startswith("cuda") else 0
        if self.hicache_prefetch_threshold < 0:
            raise ValueError("hicache_prefetch_threshold must be >= 0")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        """Options by name, SGLang's spellings included (``canonical``)."""
        kwargs = canonical(kwargs)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def public_dict(self) -> dict[str, Any]:
        """to_dict() without secrets (the storage URL's password), for logs and GetServerInfo."""
        d = self.to_dict()
        if d["hicache_storage_url"]:
            d["hicache_storage_url"] = redact_url(d["hicache_storage_url"])
        return d


def canonical(options: Mapping[str, Any], aliases: Mapping[str, str] = ALIASES) -> dict[str, Any]:
    """``options`` under our names: ``aliases`` renamed, SGLang's extra config spread over the
    options it sets. TypeError when one option is given under two names."""
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # our name -> the name it was given under

    def put(name: str, as_given: str, value: Any) -> None:
        if name in given:
            raise TypeError(
                f"{given[name]} and {as_given} are the same option ({name}): give one of them"
            )
        given[name], out[name] = as_given, value

    for name, value in options.items():
        if name == SGLANG_EXTRA_CONFIG:
            for key, v in extra_config(value).items():
                put(EXTRA_CONFIG_KEYS[key], f"{SGLANG_EXTRA_CONFIG}[{key!r}]", v)
        else:
            put(aliases.get(name, name), name, value)
    return out


def extra_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """SGLang's hicache_storage_backend_extra_config (a JSON object, or a dict) -> its keys;
    ValueError naming what cannot be used."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{SGLANG_EXTRA_CONFIG}: not a JSON object ({e})") from None
    if not isinstance(value, Mapping):
        # NOTE: bad input is a ValueError everywhere (the CLI's exit 2, HTTP 400)
        raise ValueError(f"{SGLANG_EXTRA_CONFIG}: expected a JSON object, got {value!r}")  # noqa: TRY004
    unknown = sorted(set(value) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"{SGLANG_EXTRA_CONFIG}: unsupported key(s) {', '.join(unknown)} "
            f"(supported: {', '.join(EXTRA_CONFIG_KEYS)})"
        )
    for key, v in value.items():
        number = isinstance(v, (int, float)) and not isinstance(v, bool)
        if not number or (key == "prefetch_threshold" and not isinstance(v, int)):
            kind = "an integer" if key == "prefetch_threshold" else "a number"
            raise ValueError(f"{SGLANG_EXTRA_CONFIG}: {key} must be {kind}, got {v!r}")
    return dict(value)


__all__ = ["ALIASES", "STORAGE_BACKENDS", "ServerArgs", "canonical", "field", "redact_url"]
