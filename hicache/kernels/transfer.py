"""The one module that copies KV bytes between the device pool (L1) and the host pool (L2).

Device side: one contiguous buffer per layer, ``k[l]`` / ``v[l]`` of ``[slots, H, D]``.
Host side: one tensor ``host_kv`` in a layout:

    layer_first  [2, L, size, H, D]   one layer of a page is contiguous (page_size * H * D)
    page_first   [2, size, L, H, D]   one token over all layers is contiguous (L * H * D)

io_backend ``kernel``: Triton kernels on CUDA (or when ``use_triton=True``, e.g. under
TRITON_INTERPRET=1), else the torch reference (``index_select`` + ``index_copy_``).
io_backend ``direct``: merges runs where both sides' pages are consecutive and copies slices.

NOTE: with ``page_size > 1`` the index tensors are token slots in whole pages, page-contiguous
and page-aligned (as both allocators hand them out): copies move whole pages, taking the page of
every ``page_size``-th index. A negative index on either side skips that token (page).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

IO_BACKENDS = ("kernel", "direct")
LAYOUTS = ("layer_first", "page_first")


def host_layer_pages(host_kv: torch.Tensor, kv: int, layer_id: int, layout: str, page_size: int):
    """View of one layer, K (kv=0) or V (kv=1), of the host pool: ``[pages, page_size, H*D]``
    (strided for page_first)."""
    if layout == "layer_first":
        _, _, size, h, d = host_kv.shape
        return host_kv[kv, layer_id].view(size // page_size, page_size, h * d)
    if layout == "page_first":
        _, size, layer_num, h, d = host_kv.shape
        return host_kv[kv].view(size // page_size, page_size, layer_num, h * d)[:, :, layer_id]
    raise ValueError(f"unknown host layout {layout!r}; expected one of {LAYOUTS}")


def device_pages(buf: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[slots, H, D]`` device buffer as ``[slots // page_size, page_size, H*D]``."""
    return buf.view(buf.shape[0] // page_size, page_size, buf.shape[1] * buf.shape[2])


def to_page_ids(
    src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token slots -> page ids (``[n / page_size]`` int64); negative stays negative."""
    assert src_indices.numel() == dst_indices.numel(), "index tensors differ in length"
    if page_size == 1:
        return src_indices, dst_indices
    return src_indices[::page_size] // page_size, dst_indices[::page_size] // page_size


def _drop_negative(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = (src >= 0) & (dst >= 0)
    if bool(keep.all()):
        return src, dst
    return src[keep], dst[keep]


def _copy_ref(src: torch.Tensor, dst: torch.Tensor, src_p: torch.Tensor, dst_p: torch.Tensor):
    # src/dst [pages, page_size, item]; gathers then scatters whole pages
    src_p, dst_p = _drop_negative(src_p, dst_p)
    if src_p.numel():
        rows = src.index_select(0, src_p.to(src.device))  # [m, page_size, item] on src's device
        dst.index_copy_(0, dst_p.to(dst.device), rows.to(dst.device, non_blocking=True))


def merge_runs(src_p: torch.Tensor, dst_p: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page ids step by +1; negatives dropped."""
    src_p, dst_p = _drop_negative(src_p.cpu(), dst_p.cpu())
    if src_p.numel() == 0:
        return []
    breaks = ((src_p[1:] - src_p[:-1]) != 1) | ((dst_p[1:] - dst_p[:-1]) != 1)
    starts = [0] + (torch.nonzero(breaks).flatten() + 1).tolist()
    ends = starts[1:] + [src_p.numel()]
    s, d = src_p.tolist(), dst_p.tolist()
    return [(s[a], d[a], b - a) for a, b in zip(starts, ends)]


def _copy_direct(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


def _use_triton(use_triton: bool | None, *tensors: torch.Tensor) -> bool:
    if use_triton is None:
        return any(t.is_cuda for t in tensors)
    return use_triton


def _check_backend(io_backend: str) -> None:
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {io_backend!r}; expected one of {IO_BACKENDS}")


def transfer_per_layer(
    host_kv: torch.Tensor,
    device_k: torch.Tensor,
    device_v: torch.Tensor,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    layer_id: int,
    layout: str,
    page_size: int,
    io_backend: str = "kernel",
    use_triton: bool | None = None,
) -> None:
    """Host -> device for one layer: ``device_k[device_indices] = host K[layer_id, host_indices]``
    (and V). ``device_k`` / ``device_v``: that layer's ``[slots, H, D]`` buffers."""
    _check_backend(io_backend)
    host_p, dev_p = to_page_ids(host_indices, device_indices, page_size)
    pairs = [(host_layer_pages(host_kv, kv, layer_id, layout, page_size), device_pages(buf, page_size))
             for kv, buf in ((0, device_k), (1, device_v))]  # fmt: skip
    if io_backend == "direct":
        runs = merge_runs(host_p, dev_p)
        for src, dst in pairs:
            _copy_direct(src, dst, runs)
    elif _use_triton(use_triton, device_k, host_indices):
        from hicache.kernels import triton_transfer

        for src, dst in pairs:
            triton_transfer.copy_pages(src, dst, host_p, dev_p, page_size)
    else:
        for src, dst in pairs:
            _copy_ref(src, dst, host_p, dev_p)


def transfer_all_layer(
    device_k: Sequence[torch.Tensor],
    device_v: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    layout: str,
    page_size: int,
    io_backend: str = "kernel",
    use_triton: bool | None = None,
) -> None:
    """Device -> host, every layer, K and V: ``host[:, l, host_indices] = device[l][device_indices]``."""
    _check_backend(io_backend)
    dev_p, host_p = to_page_ids(device_indices, host_indices, page_size)
    if io_backend == "kernel" and _use_triton(use_triton, device_indices, *device_k[:1]):
        from hicache.kernels import triton_transfer

        triton_transfer.gather_all_layer(
            device_k, device_v, host_kv, dev_p, host_p, layout, page_size
        )
        return
    runs = merge_runs(dev_p, host_p) if io_backend == "direct" else None
    for kv, bufs in ((0, device_k), (1, device_v)):
        for layer_id, buf in enumerate(bufs):
            src = device_pages(buf, page_size)
            dst = host_layer_pages(host_kv, kv, layer_id, layout, page_size)
            if runs is not None:
                _copy_direct(src, dst, runs)
            else:
                _copy_ref(src, dst, dev_p, host_p)


def gather_tokens(
    host_kv: torch.Tensor, host_indices: torch.Tensor, layout: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """All layers of ``host_indices`` ([n] int64, no negatives) as one contiguous tensor in the
    layout's own order: layer_first ``[2, L, n, H, D]``, page_first ``[2, n, L, H, D]``.

    page_first gathers whole-token rows (L*H*D elements): the fast path on CPU."""
    dim = 2 if layout == "layer_first" else 1
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; expected one of {LAYOUTS}")
    idx = host_indices.to(host_kv.device)
    if out is None:
        return host_kv.index_select(dim, idx)
    return torch.index_select(host_kv, dim, idx, out=out)


def scatter_tokens(
    host_kv: torch.Tensor, host_indices: torch.Tensor, layout: str, data: torch.Tensor
) -> None:
    """Inverse of ``gather_tokens``: ``data`` in the layout's flat order written at host_indices."""
    dim = 2 if layout == "layer_first" else 1
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; expected one of {LAYOUTS}")
    host_kv.index_copy_(
        dim, host_indices.to(host_kv.device), data.to(host_kv.device, host_kv.dtype)
    )
