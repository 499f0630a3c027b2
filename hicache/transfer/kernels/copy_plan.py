"""Copy plans: how rows ``src[src_idx] -> dst[dst_idx]`` (along dim 0) are copied on CPU.

A ``CopyPlan`` is built once from the indices and applied to every (src, dst) pair sharing them
(every K / V layer of a transfer):

    few long joint runs (>= RUN_BYTES each on average)  ->  one slice copy_ per run
    destination rows consecutive                        ->  index_select(out=dst slice), 1 pass
    source rows consecutive                             ->  index_copy_ of the source slice
    neither                                             ->  index_select into a buffer, then
                                                            index_copy_ (the buffer stays hot)

index_select on dim 0 of row-contiguous tensors is one memcpy per row; index_copy_ copies
element by element, so it runs on the rows viewed as the widest dtype that divides them
(complex128: 16-byte moves of bits, never arithmetic). Every path is a byte copy: bit-exact,
NaN payloads included.

A negative index on either side skips that row. Used by ``transfer`` (the torch path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Mean bytes per joint run (one layer, K or V) from which runs are copied as slices: one copy_
# call costs several microseconds; measured break-even 32..64 KiB (768-byte and 12 KiB rows).
RUN_BYTES = 48 << 10
# Index pairs up to which plans are made on Python lists (cheaper than a chain of tiny ops).
SMALL_PLAN = 64
_WIDE_DTYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def _drop_negative(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = (src >= 0) & (dst >= 0)
    if bool(keep.all()):
        return src, dst
    return src[keep], dst[keep]


class CopyPlan(NamedTuple):
    """``dst[dst_idx[i]] = src[src_idx[i]]`` along dim 0, and how: see the module docstring."""

    rows: int  # m: rows copied (negative pairs dropped)
    runs: list[tuple[int, int, int]] | None  # (src_start, dst_start, rows) when copied as slices
    src_idx: torch.Tensor | None  # [m] int64 row ids on CPU; None when copied as slices
    dst_idx: torch.Tensor | None  # [m] int64 row ids on CPU
    src_start: int | None  # src rows are src_start .. src_start + m - 1
    dst_start: int | None  # dst rows are dst_start .. dst_start + m - 1


def _list_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst):
        if a < 0 or b < 0:
            continue
        if runs:
            s, d, n = runs[-1]
            if s + n == a and d + n == b:
                runs[-1] = (s, d, n + 1)
                continue
        runs.append((a, b, 1))
    return runs


def _use_runs(num_runs: int, rows: int, row_bytes: int, run_bytes: int | None) -> bool:
    run_bytes = RUN_BYTES if run_bytes is None else run_bytes
    return num_runs <= 1 or num_runs * run_bytes <= rows * row_bytes


def plan_lists(
    src: list[int], dst: list[int], row_bytes: int, run_bytes: int | None = None
) -> CopyPlan:
    """``plan_copy`` on Python lists (for a few indices)."""
    runs = _list_runs(src, dst)
    m = sum(n for _, _, n in runs)
    if _use_runs(len(runs), m, row_bytes, run_bytes):
        return CopyPlan(m, runs, None, None, None, None)
    src = [a + i for a, _, n in runs for i in range(n)]
    dst = [b + i for _, b, n in runs for i in range(n)]
    return CopyPlan(
        m,
        None,
        torch.tensor(src, dtype=torch.int64),
        torch.tensor(dst, dtype=torch.int64),
        _run_start(runs, 0),
        _run_start(runs, 1),
    )


def _run_start(runs: list[tuple[int, int, int]], side: int) -> int | None:
    """First row of ``side`` (0 src, 1 dst) when the runs continue each other there."""
    pos = runs[0][side]
    for run in runs:
        if run[side] != pos:
            return None
        pos += run[2]
    return runs[0][side]


def plan_copy(
    src_idx: torch.Tensor, dst_idx: torch.Tensor, row_bytes: int, run_bytes: int | None = None
) -> CopyPlan:
    """Plan copying rows ``src_idx`` -> ``dst_idx`` (int64, negatives skipped) of ``row_bytes``
    each: slice copies when there is one joint run, or the runs average at least ``run_bytes``
    (default RUN_BYTES)."""
    assert src_idx.numel() == dst_idx.numel(), "index tensors differ in length"
    if src_idx.numel() <= SMALL_PLAN:
        return plan_lists(src_idx.tolist(), dst_idx.tolist(), row_bytes, run_bytes)
    src_idx, dst_idx = _drop_negative(src_idx.cpu(), dst_idx.cpu())
    m = src_idx.numel()
    if m <= 1:
        return plan_lists(src_idx.tolist(), dst_idx.tolist(), row_bytes, run_bytes)
    src_step = (src_idx[1:] - src_idx[:-1]) == 1  # [m - 1] bool
    dst_step = (dst_idx[1:] - dst_idx[:-1]) == 1
    breaks = torch.nonzero(~(src_step & dst_step)).flatten()
    if _use_runs(breaks.numel() + 1, m, row_bytes, run_bytes):
        starts = [0] + (breaks + 1).tolist()
        ends = starts[1:] + [m]
        s, d = src_idx[starts].tolist(), dst_idx[starts].tolist()
        runs = [(a, b, e - i) for a, b, i, e in zip(s, d, starts, ends)]
        return CopyPlan(m, runs, None, None, None, None)
    src_start = int(src_idx[0]) if bool(src_step.all()) else None
    dst_start = int(dst_idx[0]) if bool(dst_step.all()) else None
    return CopyPlan(m, None, src_idx, dst_idx, src_start, dst_start)


def merge_runs(src_p: torch.Tensor, dst_p: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both page ids step by +1; negatives dropped."""
    runs = plan_copy(src_p, dst_p, row_bytes=1, run_bytes=0).runs
    assert runs is not None
    return runs


