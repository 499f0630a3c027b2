"""Every Triton transfer kernel under TRITON_INTERPRET=1 on CPU == the torch reference, exactly.

NOTE: Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when
hicache.transfer.kernels.triton_transfer is imported; so this module sets it first and re-imports the
kernels module if something imported it earlier. With CUDA present the real kernels are tested in
tests/gpu instead, and this module is skipped (reloading would swap them for interpreted ones).
"""

from __future__ import annotations

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
pytest.importorskip("triton")
from tests.triton_interpreter import interpreted

(triton_transfer,) = interpreted("hicache.transfer.kernels.triton_transfer")

from hicache.transfer.kernels import transfer_all_layer, transfer_per_layer

L, H, D = 2, 3, 4  # item = 12 elements: not a power of two
HOST_PAGES = 6

PAGE_PATTERNS = [  # (host pages, device pages)
    ([0, 1, 2], [1, 2, 3]),
    ([5, 2, 0], [3, 1, 2]),
    ([1, -1, 4], [-1, 2, 5]),
    ([3], [4]),
]


def slots(pages: list[int], page_size: int) -> torch.Tensor:
    out = [p * page_size + i if p >= 0 else -1 for p in pages for i in range(page_size)]
    return torch.tensor(out, dtype=torch.int64)


def make(layout: str, page_size: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    size = HOST_PAGES * page_size
    shape = (2, L, size, H, D) if layout == "layer_first" else (2, size, L, H, D)
    host = torch.randn(shape, generator=g).to(dtype)
    dk = [torch.randn(6 * page_size, H, D, generator=g).to(dtype) for _ in range(L)]
    dv = [torch.randn(6 * page_size, H, D, generator=g).to(dtype) for _ in range(L)]
    return host, dk, dv


CASES = [
    (layout, ps, case)
    for layout in ("layer_first", "page_first")
    for ps in (1, 16)
    for case in range(len(PAGE_PATTERNS))
]


@pytest.mark.parametrize("layout,page_size,case", CASES)
def test_per_layer_kernel_equals_reference(layout, page_size, case):
    host_pages, dev_pages = PAGE_PATTERNS[case]
    hi, di = slots(host_pages, page_size), slots(dev_pages, page_size)
    host, dk, dv = make(layout, page_size, torch.float32, case)
    ref_k, ref_v = [b.clone() for b in dk], [b.clone() for b in dv]
    layer = 1
    transfer_per_layer(
        host, ref_k[layer], ref_v[layer], hi, di, layer, layout, page_size, use_triton=False
    )
    transfer_per_layer(
        host, dk[layer], dv[layer], hi, di, layer, layout, page_size, use_triton=True
    )
    assert torch.equal(dk[layer], ref_k[layer]) and torch.equal(dv[layer], ref_v[layer])
    assert not torch.equal(dk[layer], make(layout, page_size, torch.float32, case)[1][layer])
    assert torch.equal(dk[0], ref_k[0])  # other layers untouched


@pytest.mark.parametrize("layout,page_size,case", CASES)
def test_all_layer_kernel_equals_reference(layout, page_size, case):
    host_pages, dev_pages = PAGE_PATTERNS[case]
    hi, di = slots(host_pages, page_size), slots(dev_pages, page_size)
    host, dk, dv = make(layout, page_size, torch.float32, 100 + case)
    ref = host.clone()
    transfer_all_layer(dk, dv, ref, di, hi, layout, page_size, use_triton=False)
    transfer_all_layer(dk, dv, host, di, hi, layout, page_size, use_triton=True)
    assert torch.equal(host, ref)
    assert not torch.equal(host, make(layout, page_size, torch.float32, 100 + case)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8])
def test_kernels_other_dtypes(dtype):
    hi, di = slots([2, 0], 1), slots([1, 3], 1)
    host, dk, dv = make("page_first", 1, dtype, 7)
    ref = host.clone()
    transfer_all_layer(dk, dv, ref, di, hi, "page_first", 1, use_triton=False)
    transfer_all_layer(dk, dv, host, di, hi, "page_first", 1, use_triton=True)
    assert torch.equal(host, ref)
    ref_k, ref_v = [b.clone() for b in dk], [b.clone() for b in dv]
    transfer_per_layer(host, ref_k[0], ref_v[0], hi, di, 0, "page_first", 1, use_triton=False)
    transfer_per_layer(host, dk[0], dv[0], hi, di, 0, "page_first", 1, use_triton=True)
    assert torch.equal(dk[0], ref_k[0]) and torch.equal(dv[0], ref_v[0])


def test_kernel_module_is_interpreted():
    assert type(triton_transfer._copy_pages_kernel).__name__ == "InterpretedFunction"
