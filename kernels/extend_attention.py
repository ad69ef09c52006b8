"""Triton extend (prefill) attention over the paged KV cache (see reference.extend_attention_ref).

Variable-length, causal, GQA-aware flash attention. Each program owns one KV head and a tile of
BLOCK_M query rows; a row is one (new token, query head of the group) pair, so a K/V tile loaded
from the cache serves every query head that shares it. New tokens of sequence b sit at positions
seq_lens[b] - q_len ... seq_lens[b] - 1, so prefix-cache hits and chunked-prefill chunks (queries
that start mid-sequence) need nothing special. Online softmax in base 2, fp32 accumulation;
int8/fp8 caches are dequantised in the kernel by folding the per-token scales into the scores
(K) and into the probabilities (V).

Programs are laid out without reading any metadata on the host: sequence b owns the program slots
[cu_q[b] // T + b, cu_q[b + 1] // T + b + 1) (T query tokens per tile), enough for its
ceil(q_len / T) tiles; a program finds its sequence by binary search and surplus slots exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    as_int32_rows,
    check_cache,
    dot_operands,
    interpreting,
    last_dim_contiguous,
    next_pow2,
    scale_strides,
)
from ._paged import kv_tile_offsets

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    pos,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_row_ptr,
    start,
    kv_end,
    d,
    dmask,
    qk_scale,
    window,
    s_cb,
    s_co,
    ss_b,
    ss_o,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    n = start + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    kv_off, sc_off = kv_tile_offsets(bt_row_ptr, n, n_mask, BLOCK_SIZE, s_cb, s_co, ss_b, ss_o, QUANT)
    kt = tl.load(k_ptr + kv_off[None, :] + d[:, None], mask=n_mask[None, :] & dmask[:, None], other=0.0)
    s = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if QUANT != 0:
        k_sc = tl.load(ks_ptr + sc_off, mask=n_mask, other=0.0)
        s = s * (k_sc * qk_scale)[None, :]
    else:
        s = s * qk_scale
    if CAUSAL:
        s = tl.where((n[None, :] <= pos[:, None]) & n_mask[None, :], s, float("-inf"))
    if WINDOWED:  # a sliding-window layer: keys older than `window` positions are out of sight
        s = tl.where(n[None, :] > pos[:, None] - window, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=n_mask[:, None] & dmask[None, :], other=0.0)
    if QUANT != 0:
        v_sc = tl.load(vs_ptr + sc_off, mask=n_mask, other=0.0)
        p = p * v_sc[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    o_ptr,
    bt_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    qk_scale,
    batch,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    s_cb,
    s_co,
    s_ch,
    ss_b,
    ss_o,
    ss_h,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    slot_id = tl.program_id(0)
    kvh = tl.program_id(1)

    # Which sequence owns this slot: the last b with cu_q[b] // TOKENS + b <= slot_id.
    lo = slot_id * 0  # int32 tensors from the start (batch == 1 arrives as a constant)
    hi = lo + (batch - 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_q_ptr + mid) // TOKENS + mid <= slot_id:
            lo = mid
        else:
            hi = mid - 1
    b = lo
    q_start = tl.load(cu_q_ptr + b)
    q_end = tl.load(cu_q_ptr + b + 1)
    q_len = q_end - q_start
    first_slot = q_start // TOKENS + b
    n_slots = q_end // TOKENS - q_start // TOKENS + 1
    # Hand out the last (most expensive, causally) tiles first.
    tok0 = (n_slots - 1 - (slot_id - first_slot)) * TOKENS
    if (slot_id < first_slot) | (tok0 < 0) | (tok0 >= q_len):
        return

    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len  # cached tokens before the first new one

    r = tl.arange(0, BLOCK_M)
    t = r // GROUP
    g = r % GROUP
    tok = tok0 + t
    row_mask = (t < TOKENS) & (tok < q_len)
    pos = ctx + tok
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    head = kvh * GROUP + g
    row = (q_start + tok).to(tl.int64)

    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_mask[:, None] & dmask[None, :],
        other=0.0,
    ).to(DOT)

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh * s_ch
    v_head = v_ptr + kvh * s_ch
    ks_head = ks_ptr + kvh * ss_h
    vs_head = vs_ptr + kvh * ss_h

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    last_tok = tl.minimum(tok0 + TOKENS, q_len) - 1
    kv_end = ctx + last_tok + 1  # one past the last position any row of the tile may see
    full_end = ((ctx + tok0 + 1) // BLOCK_N) * BLOCK_N  # keys below this are visible to every row
    kv_lo = full_end * 0
    if WINDOWED:  # no row sees keys before the first row's window
        kv_lo = (tl.maximum(ctx + tok0 - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start in range(kv_lo, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_head,
            v_head,
            ks_head,
            vs_head,
            bt_row_ptr,
            start,
            kv_end,
            d,
            dmask,
            qk_scale,
            window,
            s_cb,
            s_co,
            ss_b,
            ss_o,
            BLOCK_N,
            BLOCK_SIZE,
            QUANT,
            False,
            PRECISION,
            WINDOWED,
        )
    for start in range(tl.maximum(full_end, kv_lo), kv_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc,
            l_i,
            m_i,
            q,
            pos,
            k_head,
            v_head,
            ks_head,
            vs_head,
            bt_row_ptr,
            start,
            kv_end,
            d,
            dmask,
            qk_scale,
            window,
            s_cb,
            s_co,
            ss_b,
            ss_o,
            BLOCK_N,
            BLOCK_SIZE,
            QUANT,
            True,
            PRECISION,
            WINDOWED,
        )

    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dmask[None, :],
    )


def extend_config(head_dim: int, dtype: torch.dtype) -> dict:
    """The default launch configuration (block_m, block_n, num_warps, num_stages) for a shape.

    16-bit up to d128: the fastest of `bench.py --sweep`'s 24 on an H200 (Triton 3.6, a 4096-token
    causal prefill, docs/gpu/), on two machines: d64 1.11x and d128 1.16x the earlier guess
    (block_m 128, 8 warps). Larger heads and fp32 stay untuned guesses."""
    if interpreting():  # few, large programs: the interpreter pays per op, not per element
        return dict(block_m=128, block_n=64, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # IEEE fp32 dots run on FMA units and are register hungry
        return dict(block_m=32, block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 64:
        return dict(block_m=64, block_n=64, num_warps=4, num_stages=3)
    if head_dim <= 128:
        return dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    return dict(block_m=64, block_n=32, num_warps=4, num_stages=2)


def extend_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    cu_seqlens_q,
    seq_lens,
    sm_scale,
    k_scale=None,
    v_scale=None,
    window=0,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens q [T, Hq, D] over its whole cached context
    (window > 0: a sliding-window layer, each token sees the `window` positions ending at its own).

    block_m (query rows per program: new tokens x query heads of a group; a power of two >= 16),
    block_n (keys per step, a power of two >= 16), num_warps and num_stages override the tuned
    launch configuration (tests use small tiles to exercise the multi-tile paths)."""
    kind = check_cache(k_cache, v_cache, k_scale, v_scale)
    num_tokens, hq, d = q.shape
    _, block_size, hkv, dc = k_cache.shape
    if dc != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    batch = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1 or block_tables.shape[0] < batch:
        raise ValueError("cu_seqlens_q needs batch + 1 entries and block_tables a row per sequence")
    out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    q = last_dim_contiguous(q)
    group = hq // hkv
    cfg = extend_config(d, q.dtype)
    bm = block_m or cfg["block_m"]
    bn = block_n or cfg["block_n"]
    if bm != next_pow2(bm) or bn != next_pow2(bn) or bn < 16:
        raise ValueError(f"block_m and block_n must be powers of two (block_n >= 16), got {bm}, {bn}")
    bm = max(bm, 16, next_pow2(group))
    tokens = bm // group
    block_tables = as_int32_rows(block_tables)
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    ks, vs = (k_scale, v_scale) if kind else (k_cache, v_cache)
    grid = (num_tokens // tokens + batch, hkv)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        out,
        block_tables,
        cu,
        lens,
        float(sm_scale) * LOG2E,
        batch,
        int(window),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *k_cache.stride()[:3],
        *scale_strides(k_scale, kind),
        HEAD_DIM=d,
        D_PAD=max(16, next_pow2(d)),
        GROUP=group,
        BLOCK_M=bm,
        TOKENS=tokens,
        BLOCK_N=bn,
        BLOCK_SIZE=block_size,
        QUANT=kind,
        **dot_operands(q.dtype),
        WINDOWED=window > 0,
        num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"],
    )
    return out


__all__ = ["extend_attention", "extend_config"]
