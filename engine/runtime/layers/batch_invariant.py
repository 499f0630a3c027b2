"""Batch-invariant ops (deterministic inference on CUDA): a row's result never depends on how
many rows share the call, nor on where the row sits among them.

torch's CUDA kernels do not promise this: cuBLAS picks a GEMM's tiling and split-K by the row
count M, so each output is summed over k in an order that changes with the batch, and torch's
row scans lay rows out by the row count ("Defeating Nondeterminism in LLM Inference", Thinking
Machines 2025; SGLang's and vLLM's deterministic modes replace the same ops). Here each op fixes
its reduction order by the row's own length:

    linear    ``x @ weight.T + bias``: one tile config per dtype for every M (BLOCK_M x BLOCK_N
              outputs per program), each output reduced over k in ascending BLOCK_K steps into
              an fp32 accumulator by one program; no split-K
    rms_norm  one program per row, the whole row in one block; the residual add fused
    softmax   one program per row over fixed BLOCK chunks: max, sum of exp, normalise (fp32)
    cumsum    one program per row: a scan per BLOCK chunk plus the running total (fp32)

NOTE: a row's dot products do not depend on the tile's other rows nor on its place among them
(``tile_dot``: true of tensor-core MMAs; under the interpreter the product is written so), so one
config for every M is what makes ``linear`` invariant.

Runs wherever Triton does; the engine uses it on CUDA only (engine/runtime/deterministic.py).
NOTE: ``TRITON_INTERPRET`` is read when the kernels are decorated (this module's import); the
CPU tests set it first and reload this module (tests/triton_interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.runtime.layers.tile_dot import tile_dot

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per activation dtype: fixed, never by M
LINEAR_CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int]] = {
    torch.float32: (64, 64, 32, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.bfloat16: (64, 128, 64, 4, 3),
}
ROW_BLOCK = 1024  # softmax / cumsum chunk (elements)


# NOTE: tl.reduce / tl.associative_scan with triton's own combine functions instead of tl.sum /
# tl.max / tl.cumsum: those are @jit functions decorated when triton is first imported, so they
# do not run under an interpreter turned on only afterwards (the CPU tests), while the
# interpreter recognises these combine functions and reduces with numpy (not one Python call
# per element).
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def _linear_kernel(
    X,  # [M, K], row stride stride_xm, unit column stride
    W,  # [N, K], row stride stride_wn, unit column stride
    Bias,  # [N] (read only when HAS_BIAS)
    Y,  # [M, N], row stride stride_ym
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_m.to(tl.int64)
    cols = offs_n.to(tl.int64)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < K
        x = tl.load(
            X + rows[:, None] * stride_xm + kk[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(
            W + cols[None, :] * stride_wn + kk[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        acc = tile_dot(x, w, acc, DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(Bias + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Y + rows[:, None] * stride_ym + cols[None, :],
        acc.to(Y.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _rms_norm_kernel(
    X,  # [rows, H]
    R,  # [rows, H] residual (read only when HAS_RESIDUAL)
    W,  # [H]
    Y,  # [rows, H] normed
    S,  # [rows, H] x + residual (written only when HAS_RESIDUAL)
    H,
    eps,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    HAS_RESIDUAL: tl.constexpr,
    ROUND_BEFORE_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # rounded to the stream's dtype before the norm reads it, as torch's x + residual is
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(S + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.reduce(xf * xf, 0, _SUM) / H + eps)
    y = xf * rstd
    if ROUND_BEFORE_WEIGHT:  # fp16/bf16: normed in fp32, rounded, then scaled (norm.py)
        y = y.to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (y * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_kernel(X, Y, N, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m_vec = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(X + row * stride_x + start + offs, mask=start + offs < N, other=float("-inf"))
        m_vec = tl.maximum(m_vec, x.to(tl.float32))
    m = tl.reduce(m_vec, 0, _MAX)
    s_vec = tl.full([BLOCK], 0.0, dtype=tl.float32)
    for start in range(0, N, BLOCK):
        x = tl.load(X + row * stride_x + start + offs, mask=start + offs < N, other=float("-inf"))
        s_vec += tl.exp(x.to(tl.float32) - m)
    s = tl.reduce(s_vec, 0, _SUM)
    for start in range(0, N, BLOCK):
        mask = start + offs < N
        x = tl.load(X + row * stride_x + start + offs, mask=mask, other=float("-inf"))
        tl.store(Y + row * stride_y + start + offs, tl.exp(x.to(tl.float32) - m) / s, mask=mask)


@triton.jit
def _cumsum_kernel(X, Y, N, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    carry = 0.0
    for start in range(0, N, BLOCK):
        mask = start + offs < N
        x = tl.load(X + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        scan = tl.associative_scan(x, 0, _SUM) + carry
        tl.store(Y + row * stride_y + start + offs, scan, mask=mask)
        carry = tl.reduce(tl.where(offs == BLOCK - 1, scan, 0.0), 0, _SUM)  # the last sum


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose rows are invariant to the row count.
    x [..., K]; weight [N, K] (HF layout); bias [N] -> [..., N] in x's dtype."""
    if x.dtype != weight.dtype or x.dtype not in LINEAR_CONFIGS:
        raise ValueError(
            f"linear: x {x.dtype} and weight {weight.dtype} must be one of {list(LINEAR_CONFIGS)}"
        )
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()  # [M, K]
    w = weight.contiguous()
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m > 0:
        bm, bn, bk, warps, stages = LINEAR_CONFIGS[x.dtype]
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _linear_kernel[grid](
            x2,
            w,
            bias if bias is not None else w,
            y,
            m,
            n,
            k,
            x2.stride(0),
            w.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=warps,
            num_stages=stages,
        )
    return y.view(*x.shape[:-1], n)


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm.forward's contract (norm.py) one row per program: ``norm(x)``, or with a residual
    ``(norm(x + residual), x + residual)``. x, residual [..., H]; weight [H]."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()  # [rows, H]
    r2 = residual.reshape(-1, h).contiguous() if residual is not None else x2
    out = torch.empty_like(x2)
    summed = torch.empty_like(x2) if residual is not None else out
    rows = x2.shape[0]
    if rows > 0:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            summed,
            h,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            summed.stride(0),
            HAS_RESIDUAL=residual is not None,
            ROUND_BEFORE_WEIGHT=x.dtype != torch.float32,
            BLOCK=block,
            num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16,
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), summed.view(x.shape)


def _rows_op(kernel: triton.JITFunction, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()  # [rows, N]
    y = torch.empty(x2.shape, dtype=torch.float32, device=x.device)
    if x2.numel() > 0:
        kernel[(x2.shape[0],)](x2, y, x2.shape[1], x2.stride(0), y.stride(0), BLOCK=ROW_BLOCK)
    return y.view(x.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(x.float(), dim=-1)`` one row per program; fp32 [..., N]."""
    return _rows_op(_softmax_kernel, x)


def cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.float().cumsum(-1)`` one row per program; fp32 [..., N]."""
    return _rows_op(_cumsum_kernel, x)
