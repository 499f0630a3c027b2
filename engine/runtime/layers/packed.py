"""Weights packed into column panels for the C products (``csrc/products.h``), and the call.

A ``PackedWeight`` holds one linear layer's weight in the layout ``products.h`` describes
(panels of 8 output columns; ``q4_1`` / ``q8_0`` blocks of 32 weights along k with fp16
scales, or float32), the zero-padded bias, and the ctypes descriptor the C side reads.
``weight(x)`` is ``x @ W^T + bias`` for any number of rows with one numeric path: each output
element is a fixed chain of roundings, so a row's result never depends on the rows beside it.

Packing is a permutation of the quantized codes and scales (no rounding: the scales are
already fp16 values), so ``unpack_*`` recovers them exactly.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from engine.runtime.layers.cpu_kernels import KERNELS, PackedLinearC, threads

QK = 32  # weights per block along k
NP = 8  # output columns per panel
SP = 4  # panels interleaved unit by unit (products.h: one memory stream per tile)
KINDS = {"q4_1": 0, "q8_0": 1, "f32": 2}


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows`` along dim 0."""
    if t.shape[0] == rows:
        return t
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """``[panels, units, ...]`` -> ``[panels / SP, units, SP, ...]`` (panels zero-padded to a
    multiple of SP): SP panels unit by unit, as products.h reads them."""
    t = _pad_rows(t, -(-t.shape[0] // SP) * SP)
    return t.view(-1, SP, *t.shape[1:]).transpose(1, 2).contiguous()


def _deinterleave(t: torch.Tensor, panels: int) -> torch.Tensor:
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:panels]


def _scales(s: torch.Tensor, panels: int) -> torch.Tensor:
    """``s [N, nb]`` float -> ``[panels, nb, 16]`` bytes: each panel-block's 8 fp16 values."""
    nb = s.shape[1]
    s = _pad_rows(s.to(torch.float16), panels * NP).view(panels, NP, nb).permute(0, 2, 1)
    return s.contiguous().view(torch.uint8)  # [panels, nb, 16]


def pack_q4_1(qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``qs uint8 [N, K/2]`` (GGUF block bytes), ``d, m [N, K/32]`` ->
    ``[panels / SP, K/32, SP, 160]``."""
    n, nb = d.shape
    panels = -(-n // NP)
    codes = _pad_rows(qs.view(n, nb, 4, 4), panels * NP).view(panels, NP, nb, 4, 4)
    codes = codes.permute(0, 2, 3, 1, 4).reshape(panels, nb, 128)  # vector j, lane c
    return _interleave(torch.cat((codes, _scales(d, panels), _scales(m, panels)), dim=2))


def unpack_q4_1(w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = _deinterleave(w, -(-n // NP))
    panels, nb, _ = w.shape
    codes = w[:, :, :128].reshape(panels, nb, 4, NP, 4).permute(0, 3, 1, 2, 4)
    qs = codes.reshape(panels * NP, nb * 16)[:n]
    d, m = (_unscales(w[:, :, a : a + 16], n) for a in (128, 144))
    return qs.contiguous(), d, m


def pack_q8_0(qs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``qs int8 [N, K]``, ``d [N, K/32]`` -> ``[panels / SP, K/32, SP, 272]`` (codes as
    u8 = q + 128)."""
    n, nb = d.shape
    panels = -(-n // NP)
    codes = (qs.view(torch.uint8) ^ 0x80).view(n, nb, 8, 4)
    codes = _pad_rows(codes, panels * NP).view(panels, NP, nb, 8, 4)
    codes = codes.permute(0, 2, 3, 1, 4).reshape(panels, nb, 256)  # vector g, lane c
    return _interleave(torch.cat((codes, _scales(d, panels)), dim=2))


def unpack_q8_0(w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    w = _deinterleave(w, -(-n // NP))
    panels, nb, _ = w.shape
    codes = w[:, :, :256].reshape(panels, nb, 8, NP, 4).permute(0, 3, 1, 2, 4)
    qs = (codes.reshape(panels * NP, nb * QK)[:n] ^ 0x80).view(torch.int8)
    return qs.contiguous(), _unscales(w[:, :, 256:272], n)


def _unscales(b: torch.Tensor, n: int) -> torch.Tensor:
    panels, nb, _ = b.shape
    s = b.contiguous().view(torch.float16).view(panels, nb, NP).permute(0, 2, 1)
    return s.reshape(panels * NP, nb)[:n].float().contiguous()


def pack_f32(w: torch.Tensor) -> torch.Tensor:
    """``w [N, K]`` float32 -> ``[panels / SP, K, SP, 8]`` (k-major panels)."""
    n, k = w.shape
    panels = -(-n // NP)
    return _interleave(_pad_rows(w.float(), panels * NP).view(panels, NP, k).permute(0, 2, 1))


def unpack_f32(w: torch.Tensor, n: int) -> torch.Tensor:
    w = _deinterleave(w, -(-n // NP))
    panels, k, _ = w.shape
    return w.permute(0, 2, 1).reshape(panels * NP, k)[:n].contiguous()


class PackedWeight:
    """``x [rows, in_features] -> x @ W^T + bias`` on the C products (float32, CPU)."""

    def __init__(
        self, kind: str, panels: torch.Tensor, n: int, k: int, bias: torch.Tensor | None
    ) -> None:
        lib = KERNELS.get()
        if lib is None:
            raise RuntimeError(f"packed weights need the CPU kernels: {KERNELS.error}")
        self.lib, self.kind, self.n, self.k = lib, kind, n, k
        self.data = panels  # [panels, ...] uint8 or float32, products.h's layout
        self.bias = None if bias is None else _pad_rows(bias.detach().float(), -(-n // NP) * NP)
        # NOTE: the descriptor holds raw pointers into data / bias, which this object keeps
        self.desc = PackedLinearC(
            KINDS[kind],
            panels.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            n,
            k,
        )

    @classmethod
    def dense(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedWeight:
        n, k = weight.shape
        return cls("f32", pack_f32(weight.detach()), n, k, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.k)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = torch.empty(rows.shape[0], self.n)
        if self.lib.linear_packed(
            ctypes.byref(self.desc), rows.data_ptr(), rows.shape[0], y.data_ptr(), threads()
        ):
            raise MemoryError("packed linear: no memory for its scratch")
        return y.view(*lead, self.n)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[n, k]`` the panels stand for."""
        from engine.runtime.layers.quant import dequantize_q4_1, dequantize_q8_0

        if self.kind == "q4_1":
            return dequantize_q4_1(*unpack_q4_1(self.data, self.n))
        if self.kind == "q8_0":
            return dequantize_q8_0(*unpack_q8_0(self.data, self.n))
        return unpack_f32(self.data, self.n)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The torch product on the dequantized weight (for comparisons, not for serving)."""
        b = None if self.bias is None else self.bias[: self.n]
        return F.linear(x.float(), self.dequantize(), b)
