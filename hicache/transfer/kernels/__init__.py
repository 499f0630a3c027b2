"""KV copy paths between the device pool and the host pool (torch reference + Triton)."""

from __future__ import annotations

from hicache.transfer.kernels.transfer import (
    IO_BACKENDS,
    LAYOUTS,
    gather_tokens,
    merge_runs,
    scatter_tokens,
    transfer_all_layer,
    transfer_per_layer,
)

__all__ = [
    "IO_BACKENDS",
    "LAYOUTS",
    "gather_tokens",
    "merge_runs",
    "scatter_tokens",
    "transfer_all_layer",
    "transfer_per_layer",
]
