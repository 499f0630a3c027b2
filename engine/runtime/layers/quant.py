"""Block-quantized linear layers for CPU serving: GGUF's ``q4_1`` and ``q8_0`` weight formats
(blocks of 32 weights along the input dim with float scales), run by the C kernels
(``cpu_kernels``) or, without them, by torch ops on the dequantized weight (the reference).

    quantization  layer linears   lm_head
    none          dense           dense           (the reference path)
    int8          q8_0            q8_0
    int4          q4_1            q8_0            (the embedded SmolLM2 GGUF's own layout)
    auto          the GGUF's own format on CPU (Q4_1 -> int4, Q8_0 -> int8), else none

Why requantize the dense weights instead of reading the GGUF's blocks: a Q4_1 block's
dequantized values hit q = 0 and q = 15 exactly (ggml sets the block's min and max to those
codes), so min/max requantization with fp16-rounded scales recovers the file's codes and scales
bit for bit (``tests/unit/test_quant.py`` checks every tensor of the embedded model), and the
same code quantizes any safetensors checkpoint.

Why two products: decode batches (up to ``DECODE_MAX_ROWS`` rows) multiply the blocks directly
(reading the weights once dominates). Both round each 32-activation block to int8 as llama.cpp
does (~0.3-2% relative error per product, measured; near-tie greedy tokens can flip); q8_0 with
float activations (widening every weight to float) ran the vocab projection at 2/3 of the memory
bandwidth on one row and 7x slower than needed on 16. Prefill batches
dequantize the layer's weight and run one dense GEMM (compute dominates there): in float32 the
result equals the dense path bit for bit; in bfloat16 (``prefill_matmul_dtype``; ``auto`` picks it
where the CPU has native bf16 dot products, AVX512-BF16 or AMX) weight and activations are
rounded to bf16 and the GEMM accumulates in float32: ~2-3x faster there, ~0.5% relative error
per product, of the order of the int8 rounding decode does. Without the kernels, every product
is the dense float32 one on the dequantized weight.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.layers.cpu_kernels import KERNELS, cpu_flags, threads

log = logging.getLogger(__name__)

QK = 32  # weights per block
QUANTIZATIONS = ("auto", "none", "int8", "int4")
PREFILL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Decode product up to this many rows; above it, dequantize + dense GEMM. Measured on a 2-core
# AVX2 EPYC for SmolLM2's shapes: the block product is faster than dequantize + sgemm up to 16
# rows and on par at 32 (both compute-bound there).
DECODE_MAX_ROWS = 16


# --------------------------------------------------------------------------- formats (torch)


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(qs uint8 [N, K/2], d [N, K/32], m [N, K/32])`` with ``w ~ d*q + m``;
    scales rounded to fp16 like ggml's. Byte j of a block: weight j (low) | weight j+16 (high)."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // QK, QK)
    m = blocks.amin(-1).half().float()  # [N, K/32]
    d = ((blocks.amax(-1) - m) / 15).half().float()
    scaled = (blocks - m[..., None]) / torch.where(d > 0, d, 1.0)[..., None]
    q = scaled.round().clamp(0, 15).to(torch.uint8)  # [N, K/32, 32]
    qs = q[..., :16] | (q[..., 16:] << 4)
    return qs.reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous()


def dequantize_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    packed = qs.reshape(n, -1, QK // 2)
    q = torch.cat((packed & 0x0F, packed >> 4), dim=-1).float()  # [N, K/32, 32]
    # NOTE: mul then add (no fused multiply-add), as ggml / gguf-py dequantize
    return (q * d[..., None] + m[..., None]).reshape(n, -1)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` -> ``(qs int8 [N, K], d [N, K/32])`` with ``w ~ d*q``, d rounded to fp16."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // QK, QK)
    d = (blocks.abs().amax(-1) / 127).half().float()
    q = (blocks / torch.where(d > 0, d, 1.0)[..., None]).round().clamp(-127, 127)
    return q.to(torch.int8).reshape(n, k).contiguous(), d.contiguous()


def dequantize_q8_0(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n = qs.shape[0]
    return (qs.reshape(n, -1, QK).float() * d[..., None]).reshape(n, -1)


# --------------------------------------------------------------------------- the layer


class QuantLinear(nn.Module):
    """A ``Linear`` whose weight is held block-quantized (``q4_1`` or ``q8_0``); same call.

    ``dense``: a float32 weight to use instead of dequantizing for batches of more than
    ``DECODE_MAX_ROWS`` rows (the vocab projection keeps its dense weight: dequantizing 28M
    weights per prefill would cost more than the GEMM, and a tied one is the embedding anyway).
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        scheme: str,
        dense: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("quantized linears run on CPU with float32 weights")
        out_features, in_features = weight.shape
        if in_features % QK:
            raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.bias = bias
        self.dense = dense
        self.prefill_dtype = torch.float32  # of the GEMM above DECODE_MAX_ROWS (set_prefill_dtype)
        if scheme == "q4_1":
            qs, d, m = quantize_q4_1(weight)
        elif scheme == "q8_0":
            (qs, d), m = quantize_q8_0(weight), None
        else:
            raise ValueError(f"unknown quantization scheme {scheme!r}")
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out_features, in_features]`` the blocks stand for, as float32 or (rounded
        to nearest) bfloat16."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dequantize to float32 or bfloat16, not {dtype}")
        lib = KERNELS.get()
        if lib is None:
            if self.m is not None:
                return dequantize_q4_1(self.qs, self.d, self.m).to(dtype)
            return dequantize_q8_0(self.qs, self.d).to(dtype)
        w = torch.empty(self.out_features, self.in_features, dtype=dtype)
        n, k = self.out_features, self.in_features
        bf16 = dtype == torch.bfloat16
        if self.m is not None:
            fn = lib.dequant_q4_1_bf16 if bf16 else lib.dequant_q4_1
            fn(_p(self.qs), _p(self.d), _p(self.m), n, k, _p(w), threads())
        else:
            fn = lib.dequant_q8_0_bf16 if bf16 else lib.dequant_q8_0
            fn(_p(self.qs), _p(self.d), n, k, _p(w), threads())
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] float32 -> [..., out_features]
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).contiguous()
        lib = KERNELS.get()
        if lib is None or rows.shape[0] > DECODE_MAX_ROWS:
            if self.prefill_dtype == torch.float32 or lib is None:
                weight = self.dense if self.dense is not None else self.dequantize()
                y = F.linear(rows, weight)  # [rows, out_features]
            else:  # accumulated in float32 by oneDNN
                bf = self.prefill_dtype
                y = F.linear(rows.to(bf), self.dequantize(bf)).float()
        else:
            y = torch.empty(rows.shape[0], self.out_features)
            n, k = self.out_features, self.in_features
            if self.m is not None:
                failed = lib.linear_q4_1_q8(_p(rows), rows.shape[0], k, _p(self.qs),
                                            _p(self.d), _p(self.m), n, _p(y), threads())
            else:
                failed = lib.linear_q8_0_q8(_p(rows), rows.shape[0], k, _p(self.qs),
                                            _p(self.d), n, _p(y), threads())
            if failed:
                raise MemoryError("quantized linear: no memory for its scratch")
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


