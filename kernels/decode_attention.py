"""Triton decode attention over the paged KV cache (see reference.decode_attention_ref).

One query token per sequence. A program owns one (sequence, KV head) pair and the whole query
group that shares that head, so every K/V tile is read from memory once for all of its query heads
(GQA); the group's rows are padded to 16 so the scores and the output are tensor-core dots.

Split-KV (flash-decoding): with few sequences x KV heads to fill the GPU, each sequence's context
is cut into `num_splits` chunks handled by separate programs, which write a normalised partial
output and its log-sum-exp; a second kernel merges the chunks. The launcher picks the number of
splits from the batch size, the KV head count, the context length and the number of SMs, unless
`num_splits` forces it (1 = no split: the attention kernel writes the output directly).
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
MAX_SPLITS = 64


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    o_ptr,
    lse_ptr,
    bt_ptr,
    seq_lens_ptr,
    qk_scale,
    window,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
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
    G_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    QUANT: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    lo = seq_len * 0  # a sliding window (window > 0) sees only the last `window` positions
    if window > 0:
        lo = tl.maximum(seq_len - window, 0)
    if NUM_SPLITS == 1:
        start = lo
        end = seq_len
    else:
        chunk = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * chunk
        end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, G_PAD)
    gmask = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(DOT)

    bt_row_ptr = bt_ptr + b.to(tl.int64) * stride_bt
    k_head = k_ptr + kvh * s_ch
    v_head = v_ptr + kvh * s_ch
    ks_head = ks_ptr + kvh * ss_h
    vs_head = vs_ptr + kvh * ss_h

    m_i = tl.full([G_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        kv_off, sc_off = kv_tile_offsets(bt_row_ptr, n, n_mask, BLOCK_SIZE, s_cb, s_co, ss_b, ss_o, QUANT)
        kt = tl.load(k_head + kv_off[None, :] + d[:, None], mask=n_mask[None, :] & dmask[:, None], other=0.0)
        s = tl.dot(q, kt.to(q.dtype), input_precision=PRECISION)  # [G_PAD, BLOCK_N] fp32
        if QUANT != 0:
            k_sc = tl.load(ks_head + sc_off, mask=n_mask, other=0.0)
            s = s * (k_sc * qk_scale)[None, :]
        else:
            s = s * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + kv_off[:, None] + d[None, :], mask=n_mask[:, None] & dmask[None, :], other=0.0)
        if QUANT != 0:
            v_sc = tl.load(vs_head + sc_off, mask=n_mask, other=0.0)
            p = p * v_sc[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    omask = gmask[:, None] & dmask[None, :]
    o_off = b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(o_ptr + o_off + split * stride_os, out, mask=omask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + head * stride_lh + split, lse, mask=gmask)


@triton.jit
def _decode_reduce_kernel(
    po_ptr,
    lse_ptr,
    o_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    smask = s < NUM_SPLITS
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # empty splits (lse = -inf) weigh 0
    po = tl.load(
        po_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(po * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=dmask)


def decode_config(head_dim: int, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> dict:
    """The default launch configuration (block_n, num_warps, num_stages) for a shape.

    16-bit on an H200 (Triton 3.6, 64 sequences x 4096 tokens, `bench.py --sweep`, docs/gpu/): d128
    takes the fastest of the sweep's 18 on two machines (1.14x and 1.16x the earlier 64/4/3); d64
    keeps the earlier guess, as the two machines ranked its configurations differently (64/4/2
    first on one at 70.7 us, 107.7 on the other). fp32 (exactness checks) stays an untuned guess."""
    if interpreting():
        return dict(block_n=64, num_warps=4, num_stages=1)
    if q_dtype == torch.float32:
        return dict(block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 64:
        return dict(block_n=128, num_warps=4, num_stages=3)
    return dict(block_n=32, num_warps=4, num_stages=2)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def pick_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Splits per sequence so that batch x kv heads x splits programs fill the GPU a few times over,
    while every split keeps at least four tiles of keys."""
    programs = batch * num_kv_heads
    target = 4 * num_sms
    if programs >= target:
        return 1
    by_len = max(1, max_seq_len // (4 * block_n))
    return max(1, min(triton.cdiv(target, programs), by_len, MAX_SPLITS))


def decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    seq_lens,
    sm_scale,
    k_scale=None,
    v_scale=None,
    window=0,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """One query per sequence over its cache, batched: q [B, Hq, D] -> [B, Hq, D].

    window > 0: a sliding-window layer, each query sees its last `window` positions.
    num_splits: split-KV chunks per sequence (None: automatic; 1: no split). max_seq_len: an
    upper bound on seq_lens for the automatic choice (None: read seq_lens.max(), a host sync).
    block_n / num_warps / num_stages override the tuned launch configuration."""
    kind = check_cache(k_cache, v_cache, k_scale, v_scale)
    bsz, hq, d = q.shape
    _, block_size, hkv, dc = k_cache.shape
    if dc != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if seq_lens.shape[0] != bsz or block_tables.shape[0] < bsz:
        raise ValueError("seq_lens needs one entry, block_tables one row, per query")
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    q = last_dim_contiguous(q)
    group = hq // hkv
    cfg = decode_config(d, k_cache.dtype, q.dtype)
    bn = block_n or cfg["block_n"]
    warps = num_warps or cfg["num_warps"]
    stages = num_stages or cfg["num_stages"]
    if bn != next_pow2(bn) or bn < 16:
        raise ValueError(f"block_n must be a power of two >= 16, got {bn}")
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if window > 0:
            max_seq_len = min(max_seq_len, int(window))
        num_splits = pick_num_splits(bsz, hkv, max_seq_len, bn, _num_sms(q.device))
    num_splits = max(1, min(int(num_splits), MAX_SPLITS))
    block_tables = as_int32_rows(block_tables)
    lens = seq_lens.to(torch.int32).contiguous()
    ks, vs = (k_scale, v_scale) if kind else (k_cache, v_cache)
    d_pad = max(16, next_pow2(d))
    common = dict(
        HEAD_DIM=d,
        D_PAD=d_pad,
        GROUP=group,
        G_PAD=max(16, next_pow2(group)),
        BLOCK_N=bn,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        QUANT=kind,
        **dot_operands(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    strides = (*k_cache.stride()[:3], *scale_strides(k_scale, kind))
    grid = (bsz, hkv, num_splits)
    if num_splits == 1:
        _decode_kernel[grid](
            q,
            k_cache,
            v_cache,
            ks,
            vs,
            out,
            out,
            block_tables,
            lens,
            float(sm_scale) * LOG2E,
            int(window),
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            0,
            0,
            0,
            block_tables.stride(0),
            *strides,
            **common,
        )
        return out
    part = torch.empty(bsz, hq, num_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(bsz, hq, num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[grid](
        q,
        k_cache,
        v_cache,
        ks,
        vs,
        part,
        lse,
        block_tables,
        lens,
        float(sm_scale) * LOG2E,
        int(window),
        q.stride(0),
        q.stride(1),
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        block_tables.stride(0),
        *strides,
        **common,
    )
    _decode_reduce_kernel[(bsz, hq)](
        part,
        lse,
        out,
        part.stride(0),
        part.stride(1),
        part.stride(2),
        lse.stride(0),
        lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        D_PAD=d_pad,
        NUM_SPLITS=num_splits,
        S_PAD=max(2, next_pow2(num_splits)),
        num_warps=4,
    )
    return out


__all__ = ["decode_attention", "decode_config", "pick_num_splits"]
