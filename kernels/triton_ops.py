"""The Triton kernels: the attention backend's three ops (KV write, extend and decode attention)
with the signatures of `reference`, the fused MoE experts, and the fused layer ops (residual add +
RMSNorm, SiLU x up, RoPE + KV write: `fused_layer.py`).

    from workbench_kernels.triton_ops import write_kv, extend_attention, decode_attention, fused_moe

Triton decides when a kernel is decorated whether to compile it or to run it in its CPU
interpreter (TRITON_INTERPRET=1). Without CUDA only the interpreter can run the kernels, so this
module switches it on before importing them, unless the variable is already set.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .decode_attention import decode_attention, decode_config, pick_num_splits  # noqa: E402
from .extend_attention import extend_attention, extend_config  # noqa: E402
from .fused_layer import rms_norm, rope_write_kv, silu_mul  # noqa: E402
from .fused_moe import fused_moe  # noqa: E402
from .kv_write import write_kv  # noqa: E402

__all__ = [
    "write_kv",
    "extend_attention",
    "decode_attention",
    "extend_config",
    "decode_config",
    "pick_num_splits",
    "fused_moe",
    "rms_norm",
    "silu_mul",
    "rope_write_kv",
]