_p = torch.Tensor.data_ptr


def resolve_quantization(
    name: str, device: torch.device, dtype: torch.dtype, gguf_types: set[str] | None
) -> str:
    """``none`` / ``int8`` / ``int4`` for ``--quantization name``; ``gguf_types`` are the GGUF
    tensor types of the model's layer weights (None when it was not a GGUF)."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; expected one of {QUANTIZATIONS}")
    cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if name in ("int8", "int4") and not cpu_fp32:
        raise ValueError(
            f"quantization {name!r} runs on CPU with float32 activations "
            f"(got {device.type}, {dtype}); use quantization='none'"
        )
    if name != "auto":
        return name
    if not cpu_fp32 or not gguf_types:
        return "none"
    if gguf_types <= {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K"} and any(
        t.startswith("Q4") for t in gguf_types
    ):
        return "int4"
    if gguf_types == {"Q8_0"}:
        return "int8"
    return "none"


def resolve_prefill_dtype(name: str, quantization: str) -> torch.dtype:
    """The prefill GEMMs' dtype for ``--prefill-matmul-dtype name`` (float32 on the dense path:
    it is the reference)."""
    if name not in ("auto", *PREFILL_DTYPES):
        raise ValueError(f"unknown prefill_matmul_dtype {name!r} (auto, float32, bfloat16)")
    if quantization == "none":
        return torch.float32
    if name == "auto":
        native = {"avx512_bf16", "amx_bf16"} & cpu_flags()
        return torch.bfloat16 if native and KERNELS.get() is not None else torch.float32
    return PREFILL_DTYPES[name]


def set_prefill_dtype(model: nn.Module, dtype: torch.dtype) -> int:
    """Every q4_1 / q8_0 layer runs its prefill GEMM in ``dtype`` (a layer that keeps a dense
    weight, the tied vocab projection, stays float32); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and module.dense is None:
            module.prefill_dtype = dtype
            count += 1
    return count


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """Replace the model's ``Linear`` modules (in place) for ``int8`` / ``int4``; returns how
    many. The vocab projection is ``q8_0`` in both (as in llama.cpp's Q4 files); a weight shared
    with the embedding stays dense there."""
    from engine.runtime.layers.linear import Linear, LMHead

    if quantization == "none":
        return 0
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or child.packed is not None:
                continue
            if child.in_features % QK:
                log.warning("%s: in_features %d not a multiple of %d; kept dense",
                            child_name, child.in_features, QK)
                continue
            is_head = isinstance(child, LMHead)
            scheme = "q4_1" if quantization == "int4" and not is_head else "q8_0"
            weight = child.weight.detach()
            with torch.no_grad():
                layer = QuantLinear(weight, child.bias, scheme, weight if is_head else None)
            setattr(parent, child_name, layer)
            count += 1
    return count
