"""RMSNorm with an optional fused residual add (the SGLang decoder-layer convention)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
