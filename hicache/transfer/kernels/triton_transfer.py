"""Triton copy kernels between the device KV pool and the host pool, driven by int64 page ids.

One program copies one page (``page_size`` token rows; a row is one item of
``head_num * head_dim`` elements) of one layer, K or V. Negative page ids on either side are
skipped (padding). Host addressing by layout (strides in elements):

    layer_first [2, L, size, H, D]:  base + kv*kv_stride + layer*layer_stride + token*item
    page_first  [2, size, L, H, D]:  base + kv*kv_stride + token*(L*item)    + layer*item

Device buffers are one contiguous ``[size + page_size, H, D]`` tensor per layer; the all-layer
kernel reads them through a table of per-layer base pointers (``data_ptr`` values, int64).

NOTE: importing this module decorates the kernels, and Triton reads ``TRITON_INTERPRET`` at that
moment: set it before the first import to run them on CPU tensors (tests do).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _copy_pages_kernel(
    src_ptr,
    dst_ptr,
    src_pages_ptr,  # [num_pages] int64
    dst_pages_ptr,  # [num_pages] int64
    src_page_stride,
    src_token_stride,
    dst_page_stride,
    dst_token_stride,
    PAGE_SIZE: tl.constexpr,
    ITEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    src_page = tl.load(src_pages_ptr + pid)
    dst_page = tl.load(dst_pages_ptr + pid)
    if (src_page >= 0) & (dst_page >= 0):
        offs = tl.arange(0, BLOCK)
        for t in range(PAGE_SIZE):
            src_row = src_ptr + src_page * src_page_stride + t * src_token_stride
            dst_row = dst_ptr + dst_page * dst_page_stride + t * dst_token_stride
            for start in range(0, ITEM, BLOCK):
                mask = start + offs < ITEM
                vals = tl.load(src_row + start + offs, mask=mask)
                tl.store(dst_row + start + offs, vals, mask=mask)


@triton.jit
def _gather_all_layer_kernel(
    src_table_ptr,  # [2 * L] int64 base pointers: K of layers 0..L-1 then V
    dst_ptr,  # host kv buffer
    src_pages_ptr,  # [num_pages] int64 device page ids
    dst_pages_ptr,  # [num_pages] int64 host page ids
    dst_kv_stride,
    dst_layer_stride,
    dst_page_stride,
    dst_token_stride,
    LAYER_NUM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    ITEM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    kv = tl.program_id(2)
    src_page = tl.load(src_pages_ptr + pid)
    dst_page = tl.load(dst_pages_ptr + pid)
    if (src_page >= 0) & (dst_page >= 0):
        src_base = tl.load(src_table_ptr + kv * LAYER_NUM + layer).to(
            tl.pointer_type(dst_ptr.dtype.element_ty)
        )
        dst_base = dst_ptr + kv * dst_kv_stride + layer * dst_layer_stride
        offs = tl.arange(0, BLOCK)
        for t in range(PAGE_SIZE):
            src_row = src_base + (src_page * PAGE_SIZE + t) * ITEM
            dst_row = dst_base + dst_page * dst_page_stride + t * dst_token_stride
            for start in range(0, ITEM, BLOCK):
                mask = start + offs < ITEM
                vals = tl.load(src_row + start + offs, mask=mask)
                tl.store(dst_row + start + offs, vals, mask=mask)


def _block(item: int) -> int:
    return min(triton.next_power_of_2(item), _MAX_BLOCK)


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_pages: torch.Tensor,
    dst_pages: torch.Tensor,
    page_size: int,
) -> None:
    """Copy pages ``src[src_pages[i]] -> dst[dst_pages[i]]``.

    ``src`` / ``dst``: ``[pages, page_size, item]`` views (any page/token strides, unit stride
    inside a row), same dtype and item; page ids int64 on the tensors' device.
    """
    num_pages = src_pages.numel()
    if num_pages == 0:
        return
    assert src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:] == (page_size, src.shape[2])
    assert src.stride(2) == 1 and dst.stride(2) == 1
    item = src.shape[2]
    _copy_pages_kernel[(num_pages,)](
        src,
        dst,
        src_pages,
        dst_pages,
        src.stride(0),
        src.stride(1),
        dst.stride(0),
        dst.stride(1),
        PAGE_SIZE=page_size,
        ITEM=item,
        BLOCK=_block(item),
    )


def gather_all_layer(
    device_k: Sequence[torch.Tensor],
    device_v: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    device_pages: torch.Tensor,
    host_pages: torch.Tensor,
    layout: str,
    page_size: int,
) -> None:
    """Device -> host, every layer, K and V, in one launch of ``pages x layers x 2`` programs.

    ``device_k[l]`` / ``device_v[l]``: contiguous ``[slots, H, D]``; ``host_kv`` in ``layout``.
    """
    num_pages = device_pages.numel()
    layer_num = len(device_k)
    if num_pages == 0 or layer_num == 0:
        return
    bufs = list(device_k) + list(device_v)
    assert all(b.is_contiguous() and b.dtype == host_kv.dtype for b in bufs)
    item = bufs[0].shape[1] * bufs[0].shape[2]
    # [2 * L] int64 on device: per-layer base pointers
    table = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device=host_pages.device)
    if layout == "layer_first":  # [2, L, size, H, D]
        layer_stride, token_stride = host_kv.stride(1), host_kv.stride(2)
    else:  # page_first [2, size, L, H, D]
        layer_stride, token_stride = host_kv.stride(2), host_kv.stride(1)
    _gather_all_layer_kernel[(num_pages, layer_num, 2)](
        table,
        host_kv,
        device_pages,
        host_pages,
        host_kv.stride(0),
        layer_stride,
        page_size * token_stride,
        token_stride,
        LAYER_NUM=layer_num,
        PAGE_SIZE=page_size,
        ITEM=item,
        BLOCK=_block(item),
    )
