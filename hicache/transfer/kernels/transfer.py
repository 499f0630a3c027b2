"""The one module that copies KV bytes between the device pool (L1) and the host pool (L2).

Device side: one contiguous buffer per layer, ``k[l]`` / ``v[l]`` of ``[slots, H, D]``.
Host side: one tensor ``host_kv`` in a layout:

    layer_first  [2, L, size, H, D]   one layer of a page is contiguous (page_size * H * D)
    page_first   [2, size, L, H, D]   one token over all layers is contiguous (L * H * D)

io_backend ``kernel``: Triton kernels on CUDA (or when ``use_triton=True``, e.g. under
TRITON_INTERPRET=1), else the torch path below. io_backend ``direct``: merges runs where both
sides' pages are consecutive and copies slices.

The torch path copies *rows* (the largest unit contiguous on both sides: a page of one layer,
or one token of one layer for page_first) by a ``copy_plan.CopyPlan`` built once per call and
applied to every K / V layer pair; host <-> flat (L3) copies move one row per page and
(K/V, layer) group. See ``copy_plan`` for the branches; every one is a byte copy (bit-exact).

NOTE: with ``page_size > 1`` the index tensors are token slots in whole pages, page-contiguous
and page-aligned (as both allocators hand them out): copies move whole pages, taking the page of
every ``page_size``-th index. A negative index on either side skips that token (page).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from hicache.transfer.kernels import copy_plan
from hicache.transfer.kernels.copy_plan import (
    CopyPlan,
    copy_rows,
    index_copy,
    merge_runs,
    plan_copy,
    plan_lists,
    scratch,
    wide_views,
)

IO_BACKENDS = ("kernel", "direct")
LAYOUTS = ("layer_first", "page_first")
# Host <-> flat copies: one copy_ per run moves every layer; it only beats one index_select /
# index_copy_ over all pages where a page's row in one group is small (layer_first, page 1:
# 768 bytes) and the runs are long. Measured: >= 16 pages per run, rows <= 4 KiB.
FLAT_RUN_PAGES = 16
FLAT_SMALL_ROW = 4 << 10
# Up to this many pages host <-> flat copies skip planning (a few microseconds per small op).
FLAT_FEW_PAGES = 4


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


def _page_tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids -> their token slots ([pages * page_size] int64); a negative page -> negatives."""
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)


# ---- device <-> host -----------------------------------------------------------------------
def _use_triton(use_triton: bool | None, *tensors: torch.Tensor) -> bool:
    if use_triton is None:
        return any(t.is_cuda for t in tensors)
    return use_triton


def _check_backend(io_backend: str) -> None:
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {io_backend!r}; expected one of {IO_BACKENDS}")


