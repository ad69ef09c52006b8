"""Paged KV cache storage, per-step attention metadata, and the attention backends.

A backend is three functions with the signatures of `workbench_kernels.reference`
(write_kv, extend_attention, decode_attention); `torch` runs those references, `triton` runs
our Triton kernels, `cpu` our C kernels (the CPU fast path's, `models/cpu_forward.py`). Each
backend prepares the metadata it needs beyond the common part (`prepare`). The cache layout is
documented in `kernels/reference.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from workbench_kernels import hostmem, reference

from ..models.cpu_forward import CpuKernelForward, TokenQueries
from .device import to_device

KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


class KVCache:
    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype, device):
        store = KV_DTYPES.get(kv_cache_dtype, dtype)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":  # one region in huge pages: decode attention reads it scattered
            every = hostmem.ARENA.zeros((2 * num_layers, *shape), store)
            self.k, self.v = list(every[:num_layers]), list(every[num_layers:])
        else:
            self.k = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
            self.v = [torch.zeros(shape, dtype=store, device=device) for _ in range(num_layers)]
        quantised = kv_cache_dtype in KV_DTYPES
        sshape = shape[:3]
        self.k_scale = [torch.ones(sshape, device=device) for _ in range(num_layers)] if quantised else None
        self.v_scale = [torch.ones(sshape, device=device) for _ in range(num_layers)] if quantised else None
        self.kv_cache_dtype = kv_cache_dtype

    def layer(self, i: int):
        if self.k_scale is None:
            return self.k[i], self.v[i], None, None
        return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype) -> int:
        store = KV_DTYPES.get(kv_cache_dtype, dtype)
        per_token = num_kv_heads * head_dim * torch.empty((), dtype=store).element_size()
        if kv_cache_dtype in KV_DTYPES:
            per_token += num_kv_heads * 4
        return 2 * num_layers * block_size * per_token


@dataclass
class AttnMetadata:
    slot_mapping: torch.Tensor  # [T]
    num_decode: int  # the first num_decode tokens are one-token decodes, one per sequence
    decode_block_tables: torch.Tensor | None
    decode_seq_lens: torch.Tensor | None
    ext_cu_seqlens_q: torch.Tensor | None  # the remaining tokens: prefill chunks and verifies
    ext_seq_lens: torch.Tensor | None
    ext_block_tables: torch.Tensor | None
    # The CPU backend's small steps, each token a one-query attention of its own (decodes and
    # short verifies/prefills then share the one-call layer kernel); owned by the CPU fast path
    cpu_tokens: TokenQueries | None = None
    # A CUDA graph's decode: the split-KV count fixed at capture (the Triton kernel then reads no
    # length on the host); None: chosen per step
    decode_num_splits: int | None = None
    # The longest decode context, known on the host (the Triton backend's): the kernel picks its
    # split count from it instead of reading seq_lens.max() back from the device in every layer
    decode_max_seq_len: int | None = None


class AttentionBackend:
    """`scale`: the softmax scale (default 1/sqrt(head_dim); Gemma 3: query_pre_attn_scalar^-0.5).
    `windows`: per layer, the sliding window (0: full attention)."""

    def __init__(
        self, name: str, ops, kv: KVCache, head_dim: int, scale: float | None = None, windows: list[int] | None = None
    ):
        self.name = name
        self.ops = ops
        self.kv = kv
        self.scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
        self.windows = windows or [0] * len(kv.k)
        self.reason = ""  # why it serves (make_backend)

    def prepare(self, meta: AttnMetadata, tables: list[tuple[list[int], int]], positions: list[int]) -> None:
        """Metadata this backend needs beyond the common part; `tables` holds each scheduled
        sequence's block table and token count, in the step's token order."""

    def __call__(self, q, k, v, layer: int, meta: AttnMetadata) -> torch.Tensor:
        k_cache, v_cache, k_scale, v_scale = self.kv.layer(layer)
        self.ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return self.attend(q, layer, meta)

    def attend(self, q, layer: int, meta: AttnMetadata) -> torch.Tensor:
        """Attention of q over the cache, whose new keys/values are already written."""
        k_cache, v_cache, k_scale, v_scale = self.kv.layer(layer)
        window = {"window": self.windows[layer]} if self.windows[layer] else {}
        if meta.decode_num_splits:
            splits = {"num_splits": meta.decode_num_splits}
        elif meta.decode_max_seq_len:
            splits = {"max_seq_len": meta.decode_max_seq_len}
        else:
            splits = {}
        nd = meta.num_decode
        if nd == q.shape[0]:
            return self.ops.decode_attention(
                q,
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                k_scale,
                v_scale,
                **window,
                **splits,
            )
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.ops.decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                k_scale,
                v_scale,
                **window,
                **splits,
            )
        out[nd:] = self.ops.extend_attention(
            q[nd:],
            k_cache,
            v_cache,
            meta.ext_block_tables,
            meta.ext_cu_seqlens_q,
            meta.ext_seq_lens,
            self.scale,
            k_scale,
            v_scale,
            **window,
        )
        return out


class CpuKernelAttention(AttentionBackend):
    """Our C attention kernels (the CPU fast path's), which also serve the one-call layer kernel's small steps."""

    def prepare(self, meta: AttnMetadata, tables: list[tuple[list[int], int]], positions: list[int]) -> None:
        meta.cpu_tokens = CpuKernelForward.token_queries(tables, positions, meta.slot_mapping.device)


class TritonAttention(AttentionBackend):
    """Our Triton kernels (the GPU's backend)."""

    def prepare(self, meta: AttnMetadata, tables: list[tuple[list[int], int]], positions: list[int]) -> None:
        if meta.num_decode:  # the first num_decode tokens are decodes: each one's context ends at it
            meta.decode_max_seq_len = max(positions[: meta.num_decode]) + 1


def pad_tables(tables: list[list[int]], device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return to_device([t + [0] * (width - len(t)) for t in tables], torch.int32, torch.device(device))


_TORCH_OPS = SimpleNamespace(
    write_kv=reference.write_kv_ref,
    extend_attention=reference.extend_attention_ref,
    decode_attention=reference.decode_attention_ref,
)


def make_backend(
    name: str,
    device: torch.device,
    cpu_kernels: bool,
    kv: KVCache,
    head_dim: int,
    scale: float | None = None,
    windows: list[int] | None = None,
) -> AttentionBackend:
    """The backend `attention_backend=name` selects here (see `backend_ops`)."""
    resolved, ops = backend_ops(name, device, cpu_kernels)
    cls = {"cpu": CpuKernelAttention, "triton": TritonAttention}.get(resolved, AttentionBackend)
    backend = cls(resolved, ops, kv, head_dim, scale, windows)
    backend.reason = backend_reason(name, resolved, device)
    return backend


def backend_reason(setting: str, resolved: str, device: torch.device) -> str:
    """Why this backend serves, and what it costs where that is not obvious (status's words)."""
    if resolved == "triton" and device.type != "cuda":
        return (
            "our Triton kernels in Triton's CPU interpreter (no CUDA here): exact (bf16 dots widened to fp32, as "
            "the interpreter's bf16 tl.dot is wrong) but tens of times slower than 'torch': for checking GPU kernels"
        )
    source = "auto on " + ("CUDA" if device.type == "cuda" else "a CPU") if setting == "auto" else "asked for"
    what = {"cpu": "our C attention kernels", "triton": "our Triton kernels", "torch": "the torch reference"}[resolved]
    if setting == "auto" and resolved == "torch":
        what += " (our C kernels need cpu_kernels, bf16 and a kernel build for this CPU)"
    return f"{source}: {what}"


def backend_ops(name: str, device: torch.device, cpu_kernels: bool = False):
    """Resolve `attention_backend`. auto: Triton on CUDA; on a CPU our C attention kernel (decode,
    and prefill as per-token decodes) when `cpu_kernels` applies (bf16 on a CPU with a kernel variant), else the
    torch reference."""
    if name == "auto":
        if device.type == "cuda":
            name = "triton"
        elif cpu_kernels:
            return "cpu", CpuKernelForward.attention_ops()
        else:
            name = "torch"
    if name == "torch":
        return name, _TORCH_OPS
    if name == "triton":
        try:
            from workbench_kernels import triton_ops
        except ImportError as e:
            raise ValueError(f"attention_backend='triton' is unavailable here: {e}") from None
        return name, triton_ops
    raise ValueError(f"invalid value {name!r} for setting 'attention_backend'; allowed: 'auto', 'torch', 'triton'")
