"""Triton KV-cache write: scatter new keys/values into the paged cache (see reference.write_kv_ref).

Quantised caches (int8 / float8_e4m3fn) are written per token and head with a symmetric fp32
scale, exactly as `reference.quantize_kv` does: scale = max(amax, 1e-6) / qmax, value = x / scale
rounded half-to-even (int8, clamped to +-127) or rounded to the nearest e4m3 value (fp8).

The fp8 encoding is done by hand (rounding on the e4m3 grid, then assembling the bits and storing
them through a uint8 view of the cache): it is exact on every backend, whereas Triton's CPU
interpreter mis-rounds fp32 -> fp8 conversions that carry into the exponent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import QUANT_FP8, QUANT_NONE, check_cache, interpreting, next_pow2


@triton.jit
def _round_half_even(x):
    # adding and subtracting 1.5 * 2**23 rounds an fp32 |x| < 2**22 to an integer, half-to-even
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _fp8e4m3_bits(y):
    """Bit pattern (int32, 0..255) of y rounded to float8_e4m3fn, nearest-even, saturating at 448."""
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    ay = tl.minimum(tl.abs(y), 448.0)
    e = (ay.to(tl.int32, bitcast=True) >> 23) - 127  # unbiased exponent (ay >= 0)
    qe = tl.maximum(e, -6) - 3  # exponent of one e4m3 ulp at this magnitude (subnormals: 2**-9)
    inv_quantum = ((127 - qe) << 23).to(tl.float32, bitcast=True)  # 2**-qe
    quantum = ((127 + qe) << 23).to(tl.float32, bitcast=True)  # 2**qe
    r = tl.minimum(_round_half_even(ay * inv_quantum) * quantum, 448.0)  # exact on the e4m3 grid
    rbits = r.to(tl.int32, bitcast=True)
    re = (rbits >> 23) - 127
    normal = ((re + 7) << 3) | ((rbits >> 20) & 7)
    subnormal = (r * 512.0).to(tl.int32)
    return tl.where(re >= -6, normal, subnormal) | (sign << 7)


@triton.jit
def _write_one(
    x_ptr,
    stride_xt,
    stride_xh,
    cache_ptr,
    scale_ptr,
    tok,
    blk,
    off,
    h,
    d,
    tmask,
    hmask,
    dmask,
    s_cb,
    s_co,
    s_ch,
    ss_b,
    ss_o,
    ss_h,
    QUANT: tl.constexpr,
):
    m2 = tmask[:, None] & hmask[None, :]
    m3 = m2[:, :, None] & dmask[None, None, :]
    src = tok[:, None, None] * stride_xt + h[None, :, None] * stride_xh + d[None, None, :]
    x = tl.load(x_ptr + src, mask=m3, other=0.0)
    dst = blk[:, None, None] * s_cb + off[:, None, None] * s_co + h[None, :, None] * s_ch + d[None, None, :]
    if QUANT == 0:
        tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=m3)
    else:
        xf = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xf), axis=2), 1e-6)
        if QUANT == 1:
            scale = tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        else:
            scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        y = tl.math.div_rn(xf, tl.broadcast_to(scale[:, :, None], xf.shape))
        if QUANT == 1:
            q = tl.minimum(tl.maximum(_round_half_even(y), -127.0), 127.0).to(tl.int8)
        else:
            q = _fp8e4m3_bits(y).to(tl.uint8)
        tl.store(cache_ptr + dst, q, mask=m3)
        sdst = blk[:, None] * ss_b + off[:, None] * ss_o + h[None, :] * ss_h
        tl.store(scale_ptr + sdst, scale, mask=m2)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    s_cb,
    s_co,
    s_ch,
    ss_b,
    ss_o,
    ss_h,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    tmask = slot >= 0
    slot = tl.maximum(slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    tok = t.to(tl.int64)
    hmask = h < NUM_HEADS
    dmask = d < HEAD_DIM
    _write_one(
        k_ptr,
        stride_kt,
        stride_kh,
        kc_ptr,
        ks_ptr,
        tok,
        blk,
        off,
        h,
        d,
        tmask,
        hmask,
        dmask,
        s_cb,
        s_co,
        s_ch,
        ss_b,
        ss_o,
        ss_h,
        QUANT,
    )
    _write_one(
        v_ptr,
        stride_vt,
        stride_vh,
        vc_ptr,
        vs_ptr,
        tok,
        blk,
        off,
        h,
        d,
        tmask,
        hmask,
        dmask,
        s_cb,
        s_co,
        s_ch,
        ss_b,
        ss_o,
        ss_h,
        QUANT,
    )


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter new keys/values [T, Hkv, D] into the paged cache at slot_mapping [T] (< 0: skipped)."""
    kind = check_cache(k_cache, v_cache, k_scale, v_scale)
    num_tokens, hkv, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (hkv, d):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit the cache {tuple(k_cache.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError("slot_mapping must have one entry per token")
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    slot_mapping = slot_mapping.contiguous()
    block_size = k_cache.shape[1]
    if kind == QUANT_FP8:  # the kernel writes the e4m3 bit patterns itself
        kc, vc = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        kc, vc = k_cache, v_cache
    if kind == QUANT_NONE:
        ks, vs, sstr = k_cache, v_cache, (0, 0, 0)  # dummies, never touched
    else:
        ks, vs, sstr = k_scale, v_scale, tuple(k_scale.stride())
    h_pad, d_pad = next_pow2(hkv), max(16, next_pow2(d))
    per_token = h_pad * d_pad
    # The interpreter pays per op, not per element: few, large programs. A GPU wants many small ones.
    budget = 1 << 16 if interpreting() else 4096
    block_t = max(1, min(next_pow2(num_tokens), budget // per_token))
    grid = (triton.cdiv(num_tokens, block_t),)
    _write_kv_kernel[grid](
        k,
        v,
        kc,
        vc,
        ks,
        vs,
        slot_mapping,
        num_tokens,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *sstr,
        NUM_HEADS=hkv,
        HEAD_DIM=d,
        H_PAD=h_pad,
        D_PAD=d_pad,
        BLOCK_T=block_t,
        BLOCK_SIZE=block_size,
        QUANT=kind,
        num_warps=4,
    )


__all__ = ["write_kv"]
