"""RMSNorm with an optional fused residual add (the SGLang decoder-layer convention)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.layers.cpu_kernels import threads


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim.

    ``forward(x)`` returns the normed tensor; ``forward(x, residual)`` first computes
    ``residual = x + residual`` and returns ``(norm(residual), residual)``, so a decoder layer
    carries the un-normed stream without an extra add per call site.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        # the C kernel (cpu_kernels) when the fast CPU path is on; None = torch ops (reference)
        self.kernel: Any = None
        # batch_invariant.rms_norm when deterministic inference is on (CUDA): this contract
        self.invariant: Any = None

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        # NOTE: low-precision inputs are normed in fp32 like the HF reference, then cast back.
        out = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps)
        return self.weight * out.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [..., hidden_size]
        if self.invariant is not None:
            return self.invariant(x, residual, self.weight, self.eps)
        if self.kernel is not None:
            return self._fused(x, residual)
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def _fused(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One C call for the add and the norm (float32, any leading shape)."""
        x = x.contiguous()
        rows = x.numel() // self.hidden_size
        out = torch.empty_like(x)
        if residual is None:
            self.kernel.rms_norm_residual(
                x.data_ptr(),
                None,
                self.weight.data_ptr(),
                self.eps,
                rows,
                self.hidden_size,
                out.data_ptr(),
                None,
                threads(),
            )
            return out
        residual = residual.contiguous()
        summed = torch.empty_like(x)
        self.kernel.rms_norm_residual(
            x.data_ptr(),
            residual.data_ptr(),
            self.weight.data_ptr(),
            self.eps,
            rows,
            self.hidden_size,
            out.data_ptr(),
            summed.data_ptr(),
            threads(),
        )
        return out, summed
