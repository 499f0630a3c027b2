"""Linear and embedding layers created uninitialised on a given device (weights come from the
checkpoint), plus the fused projections the decoder uses: one matmul for q/k/v and one for
gate/up, loaded shard by shard from the separate HF tensors.

Linear backends (``--linear-backend``), for dense (unquantized) weights:
``cpu`` packs each weight once, after loading, into column panels for the C products
(``packed.PackedWeight``): every row count runs one numeric path (a fixed FMA chain along k per
output element), so a token row's result never depends on the batch around it. ``onednn``
(CPU) reorders each weight into oneDNN's blocked layout and runs ``mkldnn._linear_pointwise``;
``torch`` runs ``F.linear``. Neither of the last two is batch-invariant (their blocking and
reduction order change with the row count). ``auto`` = ``cpu`` on a float32 CPU with the C
kernels, else ``onednn`` on CPU with oneDNN, else ``torch``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.runtime.layers.cpu_kernels import KERNELS
from engine.runtime.layers.packed import PackedWeight

LINEAR_BACKENDS = ("auto", "torch", "onednn", "cpu")
# Row-count hint for oneDNN's weight layout: decode batches are the hot path. Measured on CPU:
# the hint barely matters (a 16-row packing is also faster than F.linear at 1,024 rows).
PACK_ROWS_HINT = 16


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight [out_features, in_features]`` (HF layout)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

        # oneDNN blocked copy of ``weight`` (``prepack(backend="onednn")``)
        self.onednn: torch.Tensor | None = None
        # C products' panels (``prepack(backend="cpu")``)
        self.panels: PackedWeight | None = None
        # batch_invariant.linear when deterministic inference is on (CUDA); it comes first
        self.matmul: Callable[..., torch.Tensor] | None = None

    def prepack(self, backend: str, free_dense: bool = True) -> None:
        """Repack the loaded weight for ``backend`` (``cpu`` or ``onednn``). ``free_dense`` drops
        the dense copy so the weights are held once (pass False when the tensor is shared, e.g. a
        tied lm_head)."""
        if backend == "cpu":
            self.panels = PackedWeight.dense(self.weight.detach(), self.bias)
        else:
            self.onednn = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach(), PACK_ROWS_HINT
            )
        if free_dense:
            # NOTE: keep a 0-element placeholder so the parameter still names dtype/device
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.matmul is not None:
            return self.matmul(x, self.weight, self.bias)  # [..., out_features]
        if self.panels is not None:
            return self.panels(x)  # [..., out_features]
        if self.onednn is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)  # [..., out_features]


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dim (q|k|v, gate|up).

    ``load_shard(name, tensor)`` copies one HF tensor (``weight`` or ``bias`` of shard ``name``)
    into its row range, so checkpoints with separate projections load into the fused weight.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias, device, dtype)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        start, size = self.shard_offsets[shard]
        target = self.weight if param == "weight" else self.bias
        if target is None:
            raise ValueError(f"checkpoint has a {shard} bias but the layer has none")
        if tensor.shape[0] != size:
            raise ValueError(f"{shard}.{param}: expected {size} rows, got {tuple(tensor.shape)}")
        with torch.no_grad():
            target[start : start + size].copy_(tensor)


class LMHead(Linear):
    """The vocab projection: prepacked or batch-invariant like any Linear, else
    ``chunked_linear`` on CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None or self.onednn is not None or self.matmul is not None:
            return super().forward(x)
        return chunked_linear(x, self.weight)  # [rows, vocab]


class Embedding(nn.Module):
    """Token embedding ``weight [vocab_size, hidden_size]``."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # [num_tokens, hidden_size]


def resolve_linear_backend(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``torch``, ``onednn`` or ``cpu`` for ``--linear-backend name`` on this device / dtype."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"unknown linear_backend {name!r}; expected one of {LINEAR_BACKENDS}")
    onednn_ok = (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        and dtype in (torch.float32, torch.bfloat16)
    )
    cpu_ok = device.type == "cpu" and dtype == torch.float32 and KERNELS.get() is not None
    if name == "onednn" and not onednn_ok:
        raise ValueError(
            f"linear_backend 'onednn' needs a CPU device with oneDNN and float32/bfloat16 "
            f"(got {device.type}, {dtype})"
        )
    if name == "cpu" and not cpu_ok:
        why = KERNELS.error if KERNELS.get() is None else f"{device.type}, {dtype}"
        raise ValueError(f"linear_backend 'cpu' needs float32 on a CPU with the C kernels ({why})")
    if name == "auto":
        if cpu_ok:
            return "cpu"
        return "onednn" if onednn_ok and dtype == torch.float32 else "torch"
    return name


def prepack_linears(model: nn.Module, backend: str) -> int:
    """Prepack every dense ``Linear`` of a loaded model for ``backend`` (``cpu`` / ``onednn``);
    returns how many. A weight shared with another module (tied embeddings) keeps its dense
    copy."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for linear in linears:
        linear.prepack(backend, free_dense=owners[id(linear.weight)] == 1)
    return len(linears)


def chunked_linear(x: torch.Tensor, weight: torch.Tensor, chunk_rows: int = 2048) -> torch.Tensor:
    """``F.linear(x, weight)`` over row blocks of a tall ``weight`` (the vocab projection).

    NOTE: for few input rows (decode) the product is bound by streaming ``weight`` from memory;
    on CPU, blocks of ~2k output rows measured ~25% faster than one GEMM over a 49k vocab."""
    if x.shape[0] > 64 or weight.shape[0] <= 2 * chunk_rows or x.device.type != "cpu":
        return F.linear(x, weight)
    blocks = [
        F.linear(x, weight[i : i + chunk_rows]) for i in range(0, weight.shape[0], chunk_rows)
    ]
    return torch.cat(blocks, dim=-1)  # [rows, out_features]
