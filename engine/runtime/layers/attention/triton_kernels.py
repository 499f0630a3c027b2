"""Triton attention kernels over a paged KV pool addressed through ``req_to_token``.

    decode:  one program per (request, query head); loops over the request's KV in blocks of
             BLOCK_N slots (gathered through req_to_token), online softmax, fp32 accumulation.
    extend:  one program per (request, query head, block of BLOCK_M new tokens); loops over the
             prefix + new keys up to the block's last causal position, online softmax, causal
             mask ``key_pos <= prefix_len + i`` for new token i.

GQA: query head h reads kv head ``h // (heads // kv_heads)``. K/V are read in the pool dtype and
cast to the query dtype; scores, softmax and the output accumulator are fp32.

NOTE: ``TRITON_INTERPRET`` is read when the kernels are decorated (this module's import); the
CPU tests set it first and reload this module.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# NOTE: own combine functions with ``tl.reduce`` instead of ``tl.max`` / ``tl.sum``: those are
# @jit functions of triton.language.standard, decorated when triton is first imported, so they
# do not run under the interpreter when TRITON_INTERPRET is set only afterwards (as in tests).
@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_fn(a, b):
    return a + b


@triton.jit
def _decode_kernel(
    Q,  # [bs, heads, head_dim]
    K_Buf,  # [num_slots, kv_heads, head_dim]
    V_Buf,  # [num_slots, kv_heads, head_dim]
    Out,  # [bs, heads, head_dim]
    Req_to_token,  # [rows, max_context_len] int32
    Req_pool_indices,  # [bs] int64
    Seq_lens,  # [bs] int64
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_rt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    seq_len = tl.load(Seq_lens + b)
    row = tl.load(Req_pool_indices + b)

    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=mask_d, other=0.0)
    q = q.to(tl.float32)  # [BLOCK_D]

    m_i = float("-inf")
    l_i = 0.0
    acc = tl.full([BLOCK_D], 0.0, dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start in range(0, seq_len, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        mask_n = pos < seq_len
        slots = tl.load(Req_to_token + row * stride_rt + pos, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_Buf + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        qk = tl.reduce(q[None, :] * k, 1, _sum_fn) * sm_scale  # [BLOCK_N]
        qk = tl.where(mask_n, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(qk, 0, _max_fn))  # finite: the block has a valid key
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new)  # [BLOCK_N]
        v = tl.load(
            V_Buf + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha + tl.reduce(p[:, None] * v, 0, _sum_fn)
        l_i = l_i * alpha + tl.reduce(p, 0, _sum_fn)
        m_i = m_new
    out = acc / l_i
    tl.store(
        Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=mask_d
    )


@triton.jit
def _extend_kernel(
    Q,  # [num_tokens, heads, head_dim]
    K_Buf,  # [num_slots, kv_heads, head_dim]
    V_Buf,  # [num_slots, kv_heads, head_dim]
    Out,  # [num_tokens, heads, head_dim]
    Req_to_token,  # [rows, max_context_len] int32
    Req_pool_indices,  # [bs] int64
    Prefix_lens,  # [bs] int64
    Extend_lens,  # [bs] int64
    Extend_starts,  # [bs] int64: first flat token of each request
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_rt,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    kvh = h // GROUP
    ext_len = tl.load(Extend_lens + b)
    if mblk * BLOCK_M >= ext_len:
        return
    prefix_len = tl.load(Prefix_lens + b)
    t0 = tl.load(Extend_starts + b)
    row = tl.load(Req_pool_indices + b)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] index among new tokens
    mask_m = offs_m < ext_len
    q_pos = prefix_len + offs_m  # [BLOCK_M] absolute positions
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + (t0 + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # keys past the block's last query position are masked for every row: stop there
    kv_end = prefix_len + tl.minimum(ext_len, (mblk + 1) * BLOCK_M)
    for start in range(0, kv_end, BLOCK_N):
        pos = start + offs_n  # [BLOCK_N]
        mask_n = pos < kv_end
        slots = tl.load(Req_to_token + row * stride_rt + pos, mask=mask_n, other=0).to(tl.int64)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            K_Buf + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale  # [BLOCK_M, BLOCK_N]
        causal = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        qk = tl.where(causal, qk, float("-inf"))
        # key 0 is visible to every row, so m_i is finite after the first block
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, _max_fn))  # [BLOCK_M]
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        v = tl.load(
            V_Buf + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_fn)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        Out + (t0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    block_n: int = 32,
) -> torch.Tensor:
    """q [bs, heads, head_dim]; k_buf, v_buf [num_slots, kv_heads, head_dim] -> [bs, heads, head_dim]."""
    bs, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    assert heads % kv_heads == 0 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    q = q.contiguous()
    out = torch.empty_like(q)
    if bs == 0:
        return out
    _decode_kernel[(bs, heads)](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        HEAD_DIM=head_dim,
        GROUP=heads // kv_heads,
        BLOCK_D=_block_d(head_dim),
        BLOCK_N=block_n,
    )
    return out


def extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int = 16,
    block_n: int = 32,
) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] (requests' new tokens concatenated); the new tokens' K/V
    must already be in the pool -> [num_tokens, heads, head_dim]."""
    num_tokens, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    bs = req_pool_indices.shape[0]
    assert heads % kv_heads == 0 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (bs, heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buf,
        v_buf,
        out,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_lens,
        extend_starts,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        HEAD_DIM=head_dim,
        GROUP=heads // kv_heads,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=precision,
    )
    return out
