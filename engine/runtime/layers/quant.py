"""Block-quantized linear layers for CPU serving: GGUF's ``q4_1`` and ``q8_0`` weight formats
(blocks of 32 weights along the input dim with fp16-valued scales), run by the C products
(``packed.PackedWeight``) or, without the kernels, by torch ops on the dequantized weight.

    quantization  layer linears   lm_head
    none          dense           dense           (float32 products, the reference)
    int8          q8_0            q8_0
    int4          q4_1            q8_0            (the embedded SmolLM2 GGUF's own layout)
    auto          the GGUF's own format on CPU (Q4_1 -> int4, Q8_0 -> int8), else none

Why requantize the dense weights instead of reading the GGUF's blocks: a Q4_1 block's
dequantized values hit q = 0 and q = 15 exactly (ggml sets the block's min and max to those
codes), so min/max requantization with fp16-rounded scales recovers the file's codes and scales
bit for bit (``tests/unit/test_quant.py`` checks every tensor of the embedded model), and the
same code quantizes any safetensors checkpoint.

One product for every row count, as llama.cpp does: each 32-activation block is rounded to int8
(scale max|x| / 127) and multiplied with the weight codes as integers; a block's exact integer
dot is scaled and added in a fixed order (``csrc/products.h``). So a token row gets the same
outputs in a decode step of 1 row or a prefill of 2,000: the batch never changes an answer.
The int8 rounding costs ~0.3-2% relative error per product (measured), the error llama.cpp
serves with; prefill takes the same path (an earlier bf16 or float32 GEMM for > 16 rows made a
token's KV depend on how many rows shared its forward).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.layers.cpu_kernels import KERNELS
from engine.runtime.layers.packed import (
    PackedWeight,
    pack_q4_1,
    pack_q8_0,
    unpack_q4_1,
    unpack_q8_0,
)

log = logging.getLogger(__name__)

QK = 32  # weights per block
QUANTIZATIONS = ("auto", "none", "int8", "int4")


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

    With the C kernels the blocks are packed into panels (``packed.py``) and every product runs
    on them; without, the codes are kept as ``qs`` / ``d`` / ``m`` and products are dense
    float32 on the dequantized weight.
    """

    qs: torch.Tensor | None  # buffers: the GGUF block codes, None once packed
    d: torch.Tensor | None
    m: torch.Tensor | None  # None for q8_0

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("quantized linears run on CPU with float32 weights")
        out_features, in_features = weight.shape
        if in_features % QK:
            raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.bias = bias
        if scheme == "q4_1":
            qs, d, m = quantize_q4_1(weight)
        elif scheme == "q8_0":
            (qs, d), m = quantize_q8_0(weight), None
        else:
            raise ValueError(f"unknown quantization scheme {scheme!r}")
        self.panels: PackedWeight | None = None
        if KERNELS.get() is not None:
            panels = pack_q4_1(qs, d, m) if m is not None else pack_q8_0(qs, d)
            self.panels = PackedWeight(scheme, panels, out_features, in_features, bias)
        codes = self.panels is None  # packed: held once, as panels
        self.register_buffer("qs", qs if codes else None)
        self.register_buffer("d", d if codes else None)
        self.register_buffer("m", m if codes else None)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(qs, d, m)`` in GGUF's block layout (``m`` None for q8_0), from the panels if packed."""
        if self.panels is None:
            assert self.qs is not None and self.d is not None, "kept when not packed"
            return self.qs, self.d, self.m
        if self.scheme == "q4_1":
            return unpack_q4_1(self.panels.data, self.out_features)
        return (*unpack_q8_0(self.panels.data, self.out_features), None)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[out_features, in_features]`` the blocks stand for."""
        qs, d, m = self.codes()
        return dequantize_q4_1(qs, d, m) if m is not None else dequantize_q8_0(qs, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [..., in_features] float32 -> [..., out_features]
        if self.panels is not None:
            return self.panels(x)
        return F.linear(x, self.dequantize(), self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme}"


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


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """Replace the model's ``Linear`` modules (in place) for ``int8`` / ``int4``; returns how
    many. The vocab projection is ``q8_0`` in both (as in llama.cpp's Q4 files); a weight shared
    with the embedding stays dense for the embedding lookup."""
    from engine.runtime.layers.linear import Linear, LMHead

    if quantization == "none":
        return 0
    count = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or child.panels is not None:
                continue
            if child.in_features % QK:
                log.warning(
                    "%s: in_features %d not a multiple of %d; kept dense",
                    child_name,
                    child.in_features,
                    QK,
                )
                continue
            is_head = isinstance(child, LMHead)
            scheme = "q4_1" if quantization == "int4" and not is_head else "q8_0"
            with torch.no_grad():
                layer = QuantLinear(child.weight.detach(), child.bias, scheme)
            setattr(parent, child_name, layer)
            count += 1
    return count
