"""Triton kernels that fuse a decoder layer's elementwise work, so an eager step launches few
kernels (vLLM's fused_add_rms_norm, in-place RoPE and silu_and_mul are the model):

- `rms_norm(x, weight, eps, residual)`: the residual add and the RMSNorm in one pass;
- `silu_mul(gate_up)`: SiLU of the gate times the up projection (the merged GEMM's halves);
- `rope_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping)`: RoPE on the
  queries and keys, and the keys and values written into the paged cache (unquantised caches).

Each rounds where the torch ops it replaces round (the model's unfused path, `workbench/models/
llama.py`: `rms_norm`, `F.silu(gate) * up`, `RotaryEmbedding`; the tests compare against those):
in bf16 a product is rounded before the sum it feeds, as two torch ops would, so what is left
is the order of the RMSNorm's sum of squares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting, next_pow2


@triton.jit
def _round(x, dt: tl.constexpr):
    """fp32 `x` rounded to `dt`, to nearest even. bf16 is rounded by hand: Triton's CPU
    interpreter truncates fp32 -> bf16 (a GPU rounds); on both the result is then exact."""
    if dt == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # finite x: the bits past bf16's, rounded
        return bits.to(tl.float32, bitcast=True).to(dt)
    else:
        return x.to(dt)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    n_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # the residual stream: x + residual, rounded as the model's add rounds
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dt)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
        x = x.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / n_cols
    normed = _round(x * (1.0 / tl.sqrt(mean_sq + eps)), dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _round(normed * w, dt), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); without a residual, (RMSNorm(x) * weight, x).
    x, residual [T, H] (rows may be strided), weight [H]."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [T, H] and weight [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    rows, cols = x.shape
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    if rows:
        r = residual if residual is not None else x
        r = r if r.stride(-1) == 1 else r.contiguous()
        _rms_norm_kernel[(rows,)](
            x,
            r,
            weight,
            out,
            res_out,
            cols,
            x.stride(0),
            r.stride(0),
            out.stride(0),
            res_out.stride(0),
            float(eps),
            HAS_RES=residual is not None,
            BLOCK=next_pow2(cols),
            num_warps=min(16, max(1, next_pow2(cols) // 256)),
        )
    return out, res_out


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(g / (1.0 + tl.exp(-g)), dt).to(tl.float32)  # F.silu rounds before the product
    tl.store(out_ptr + row * stride_o + cols, _round(act * u, dt), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a merged gate/up projection's output [T, 2I] -> [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(next_pow2(n), 1 << 14 if interpreting() else 1024)
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](
            gate_up, out, n, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, dt: tl.constexpr):
    """The half-split rotation, each product rounded to `dt` before its sum (as torch's
    `x * cos + rotate_half(x) * sin` rounds in bf16)."""
    o1 = _round(_round(x1 * c1, dt).to(tl.float32) - _round(x2 * s1, dt).to(tl.float32), dt)
    o2 = _round(_round(x2 * c2, dt).to(tl.float32) + _round(x1 * s2, dt).to(tl.float32), dt)
    return o1, o2


@triton.jit
def _rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qo_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    slot_ptr,
    kc_ptr,
    vc_ptr,
    num_tokens,
    s_qt,
    s_qh,
    s_kt,
    s_kh,
    s_vt,
    s_vh,
    s_ot,
    s_oh,
    s_cos,
    s_cb,
    s_co,
    s_ch,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    tok = t.to(tl.int64)
    dt = qo_ptr.dtype.element_ty
    j = tl.arange(0, HALF_PAD)
    jmask = j < HALF
    pos = tl.load(pos_ptr + tok, mask=tmask, other=0).to(tl.int64)
    tj = tmask[:, None] & jmask[None, :]
    trig = pos[:, None] * s_cos + j[None, :]
    c1 = tl.load(cos_ptr + trig, mask=tj, other=0.0).to(tl.float32)[:, None, :]
    c2 = tl.load(cos_ptr + trig + HALF, mask=tj, other=0.0).to(tl.float32)[:, None, :]
    s1 = tl.load(sin_ptr + trig, mask=tj, other=0.0).to(tl.float32)[:, None, :]
    s2 = tl.load(sin_ptr + trig + HALF, mask=tj, other=0.0).to(tl.float32)[:, None, :]

    # queries: rotated into their own output
    hq = tl.arange(0, HQ_PAD)
    mq = tj[:, None, :] & (hq < HQ)[None, :, None]
    src = tok[:, None, None] * s_qt + hq[None, :, None] * s_qh + j[None, None, :]
    x1 = tl.load(q_ptr + src, mask=mq, other=0.0).to(tl.float32)
    x2 = tl.load(q_ptr + src + HALF, mask=mq, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, dt)
    dst = tok[:, None, None] * s_ot + hq[None, :, None] * s_oh + j[None, None, :]
    tl.store(qo_ptr + dst, o1, mask=mq)
    tl.store(qo_ptr + dst + HALF, o2, mask=mq)

    # keys rotated and values as they are, into the cache at each token's slot (< 0: skipped)
    slot = tl.load(slot_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    live = slot >= 0
    slot = tl.maximum(slot, 0)
    hk = tl.arange(0, HKV_PAD)
    mk = (tj & live[:, None])[:, None, :] & (hk < HKV)[None, :, None]
    cache = (slot // BLOCK_SIZE)[:, None, None] * s_cb + (slot % BLOCK_SIZE)[:, None, None] * s_co
    cache += hk[None, :, None] * s_ch + j[None, None, :]
    ksrc = tok[:, None, None] * s_kt + hk[None, :, None] * s_kh + j[None, None, :]
    x1 = tl.load(k_ptr + ksrc, mask=mk, other=0.0).to(tl.float32)
    x2 = tl.load(k_ptr + ksrc + HALF, mask=mk, other=0.0).to(tl.float32)
    o1, o2 = _rotate(x1, x2, c1, c2, s1, s2, dt)
    tl.store(kc_ptr + cache, o1.to(kc_ptr.dtype.element_ty), mask=mk)
    tl.store(kc_ptr + cache + HALF, o2.to(kc_ptr.dtype.element_ty), mask=mk)
    vsrc = tok[:, None, None] * s_vt + hk[None, :, None] * s_vh + j[None, None, :]
    v1 = tl.load(v_ptr + vsrc, mask=mk, other=0.0)
    v2 = tl.load(v_ptr + vsrc + HALF, mask=mk, other=0.0)
    tl.store(vc_ptr + cache, v1.to(vc_ptr.dtype.element_ty), mask=mk)
    tl.store(vc_ptr + cache + HALF, v2.to(vc_ptr.dtype.element_ty), mask=mk)


def rope_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """RoPE (half-split layout) on q [T, Hq, D] and k [T, Hkv, D] at `positions` [T] from the
    tables cos/sin [P, D]; the rotated keys and v [T, Hkv, D] written into the paged cache at
    slot_mapping [T] (< 0: skipped). Returns the rotated queries (a new [T, Hq, D] tensor)."""
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (num_tokens, hkv, d) or v.shape != k.shape or d % 2:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need [T, H, D], even D")
    if k_cache.dtype in (torch.int8, torch.float8_e4m3fn):  # those take write_kv's per-head scales
        raise ValueError(f"rope_write_kv writes unquantised caches only, got {k_cache.dtype}")
    if k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"k {tuple(k.shape)} does not fit the cache {tuple(k_cache.shape)}")
    if cos.shape != sin.shape or cos.shape[1] != d or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        raise ValueError(f"cos/sin must be equal [P, {d}] tables, got {tuple(cos.shape)} / {tuple(sin.shape)}")
    if positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError("positions and slot_mapping must have one entry per token")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty((num_tokens, hq, d), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    half = d // 2
    hq_pad, hkv_pad, half_pad = next_pow2(hq), next_pow2(hkv), max(16, next_pow2(half))
    budget = 1 << 16 if interpreting() else 4096  # the interpreter wants few, large programs
    block_t = max(1, min(next_pow2(num_tokens), budget // ((hq_pad + hkv_pad) * half_pad)))
    _rope_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        q,
        k,
        v,
        out,
        cos,
        sin,
        positions.contiguous(),
        slot_mapping.contiguous(),
        k_cache,
        v_cache,
        num_tokens,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        *k_cache.stride()[:3],
        HQ=hq,
        HKV=hkv,
        HALF=half,
        HQ_PAD=hq_pad,
        HKV_PAD=hkv_pad,
        HALF_PAD=half_pad,
        BLOCK_T=block_t,
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
    )
    return out


__all__ = ["rms_norm", "silu_mul", "rope_write_kv"]