def _host_rows(host_kv: torch.Tensor, kv: int, layer_id: int, layout: str, page_size: int):
    """One layer (K or V) of the host pool as rows: layer_first ``[pages, page_size*H*D]``,
    page_first ``[size, H*D]`` (token rows, strided by L*H*D)."""
    if layout == "layer_first":
        _, _, size, h, d = host_kv.shape
        return host_kv[kv, layer_id].view(size // page_size, page_size * h * d)
    if layout == "page_first":
        _, size, layer_num, h, d = host_kv.shape
        return host_kv[kv].view(size, layer_num, h * d)[:, layer_id]
    raise ValueError(f"unknown host layout {layout!r}; expected one of {LAYOUTS}")


def _device_rows(buf: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """``[slots, H, D]`` as rows matching ``_host_rows``."""
    rows = buf.shape[0] // page_size if layout == "layer_first" else buf.shape[0]
    return buf.view(rows, -1)


def _plan_host_device(
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layout: str,
    page_size: int,
    token_bytes: int,
) -> CopyPlan:
    """Plan over page ids (layer_first: a page of a layer is one row) or token slots
    (page_first: a token of a layer is the contiguous unit), taking the page of every
    ``page_size``-th token slot."""
    assert src_indices.numel() == dst_indices.numel(), "index tensors differ in length"
    ps = page_size
    row_bytes = token_bytes * ps if layout == "layer_first" else token_bytes
    if src_indices.numel() <= copy_plan.SMALL_PLAN * ps:
        src = [t // ps for t in src_indices.tolist()[::ps]]
        dst = [t // ps for t in dst_indices.tolist()[::ps]]
        if layout == "page_first" and ps > 1:  # a negative page -> negative tokens
            src = [p * ps + i if p >= 0 else -1 for p in src for i in range(ps)]
            dst = [p * ps + i if p >= 0 else -1 for p in dst for i in range(ps)]
        return plan_lists(src, dst, row_bytes)
    src_p, dst_p = to_page_ids(src_indices, dst_indices, ps)
    if layout == "page_first":
        src_p, dst_p = _page_tokens(src_p, ps), _page_tokens(dst_p, ps)
    return plan_copy(src_p, dst_p, row_bytes)


_last_plan = threading.local()  # per thread: the load worker and the write worker differ


def _plan_cached(
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layout: str,
    page_size: int,
    token_bytes: int,
) -> CopyPlan:
    """``_plan_host_device``, reusing the previous call's plan when its indices are equal (the
    controller loads one layer per call, all with the same indices)."""
    key = (
        layout,
        page_size,
        token_bytes,
        copy_plan.RUN_BYTES,
        src_indices.device,
        dst_indices.device,
    )
    last = getattr(_last_plan, "entry", None)
    if (
        last is not None
        and last[0] == key
        and last[1].shape == src_indices.shape
        and last[2].shape == dst_indices.shape
        and torch.equal(last[1], src_indices)
        and torch.equal(last[2], dst_indices)
    ):
        return last[3]
    plan = _plan_host_device(src_indices, dst_indices, layout, page_size, token_bytes)
    _last_plan.entry = (key, src_indices.clone(), dst_indices.clone(), plan)
    return plan


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
    if io_backend == "direct" or _use_triton(use_triton, device_k, host_indices):
        host_p, dev_p = to_page_ids(host_indices, device_indices, page_size)
        pairs = [
            (
                host_layer_pages(host_kv, kv, layer_id, layout, page_size),
                device_pages(buf, page_size),
            )
            for kv, buf in ((0, device_k), (1, device_v))
        ]
        if io_backend == "direct":
            runs = merge_runs(host_p, dev_p)
            for src, dst in pairs:
                _copy_direct(src, dst, runs)
            return
        from hicache.transfer.kernels import triton_transfer

        # the kernel reads page ids from device memory (host slot ids live on the CPU)
        host_p, dev_p = host_p.to(device_k.device), dev_p.to(device_k.device)
        for src, dst in pairs:
            triton_transfer.copy_pages(src, dst, host_p, dev_p, page_size)
        return
    token_bytes = device_k.shape[1] * device_k.shape[2] * device_k.element_size()
    plan = _plan_cached(host_indices, device_indices, layout, page_size, token_bytes)
    buf = None
    for kv, dev in ((0, device_k), (1, device_v)):
        src = _host_rows(host_kv, kv, layer_id, layout, page_size)
        buf = buf if buf is not None else scratch(plan, src)
        copy_rows(src, _device_rows(dev, layout, page_size), plan, buf)


def _copy_direct(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    for s, d, n in runs:
        dst[d : d + n].copy_(src[s : s + n], non_blocking=True)


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
    if io_backend == "kernel" and _use_triton(use_triton, device_indices, *device_k[:1]):
        from hicache.transfer.kernels import triton_transfer

        dev_p, host_p = to_page_ids(device_indices, host_indices, page_size)
        dev_p, host_p = dev_p.to(device_k[0].device), host_p.to(device_k[0].device)
        triton_transfer.gather_all_layer(
            device_k, device_v, host_kv, dev_p, host_p, layout, page_size
        )
        return
    if io_backend == "direct":
        runs = merge_runs(*to_page_ids(device_indices, host_indices, page_size))
        for kv, bufs in ((0, device_k), (1, device_v)):
            for layer_id, buf in enumerate(bufs):
                dst = host_layer_pages(host_kv, kv, layer_id, layout, page_size)
                _copy_direct(device_pages(buf, page_size), dst, runs)
        return
    if not device_k:
        return
    token_bytes = device_k[0].shape[1] * device_k[0].shape[2] * device_k[0].element_size()
    plan = _plan_host_device(device_indices, host_indices, layout, page_size, token_bytes)
    staging: torch.Tensor | None = None  # one scratch buffer for every layer's copy
    for kv, bufs in ((0, device_k), (1, device_v)):
        for layer_id, dev in enumerate(bufs):
            src = _device_rows(dev, layout, page_size)
            staging = staging if staging is not None else scratch(plan, src)
            copy_rows(src, _host_rows(host_kv, kv, layer_id, layout, page_size), plan, staging)


# ---- host <-> flat (L3) --------------------------------------------------------------------
def _host_groups(host_kv: torch.Tensor, layout: str, page_size: int) -> torch.Tensor:
    """The host pool as ``[groups, pages, row]``: layer_first groups (K/V, layer) with a row of
    one layer of a page; page_first groups K/V with a row of one page over all layers."""
    if layout == "layer_first":
        two, layer_num, size, h, d = host_kv.shape
        return host_kv.view(two * layer_num, size // page_size, page_size * h * d)
    if layout == "page_first":
        two, size, layer_num, h, d = host_kv.shape
        return host_kv.view(two, size // page_size, page_size * layer_num * h * d)
    raise ValueError(f"unknown host layout {layout!r}; expected one of {LAYOUTS}")


def _flat_plan(host: torch.Tensor, host_indices: torch.Tensor, page_size: int) -> CopyPlan:
    """Plan host pages (every ``page_size``-th slot's page) -> flat pages ``0 .. m-1``, one row
    per page and group."""
    # one "byte" per page: slices when a single run, or runs of >= FLAT_RUN_PAGES small rows
    small_rows = host.shape[2] * host.element_size() <= FLAT_SMALL_ROW
    run_pages = FLAT_RUN_PAGES if small_rows else 1 << 62
    m = host_indices.numel() // page_size
    if m <= copy_plan.SMALL_PLAN:
        pages = [t // page_size for t in host_indices.tolist()[::page_size]]
        plan = plan_lists(pages, list(range(m)), 1, run_pages)
    else:
        pages_t = host_indices.cpu()
        if page_size > 1:
            pages_t = pages_t[::page_size] // page_size
        if small_rows:
            plan = plan_copy(pages_t, torch.arange(m), 1, run_pages)
        else:  # fewer small ops (each costs ~0.1 ms right after a big copy): one run or none
            first = int(pages_t[0])
            one_run = int(pages_t[-1]) - first == m - 1 and bool(
                ((pages_t[1:] - pages_t[:-1]) == 1).all()
            )
            plan = (
                CopyPlan(m, [(first, 0, m)], None, None, None, None)
                if one_run
                else CopyPlan(m, None, pages_t, None, None, 0)
            )
    if plan.rows != m or (plan.runs and plan.runs[0][0] < 0):
        raise IndexError("host indices must not be negative")
    return plan


def _few_pages(host_indices: torch.Tensor, page_size: int, device: torch.device) -> torch.Tensor:
    """Page ids of a few host slots (index ops raise on negatives), no plan: cheaper per call."""
    pages = host_indices if page_size == 1 else host_indices[::page_size] // page_size
    return pages.to(device)


def _group_rows(host: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[groups * pages_total, row]`` view and the row ids of ``pages`` in every group (so
    that a scatter is one row copy per (group, page))."""
    groups, total, row = host.shape
    idx = (torch.arange(groups)[:, None] * total + pages[None, :]).reshape(-1)
    return host.view(groups * total, row), idx.to(host.device)


def gather_tokens(
    host_kv: torch.Tensor,
    host_indices: torch.Tensor,
    layout: str,
    out: torch.Tensor | None = None,
    page_size: int = 1,
) -> torch.Tensor:
    """All layers of ``host_indices`` ([n] int64, no negatives; whole pages when
    ``page_size > 1``) as one contiguous tensor in the layout's own order: layer_first
    ``[2, L, n, H, D]``, page_first ``[2, n, L, H, D]``.

    page_first gathers whole-token rows (L*H*D elements): the fast path on CPU."""
    host = _host_groups(host_kv, layout, page_size)
    n = host_indices.numel()
    if layout == "layer_first":
        shape = (host_kv.shape[0], host_kv.shape[1], n, *host_kv.shape[3:])
    else:
        shape = (host_kv.shape[0], n, *host_kv.shape[2:])
    if out is None:
        out = torch.empty(shape, dtype=host_kv.dtype, device=host_kv.device)
    assert out.shape == shape and out.is_contiguous(), "out must be contiguous, of the flat shape"
    if n <= FLAT_FEW_PAGES * page_size:  # the controller's L3 loops: one page per call
        pages = _few_pages(host_indices, page_size, host.device)
        torch.index_select(host, 1, pages, out=out.view(host.shape[0], -1, host.shape[2]))
        return out
    plan = _flat_plan(host, host_indices, page_size)
    flat = out.view(host.shape[0], plan.rows, host.shape[2])
    if plan.runs is not None:
        for s, d, k in plan.runs:
            flat[:, d : d + k].copy_(host[:, s : s + k])
    else:  # one index per page; each copies its row in every group
        assert plan.src_idx is not None
        torch.index_select(host, 1, plan.src_idx.to(host.device), out=flat)
    return out


def scatter_tokens(
    host_kv: torch.Tensor,
    host_indices: torch.Tensor,
    layout: str,
    data: torch.Tensor,
    page_size: int = 1,
) -> None:
    """Inverse of ``gather_tokens``: ``data`` in the layout's flat order written at host_indices."""
    host = _host_groups(host_kv, layout, page_size)
    data = data.to(host_kv.device, host_kv.dtype).contiguous()
    if host_indices.numel() <= FLAT_FEW_PAGES * page_size:
        pages = _few_pages(host_indices, page_size, host.device)
        host_w, data_w = wide_views(host, data.view(host.shape[0], pages.numel(), -1))
        host_w.index_copy_(1, pages, data_w)
        return
    plan = _flat_plan(host, host_indices, page_size)
    flat = data.view(host.shape[0], plan.rows, host.shape[2])
    if plan.runs is not None:
        for s, d, k in plan.runs:
            host[:, s : s + k].copy_(flat[:, d : d + k])
    else:
        assert plan.src_idx is not None
        rows, idx = _group_rows(host, plan.src_idx)
        index_copy(rows, idx, flat.view(-1, host.shape[2]))
