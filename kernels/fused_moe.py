"""Triton fused mixture-of-experts MLP (see reference.fused_moe_ref).

Each token is routed to `top_k` experts. Instead of looping over experts on the host, the
(token, slot) pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`moe_align`), so that one program handles BLOCK_M pairs of a single expert: a grouped GEMM whose
tile loads that expert's weights once for all of its rows. Two launches: gate and up together
(one [2I, H] matrix per expert, `w13`), then SiLU(gate) * up, then down (`w2`, [H, I]) scaled by
the routing weight; each pair's row is summed into its token. Only the chosen experts' weights
are read, and only for the rows routed to them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import dot_operands, interpreting, next_pow2


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pair indices (t * top_k + k) sorted by expert, each expert's run padded to a
    multiple of `block_m` with the sentinel `topk_ids.numel()`, and the expert of each block."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    first = torch.cumsum(counts, 0) - counts  # where each expert's run starts in `order`
    rank = torch.arange(pairs, device=flat.device) - first[flat[order]]
    sorted_ids = torch.full((int(padded.sum()),), pairs, dtype=torch.int32, device=flat.device)
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    block_expert = torch.repeat_interleave(
        torch.arange(num_experts, device=flat.device, dtype=torch.int32), padded // block_m
    )
    return sorted_ids, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    sorted_ptr,
    block_expert_ptr,
    weight_ptr,
    num_pairs,
    N,
    K,
    top_k,
    stride_am,
    stride_we,
    stride_wn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    A_PER_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """C[pair, :] = A[row(pair), :] @ W[expert]^T (x the pair's routing weight), for BLOCK_M pairs of
    one expert; A's row is the pair's token (the first GEMM) or the pair itself (the second)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + m)
    valid = pair < num_pairs
    a_row = pair // top_k if A_PER_TOKEN else pair
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        a = tl.load(
            a_ptr + a_row[:, None].to(tl.int64) * stride_am + k[None, :],
            mask=valid[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + expert * stride_we + n[None, :] * stride_wn + k[:, None],
            mask=n_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        acc += tl.dot(a.to(DOT), w.to(DOT), input_precision=PRECISION)
    if MUL_WEIGHT:
        acc = acc * tl.load(weight_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + pair[:, None].to(tl.int64) * stride_cm + n[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


def moe_config(dtype: torch.dtype) -> dict:
    """Launch shape: untuned guesses for Hopper-class GPUs; large tiles in the interpreter."""
    if interpreting():
        return dict(block_m=16, block_n=64, block_k=64, num_warps=4)
    if dtype == torch.float32:
        return dict(block_m=16, block_n=32, block_k=32, num_warps=4)
    return dict(block_m=16, block_n=64, block_k=64, num_warps=4)


def _grouped_gemm(a, w, sorted_ids, block_expert, num_pairs, top_k, *, per_token, weights, cfg) -> torch.Tensor:
    _, n, k = w.shape
    c = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    grid = (block_expert.numel(), triton.cdiv(n, cfg["block_n"]))
    _moe_gemm_kernel[grid](
        a,
        w,
        c,
        sorted_ids,
        block_expert,
        weights if weights is not None else a,
        num_pairs,
        n,
        k,
        top_k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        c.stride(0),
        BLOCK_M=cfg["block_m"],
        BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"],
        A_PER_TOKEN=per_token,
        MUL_WEIGHT=weights is not None,
        **dot_operands(a.dtype),
        num_warps=cfg["num_warps"],
    )
    return c


def fused_moe(h, w13, w2, topk_weights, topk_ids, *, block_m: int | None = None) -> torch.Tensor:
    """The MoE MLP of tokens h [T, H]: w13 [E, 2I, H] (each expert's gate rows, then up rows), w2
    [E, H, I], topk_weights / topk_ids [T, top_k] (the router's choice). Returns [T, H]."""
    t, hidden = h.shape
    experts, two_i, kh = w13.shape
    if kh != hidden or w2.shape != (experts, hidden, two_i // 2) or topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"fused_moe shapes do not fit: h {tuple(h.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}, topk {tuple(topk_ids.shape)}"
        )
    if t == 0:
        return torch.zeros_like(h)
    for x in (h, w13, w2):
        if x.stride(-1) != 1:
            raise ValueError("fused_moe needs contiguous last dimensions")
    cfg = moe_config(h.dtype)
    if block_m is not None:
        if block_m != next_pow2(block_m) or block_m < 16:
            raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
        cfg = {**cfg, "block_m": block_m}
    top_k = topk_ids.shape[1]
    pairs = t * top_k
    sorted_ids, block_expert = moe_align(topk_ids, experts, cfg["block_m"])
    gate_up = _grouped_gemm(h, w13, sorted_ids, block_expert, pairs, top_k, per_token=True, weights=None, cfg=cfg)
    gate, up = gate_up.chunk(2, dim=-1)
    act = (F.silu(gate) * up).contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down = _grouped_gemm(act, w2, sorted_ids, block_expert, pairs, top_k, per_token=False, weights=weights, cfg=cfg)
    return down.view(t, top_k, hidden).sum(1)


__all__ = ["fused_moe", "moe_align", "moe_config"]
