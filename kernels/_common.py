"""Small helpers shared by the Triton launchers (no kernels here)."""

from __future__ import annotations

import os

import torch

# Quantised cache kinds, passed to the kernels as a constexpr.
QUANT_NONE, QUANT_INT8, QUANT_FP8 = 0, 1, 2


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def quant_kind(cache: torch.Tensor, scale: torch.Tensor | None) -> int:
    if cache.dtype == torch.int8:
        kind = QUANT_INT8
    elif cache.dtype == torch.float8_e4m3fn:
        kind = QUANT_FP8
    else:
        return QUANT_NONE
    if scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs its k_scale/v_scale tensors")
    return kind


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> int:
    """Validate a paged cache pair; returns the quantisation kind."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must be equal 4-d tensors, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must share a dtype")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides, with a contiguous last dimension")
    kind = quant_kind(k_cache, k_scale)
    if kind != QUANT_NONE:
        if v_scale is None:
            raise ValueError(f"a {k_cache.dtype} KV cache needs its k_scale/v_scale tensors")
        if k_scale.shape != k_cache.shape[:3] or v_scale.shape != k_scale.shape:
            raise ValueError("k_scale/v_scale must have shape [num_blocks, block_size, num_kv_heads]")
        if k_scale.dtype != torch.float32 or v_scale.dtype != torch.float32:
            raise ValueError("k_scale/v_scale must be float32")
        if k_scale.stride() != v_scale.stride():
            raise ValueError("k_scale and v_scale must share strides")
    return kind


def scale_strides(k_scale, kind: int) -> tuple[int, int, int]:
    return tuple(k_scale.stride()) if kind != QUANT_NONE else (0, 0, 0)


def as_int32_rows(block_tables: torch.Tensor) -> torch.Tensor:
    """Block tables as int32 with contiguous rows (a no-op for the usual layout)."""
    block_tables = block_tables.to(torch.int32)
    return block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_operands(dtype: torch.dtype) -> dict:
    """The kernels' DOT (the type tl.dot multiplies in) and PRECISION constexprs for inputs of
    `dtype`. fp32 gets IEEE dots (the default on NVIDIA would be TF32). Triton's interpreter
    multiplies bf16 dots wrongly (it treats the raw bit patterns as numbers: triton-lang/triton
    #11584), so there bf16 operands are widened to fp32 first, exactly, and the dot is fp32's."""
    import triton.language as tl

    if dtype == torch.bfloat16 and interpreting():
        dtype = torch.float32
    dot = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    return dict(DOT=dot, PRECISION="ieee" if dtype == torch.float32 else None)