def wide_views(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors viewed as the widest dtype their (unit-stride) last dims divide into, so that
    element-wise index kernels move 16 bytes per element. Bits are moved, never converted."""
    itemsize = tensors[0].element_size()
    for width, dtype in _WIDE_DTYPES:
        if width <= itemsize:
            break
        if all(
            t.stride(-1) == 1
            and t.shape[-1] * itemsize % width == 0
            and t.data_ptr() % width == 0
            and all(s * itemsize % width == 0 for s in t.stride()[:-1])
            for t in tensors
        ):
            return tuple(t.view(dtype) for t in tensors)
    return tensors


def index_copy(dst: torch.Tensor, dst_idx: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[dst_idx] = rows`` along dim 0 (same device), 16 bytes per element where possible.

    NOTE: numpy's fancy assignment of opaque row items (one memcpy per row) was measured ~15%
    faster on one thread but slower on two, where index_copy_ runs in parallel; kept torch."""
    dst_w, rows_w = wide_views(dst, rows)
    dst_w.index_copy_(0, dst_idx, rows_w)


def copy_rows(
    src: torch.Tensor, dst: torch.Tensor, plan: CopyPlan, buf: torch.Tensor | None = None
) -> None:
    """Apply ``plan`` to ``src`` / ``dst`` ``[rows, ...]`` (same row shape and dtype); ``buf``:
    an optional ``[m, ...]`` scratch tensor on src's device for the two-pass case."""
    if plan.runs is not None:
        for s, d, n in plan.runs:
            dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
        return
    assert plan.src_idx is not None and plan.dst_idx is not None
    m = plan.rows
    if src.device != dst.device:  # e.g. the torch path between a CUDA pool and host memory
        rows = src.index_select(0, plan.src_idx.to(src.device))
        dst.index_copy_(0, plan.dst_idx.to(dst.device), rows.to(dst.device, non_blocking=True))
    elif plan.dst_start is not None:
        d = plan.dst_start
        if d + m > dst.shape[0]:  # out= would resize the view, i.e. the whole pool's storage
            raise IndexError(f"destination rows {d}..{d + m - 1} out of range {dst.shape[0]}")
        torch.index_select(src, 0, plan.src_idx.to(src.device), out=dst[d : d + m])
    else:
        if plan.src_start is not None:
            rows = src[plan.src_start : plan.src_start + m]
        else:
            idx = plan.src_idx.to(src.device)
            rows = (
                src.index_select(0, idx)
                if buf is None
                else torch.index_select(src, 0, idx, out=buf)
            )
        index_copy(dst, plan.dst_idx.to(dst.device), rows)


def scratch(plan: CopyPlan, like: torch.Tensor) -> torch.Tensor | None:
    """A ``[m, ...]`` buffer for ``copy_rows`` when the plan needs the two-pass case."""
    if plan.runs is not None or plan.src_start is not None or plan.dst_start is not None:
        return None
    return torch.empty((plan.rows, *like.shape[1:]), dtype=like.dtype, device=like.device)
