"""Torch references for the paged-attention kernels, and the engine's CPU attention path.

Cache layout (shared with the Triton kernels and the engine):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot = block_id * block_size + offset; slot_mapping entries < 0 are skipped (padding).
    Quantised caches (int8 or float8_e4m3fn) carry a float32 scale per token and head:
    k_scale, v_scale: [num_blocks, block_size, num_kv_heads]; value = stored * scale.
Attention inputs:
    q: [num_tokens, num_q_heads, head_dim]; num_q_heads = group * num_kv_heads (GQA).
    block_tables: [batch, max_blocks_per_seq] int32 (unused tail entries may hold anything).
    seq_lens: [batch] int32, the context length *including* the new tokens.
    cu_seqlens_q: [batch + 1] int32 prefix sums of new-token counts; the new tokens of sequence b
    sit at positions seq_lens[b] - q_len_b ... seq_lens[b] - 1 (causal, so prefix-cache hits and
    chunked-prefill chunks are queries that start mid-sequence).
Everything accumulates in float32 and returns q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-per-head symmetric quantisation: x [T, H, D] -> (values [T, H, D], scale [T, H])."""
    amax = x.float().abs().amax(dim=-1).clamp(min=1e-6)
    # a tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal, which
    # rounds otherwise than the division the kernels (div_rn) and the CPU do (seen on an H200)
    scale = amax / torch.full_like(amax, QMAX[dtype])
    y = x.float() / scale.unsqueeze(-1)
    if dtype == torch.int8:
        y = y.round().clamp(-127, 127)
    return y.to(dtype), scale


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Scatter new keys/values [T, Hkv, D] into the paged cache at slot_mapping [T]."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    num_blocks, block_size, hkv, d = k_cache.shape
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        flat = cache.view(num_blocks * block_size, hkv, d)
        if scale is None:
            flat[slots] = x.to(cache.dtype)
        else:
            values, s = quantize_kv(x, cache.dtype)
            flat[slots] = values
            scale.view(num_blocks * block_size, hkv)[slots] = s


def _dequant(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale.unsqueeze(-1)).to(dtype)


def gather_kv(cache, scale, block_table_row, length: int, dtype) -> torch.Tensor:
    """The first `length` cached tokens of one sequence as [length, Hkv, D]."""
    block_size = cache.shape[1]
    nblocks = (length + block_size - 1) // block_size
    blocks = block_table_row[:nblocks].long()
    vals = cache[blocks].flatten(0, 1)[:length]
    s = None if scale is None else scale[blocks].flatten(0, 1)[:length]
    return _dequant(vals, s, dtype)


def extend_attention_ref(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sm_scale, k_scale=None, v_scale=None, window=0
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole cached context; with
    `window` > 0 (a sliding-window layer) a token sees only the `window` positions ending at its own."""
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    compute = torch.float32 if q.dtype != torch.bfloat16 else torch.bfloat16
    for b, length in enumerate(lens):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        qb = q[s:e].to(compute).transpose(0, 1)  # [Hq, n, D]
        kb = gather_kv(k_cache, k_scale, block_tables[b], length, compute).transpose(0, 1)
        vb = gather_kv(v_cache, v_scale, block_tables[b], length, compute).transpose(0, 1)
        n = e - s
        if n == length and not (0 < window < length):
            mask, causal = None, True
        else:
            qpos = torch.arange(length - n, length, device=q.device).unsqueeze(1)
            kpos = torch.arange(length, device=q.device).unsqueeze(0)
            mask, causal = kpos <= qpos, False
            if window > 0:
                mask = mask & (kpos > qpos - window)
        ob = F.scaled_dot_product_attention(
            qb, kb, vb, attn_mask=mask, is_causal=causal, scale=sm_scale, enable_gqa=hq != hkv
        )
        out[s:e] = ob.transpose(0, 1).to(q.dtype)
    return out


def decode_attention_ref(
    q, k_cache, v_cache, block_tables, seq_lens, sm_scale, k_scale=None, v_scale=None, window=0
) -> torch.Tensor:
    """One query per sequence over its cache, batched: q [B, Hq, D] -> [B, Hq, D]; with `window`
    > 0 only the last `window` cached positions."""
    bsz, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max())
    nblocks = (max_len + block_size - 1) // block_size
    blocks = block_tables[:, :nblocks].long()
    compute = torch.float32 if q.dtype != torch.bfloat16 else torch.bfloat16

    def load(cache, scale):
        vals = cache[blocks].flatten(1, 2)[:, :max_len]  # [B, L, Hkv, D]
        s = None if scale is None else scale[blocks].flatten(1, 2)[:, :max_len]
        return _dequant(vals, s, compute).transpose(1, 2)  # [B, Hkv, L, D]

    k, v = load(k_cache, k_scale), load(v_cache, v_scale)
    mask = None
    if window > 0 and max_len > window:
        kpos = torch.arange(max_len, device=q.device)
        lens = seq_lens.unsqueeze(1).long()
        mask = ((kpos < lens) & (kpos >= lens - window))[:, None, None, :]
    elif bsz > 1 and bool((seq_lens != max_len).any()):
        mask = (torch.arange(max_len, device=q.device) < seq_lens.unsqueeze(1).long())[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.to(compute).unsqueeze(2), k, v, attn_mask=mask, scale=sm_scale, enable_gqa=hq != hkv
    )
    return out.squeeze(2).to(q.dtype)


def fused_moe_ref(h, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The MoE MLP, expert by expert: each token's top-k experts' SwiGLU outputs, weighted and summed.
    h [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_* [T, top_k]."""
    out = torch.zeros(h.shape[0], w2.shape[1], dtype=torch.float32, device=h.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        gate, up = (h[rows].float() @ w13[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].float().t()
        out.index_add_(0, rows, y * topk_weights[rows, slot, None].float())
    return out.to(h.dtype)
