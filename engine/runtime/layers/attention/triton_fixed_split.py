"""Triton attention with fixed KV split sizes (deterministic inference): every query reduces its
keys in the same fixed chunks, so its output is the same bits in any batch and any mode.

A request's keys are cut at absolute positions into chunks of ``split`` keys (SGLang's
deterministic split tile, 256; a multiple of BLOCK_N), each chunk into blocks of BLOCK_N:

    keys       0 ......... S-1 | S ........ 2S-1 | 2S ..... pos      (pos: the query's position)
    chunk      0               | 1               | 2 (the last one: up to pos)
    per chunk  online softmax over its blocks, from a fresh state -> partial (m, l, acc), fp32
    merged     partials in chunk order 0, 1, 2, ... -> acc / l

So a query's output depends on its q and on keys 0..pos only, never on
- whether those keys were written in this forward (EXTEND) or read from the cache (a prefix),
- how many new tokens shared its forward (chunked prefill sizes), nor which other requests did,
- whether it is a DECODE step's one query or a token of an EXTEND.

    extend   one program per (request, head, BLOCK_M new tokens): the chunks in order, each
             merged as it completes
    decode   stage 1: one program per (request, kv head, chunk): that chunk's partial for the
             kv head's GROUP query heads (the rows of one tile); stage 2: one program per
             (request, head) merges the partials in chunk order. The chunk count comes from the
             request's own length; the grid's chunk axis is the table width / split, fixed, so
             a captured CUDA graph replays it for any lengths.

NOTE: bitwise equality of the two paths rests on the same arithmetic per element: both run
``_block_step`` with the same tile shape ([BLOCK_M, BLOCK_D] x [BLOCK_D, BLOCK_N]: a row's dot
product depends neither on the tile's other rows nor on its place among them, ``tile_dot``) and
``_merge``; keys a row cannot see add
exact zeros, and a block or chunk a row sees nothing of leaves its state unchanged (the NO_KEY
floor keeps ``exp`` away from ``-inf - -inf``).

GQA: query head h reads kv head ``h // GROUP``. K/V are cast to q's dtype; scores, softmax and
accumulators are fp32. NOTE: ``TRITON_INTERPRET`` is read at this module's import (see
tests/triton_interpreter.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.runtime.layers.tile_dot import tile_dot

SPLIT_SIZE = 256  # keys per chunk
BLOCK_M = 16
BLOCK_N = 32
# the running max of a row that has seen no key yet: finite, see the NOTE above
NO_KEY: tl.constexpr = tl.constexpr(-1.0e20)


# NOTE: triton's own combine functions, as in batch_invariant.py (the interpreter reduces with
# numpy when it sees them; tl.sum / tl.max would not run under an interpreter turned on late)
_SUM = tl.standard._sum_combine
_MAX = tl.standard._elementwise_max


@triton.jit
def _block_step(q, k, v, visible, m_i, l_i, acc, sm_scale, DOT_PRECISION: tl.constexpr):
    """Keys ``k``/``v`` [BLOCK_N, BLOCK_D] into each q row's running (m_i, l_i, acc)."""
    # NOTE: a zero acc is what tl.dot(a, b) starts from when given none: the same MMA
    zero_s = tl.full([q.shape[0], k.shape[0]], 0.0, dtype=tl.float32)  # [BLOCK_M, BLOCK_N]
    qk = tile_dot(q, tl.trans(k), zero_s, DOT_PRECISION) * sm_scale  # [BLOCK_M, BLOCK_N]
    qk = tl.where(visible, qk, float("-inf"))
    row_max = tl.reduce(qk, 1, _MAX)
    m_new = tl.maximum(m_i, tl.where(row_max == float("-inf"), NO_KEY, row_max))  # [BLOCK_M]
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    pv = tile_dot(p.to(v.dtype), v, tl.full(acc.shape, 0.0, dtype=tl.float32), DOT_PRECISION)
    acc = acc * alpha[:, None] + pv
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    return m_new, l_i, acc


