"""Triton helpers shared by the paged-attention kernels: gathering a tile of cached keys/values."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_tile_offsets(bt_row_ptr, n, n_mask, BLOCK_SIZE: tl.constexpr, s_cb, s_co, ss_b, ss_o, QUANT: tl.constexpr):
    """For cache positions n [BLOCK_N] of one sequence: element offsets of each token's row in the
    cache (head 0), and of its scale (0 when the cache is not quantised). int64 throughout."""
    page = n // BLOCK_SIZE
    slot = n % BLOCK_SIZE
    blk = tl.load(bt_row_ptr + page, mask=n_mask, other=0).to(tl.int64)
    kv_off = blk * s_cb + slot * s_co
    if QUANT != 0:
        sc_off = blk * ss_b + slot * ss_o
    else:
        sc_off = kv_off * 0
    return kv_off, sc_off