@triton.jit
def _merge(m_run, l_run, acc_run, m_c, l_c, acc_c):
    """Chunk partial (m_c, l_c, acc_c) into the running merge; m [R], l [R], acc [R, BLOCK_D]."""
    m_new = tl.maximum(m_run, m_c)
    a = tl.exp(m_run - m_new)
    b = tl.exp(m_c - m_new)
    return m_new, l_run * a + l_c * b, acc_run * a[:, None] + acc_c * b[:, None]


@triton.jit
def _load_kv(
    K_Buf,
    V_Buf,
    Req_to_token,
    row,
    pos,
    in_range,
    kvh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    offs_d,
    mask_d,
):
    """The keys / values at positions ``pos`` [BLOCK_N] of request row ``row``."""
    slots = tl.load(Req_to_token + row * stride_rt + pos, mask=in_range, other=0).to(tl.int64)
    kv_mask = in_range[:, None] & mask_d[None, :]
    k = tl.load(
        K_Buf + slots[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    v = tl.load(
        V_Buf + slots[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )
    return k, v  # [BLOCK_N, BLOCK_D] each, in the pool's dtype


@triton.jit
def _extend_kernel(
    Q,
    K_Buf,
    V_Buf,
    Out,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_starts,
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
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
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
    )
    offs_n = tl.arange(0, BLOCK_N)
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_run = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc_run = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    kv_end = prefix_len + tl.minimum(ext_len, (mblk + 1) * BLOCK_M)  # past the block's last query
    for c_start in range(0, kv_end, SPLIT):
        c_end = tl.minimum(c_start + SPLIT, kv_end)
        m_c = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_c = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc_c = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
        for start in range(c_start, c_end, BLOCK_N):
            pos = start + offs_n  # [BLOCK_N]
            in_range = pos < c_end
            k, v = _load_kv(
                K_Buf,
                V_Buf,
                Req_to_token,
                row,
                pos,
                in_range,
                h // GROUP,
                stride_kn,
                stride_kh,
                stride_vn,
                stride_vh,
                stride_rt,
                offs_d,
                mask_d,
            )
            visible = (pos[None, :] <= q_pos[:, None]) & in_range[None, :]
            m_c, l_c, acc_c = _block_step(
                q, k.to(q.dtype), v.to(q.dtype), visible, m_c, l_c, acc_c, sm_scale, DOT_PRECISION
            )
        m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_c, l_c, acc_c)
    out = acc_run / l_run[:, None]
    tl.store(
        Out + (t0 + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@triton.jit
def _decode_split_kernel(
    Q,
    K_Buf,
    V_Buf,
    Mid_O,
    Mid_M,
    Mid_L,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_rt,
    stride_mob,
    stride_moh,
    stride_moc,
    stride_mb,
    stride_mh,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // HEAD_BLOCKS
    hblk = tl.program_id(1) % HEAD_BLOCKS
    c = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b)
    c_start = c * SPLIT
    if c_start >= seq_len:
        return
    row = tl.load(Req_pool_indices + b)
    g = hblk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query heads of kv head kvh, as rows
    mask_m = g < GROUP
    heads = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    offs_n = tl.arange(0, BLOCK_N)
    m_c = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_c = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    acc_c = tl.full([BLOCK_M, BLOCK_D], 0.0, dtype=tl.float32)
    c_end = tl.minimum(c_start + SPLIT, seq_len)
    for start in range(c_start, c_end, BLOCK_N):
        pos = start + offs_n
        in_range = pos < c_end
        k, v = _load_kv(
            K_Buf,
            V_Buf,
            Req_to_token,
            row,
            pos,
            in_range,
            kvh,
            stride_kn,
            stride_kh,
            stride_vn,
            stride_vh,
            stride_rt,
            offs_d,
            mask_d,
        )
        visible = in_range[None, :]  # [1, BLOCK_N]: the one query sees every key < seq_len
        m_c, l_c, acc_c = _block_step(
            q, k.to(q.dtype), v.to(q.dtype), visible, m_c, l_c, acc_c, sm_scale, DOT_PRECISION
        )
    mid = b * stride_mob + heads * stride_moh + c * stride_moc  # [BLOCK_M]
    tl.store(Mid_O + mid[:, None] + offs_d[None, :], acc_c, mask=mask_m[:, None] & mask_d[None, :])
    ml = b * stride_mb + heads * stride_mh + c
    tl.store(Mid_M + ml, m_c, mask=mask_m)
    tl.store(Mid_L + ml, l_c, mask=mask_m)


@triton.jit
def _decode_merge_kernel(
    Mid_O,
    Mid_M,
    Mid_L,
    Out,
    Seq_lens,
    stride_mob,
    stride_moh,
    stride_moc,
    stride_mb,
    stride_mh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b)
    one = tl.arange(0, 1)  # a row of one: the same _merge shapes as extend's [BLOCK_M] rows
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    m_run = tl.full([1], float("-inf"), dtype=tl.float32)
    l_run = tl.full([1], 0.0, dtype=tl.float32)
    acc_run = tl.full([1, BLOCK_D], 0.0, dtype=tl.float32)
    for c in range((seq_len + SPLIT - 1) // SPLIT):
        ml = b * stride_mb + h * stride_mh + c + one  # [1]
        m_c = tl.load(Mid_M + ml)
        l_c = tl.load(Mid_L + ml)
        mid = b * stride_mob + h * stride_moh + c * stride_moc + one
        acc_c = tl.load(Mid_O + mid[:, None] + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m_c, l_c, acc_c)
    out = acc_run / l_run[:, None]  # [1, BLOCK_D]
    tl.store(
        Out + b * stride_ob + h * stride_oh + one[:, None] + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=mask_d[None, :],
    )


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, split: int) -> None:
    assert q.shape[1] % k_buf.shape[1] == 0 and k_buf.stride(2) == 1 and v_buf.stride(2) == 1
    if split <= 0 or split % BLOCK_N:
        raise ValueError(f"split size {split} must be a positive multiple of {BLOCK_N}")


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
    split: int = SPLIT_SIZE,
) -> torch.Tensor:
    """q [num_tokens, heads, head_dim] (requests' new tokens concatenated; their K/V already in
    the pool), k_buf / v_buf [num_slots, kv_heads, head_dim] -> [num_tokens, heads, head_dim]."""
    _check(q, k_buf, v_buf, split)
    num_tokens, heads, head_dim = q.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    grid = (req_pool_indices.shape[0], heads, triton.cdiv(max_extend_len, BLOCK_M))
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
        GROUP=heads // k_buf.shape[1],
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        SPLIT=split,
        DOT_PRECISION=_precision(q.dtype),
    )
    return out


def decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    split: int = SPLIT_SIZE,
) -> torch.Tensor:
    """q [bs, heads, head_dim]; k_buf / v_buf [num_slots, kv_heads, head_dim] -> [bs, heads,
    head_dim]. The partials take ``[bs, heads, table width / split, head_dim + 2]`` fp32."""
    _check(q, k_buf, v_buf, split)
    bs, heads, head_dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    q = q.contiguous()
    out = torch.empty_like(q)
    if bs == 0:
        return out
    max_splits = triton.cdiv(req_to_token.shape[1], split)  # static: no look at seq_lens
    mid_o = torch.empty(bs, heads, max_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_m = torch.empty(bs, heads, max_splits, dtype=torch.float32, device=q.device)
    mid_l = torch.empty_like(mid_m)
    head_blocks = triton.cdiv(group, BLOCK_M)
    _decode_split_kernel[(bs, kv_heads * head_blocks, max_splits)](
        q,
        k_buf,
        v_buf,
        mid_o,
        mid_m,
        mid_l,
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
        req_to_token.stride(0),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_m.stride(0),
        mid_m.stride(1),
        HEAD_DIM=head_dim,
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        BLOCK_D=_block_d(head_dim),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        SPLIT=split,
        DOT_PRECISION=_precision(q.dtype),
    )
    _decode_merge_kernel[(bs, heads)](
        mid_o,
        mid_m,
        mid_l,
        out,
        seq_lens,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_m.stride(0),
        mid_m.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=_block_d(head_dim),
        SPLIT=split,
    )
    return out
