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
import torch.nn.functional as F
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

    @property
    def nbytes(self) -> int:
        scales = (self.k_scale or []) + (self.v_scale or [])
        return sum(t.nbytes for t in self.k + self.v + scales)

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


CPU_KV_MB = 512  # the embedded model's W64 working set several times over (23 KB a token in bf16)
# Of the GPU memory free once the weights are there: the rest leaves room for a draft's cache as
# large (speculative decoding's self-int4 draft has the target's layout), a re-layout's copy,
# activations and CUDA graphs' pools; vLLM takes 90% of the whole GPU and switches nothing live.
CUDA_KV_SHARE = 0.4


def kv_cache_budget(setting_mb: int | None, device: torch.device, free_bytes: int | None = None) -> int:
    """Bytes for the KV cache: `kv_cache_memory_mb` when set, else 512 MB on a CPU and on CUDA a
    share of the memory free once the weights are loaded (512 MB would hold 4,096 tokens of an 8B
    model: a W64 run of 2k-token contexts needs 32 times that)."""
    if setting_mb is not None:
        return setting_mb * 2**20
    if device.type != "cuda":
        return CPU_KV_MB * 2**20
    if free_bytes is None:
        torch.cuda.empty_cache()  # blocks freed since loading (the parts of merged weights) count as used until then
        free_bytes = torch.cuda.mem_get_info(device)[0]
    return int(CUDA_KV_SHARE * free_bytes)


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
    # The SDPA prefill's share of the step (PrefillPaths.prepare); None: our extend kernel takes it all
    sdpa: SdpaSplit | None = None


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
        nd = meta.num_decode
        if nd == q.shape[0]:
            return self._decode(q, layer, meta)
        if not nd:
            return self._extend(q, layer, meta)
        out = torch.empty_like(q)
        out[:nd] = self._decode(q[:nd], layer, meta)
        out[nd:] = self._extend(q[nd:], layer, meta)
        return out

    def _window(self, layer: int) -> dict:
        return {"window": self.windows[layer]} if self.windows[layer] else {}

    def _decode(self, q, layer: int, meta: AttnMetadata) -> torch.Tensor:
        if meta.decode_num_splits:
            splits = {"num_splits": meta.decode_num_splits}
        elif meta.decode_max_seq_len:
            splits = {"max_seq_len": meta.decode_max_seq_len}
        else:
            splits = {}
        k_cache, v_cache, k_scale, v_scale = self.kv.layer(layer)
        return self.ops.decode_attention(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.scale,
            k_scale,
            v_scale,
            **self._window(layer),
            **splits,
        )

    def _extend(self, q, layer: int, meta: AttnMetadata) -> torch.Tensor:
        return self._kernel_extend(q, layer, meta.ext_block_tables, meta.ext_cu_seqlens_q, meta.ext_seq_lens)

    def _kernel_extend(self, q, layer: int, block_tables, cu_seqlens_q, seq_lens) -> torch.Tensor:
        k_cache, v_cache, k_scale, v_scale = self.kv.layer(layer)
        return self.ops.extend_attention(
            q,
            k_cache,
            v_cache,
            block_tables,
            cu_seqlens_q,
            seq_lens,
            self.scale,
            k_scale,
            v_scale,
            **self._window(layer),
        )

    def choose_prefill(self, setting: str, num_heads: int, max_model_len: int) -> None:
        """The `prefill_attention` setting: the torch reference has one path."""

    def report(self) -> dict:
        """status()'s attention fields."""
        return {
            "attention_backend": self.name,
            "attention_backend_reason": self.reason,
            "prefill_attention": None,
            "prefill_attention_reason": None,
        }


class PrefillPaths(AttentionBackend):
    """A backend with two paths for prompts: our extend kernel, or torch's SDPA over the keys RoPE
    wrote into the cache (FlashAttention or cuDNN on CUDA; on a CPU torch's flash attention, whose
    matmuls take AMX where the CPU has it). `choose_prefill` (the `prefill_attention` setting)
    decides, by measurement at `auto`. SDPA takes a step's prompts with no cached context (and, where
    `sdpa_cached`, those after cached keys: later chunks, prefix hits), the kernel the others."""

    kernel_words = "our kernel"
    probe_tokens = 2048  # the prompt auto measures both paths on (capped at max_model_len)
    auto_min_tokens = 1  # the shortest prompt SDPA serves once auto picked it
    prefill = "kernel"  # the prompts' path: "kernel" or "sdpa"
    prefill_reason = ""
    sdpa_min_tokens = 1  # the shortest prompt SDPA serves
    sdpa_cached = False  # whether SDPA also serves sequences that read cached keys (masked)

    def measures(self, device: torch.device) -> str | None:
        """None where auto measures both paths on `device`; else why it keeps the kernel unmeasured."""
        return None

    def prepare(self, meta: AttnMetadata, tables: list[tuple[list[int], int]], positions: list[int]) -> None:
        if self.prefill == "sdpa":
            nd = meta.num_decode
            bs = self.kv.k[0].shape[1]
            meta.sdpa = sdpa_split(
                tables[nd:], positions, nd, self.sdpa_min_tokens, self.sdpa_cached, bs, meta.slot_mapping.device
            )

    def _extend(self, q, layer: int, meta: AttnMetadata) -> torch.Tensor:
        split = meta.sdpa
        if split is None or self.windows[layer]:  # SDPA's mask would be a dense tensor
            return super()._extend(q, layer, meta)
        slots = meta.slot_mapping[meta.num_decode :]
        out = sdpa_prompts(q, self.kv.k[layer], self.kv.v[layer], slots, split.prompts, self.scale)
        if split.rest is not None:
            r = split.rest
            out[r.rows] = self._kernel_extend(q[r.rows], layer, r.block_tables, r.cu_seqlens_q, r.seq_lens)
        return out

    def choose_prefill(self, setting: str, num_heads: int, max_model_len: int) -> None:
        self.sdpa_min_tokens = 1
        probe = min(self.probe_tokens, max_model_len)
        unmeasured = self.measures(self.kv.k[0].device)
        if self.kv.k_scale is not None:  # the runner chooses again whenever the cache is re-laid out
            self.prefill = "kernel"
            self.prefill_reason = f"a quantised KV cache: {self.kernel_words} (SDPA reads 16-bit keys)"
        elif setting != "auto":
            what = "torch's SDPA" if setting == "sdpa" else self.kernel_words
            scope = "" if self.sdpa_cached else " with no cached context"
            self.prefill, self.prefill_reason = setting, f"asked for: {what} for prompts{scope}"
        elif unmeasured:
            self.prefill, self.prefill_reason = "kernel", unmeasured
        else:
            try:
                t = measure_prefill(self, num_heads, probe)
            except Exception as e:  # a path that cannot run here must not stop the engine: the kernel serves
                self.prefill = "kernel"
                self.prefill_reason = (
                    f"auto: {self.kernel_words} (measuring both paths failed: {type(e).__name__}: {e})"
                )
                return
            self.pick_prefill(t, num_heads, probe)

    def pick_prefill(self, times: dict[str, float], num_heads: int, probe_tokens: int) -> None:
        """auto's choice from `measure_prefill`'s seconds per call of each path."""
        self.prefill = "sdpa" if times["sdpa"] < times["kernel"] else "kernel"
        self.sdpa_min_tokens = self.auto_min_tokens
        hkv, d = self.kv.k[0].shape[2:]
        self.prefill_reason = (
            f"auto, measured on one {probe_tokens}-token prompt at {num_heads}/{hkv} heads, d{d}: "
            f"{self.kernel_words} {times['kernel'] * 1e3:.3f} ms, SDPA {times['sdpa'] * 1e3:.3f} ms"
        )
        if self.prefill == "sdpa":
            which = (
                "new tokens (after cached keys too, masked)" if self.sdpa_cached else "tokens with no cached context"
            )
            self.prefill_reason += (
                f"; SDPA serves prompts of >= {self.auto_min_tokens} {which}, {self.kernel_words} the rest"
            )

    def report(self) -> dict:
        return {**super().report(), "prefill_attention": self.prefill, "prefill_attention_reason": self.prefill_reason}


class CpuKernelAttention(PrefillPaths):
    """Our C attention kernels (the CPU fast path's), which also serve the one-call layer kernel's
    small steps. A CPU has no launches to amortise: where SDPA is measured faster, it takes prompts
    from 64 new tokens (at 16 the two were equal), later chunks and prefix hits too, masked. On an
    AMX host our prefill kernel multiplies on AMX and leads SDPA 1.4-2.6x from 128 new tokens (on
    AVX-512 alone SDPA led it 1.4-2.9x there; docs/benchmarks.md)."""

    kernel_words = "our C kernel"
    probe_tokens = 512
    auto_min_tokens = 64
    sdpa_cached = True

    def choose_prefill(self, setting: str, num_heads: int, max_model_len: int) -> None:
        hkv, d = self.kv.k[0].shape[2:]
        bf16_reads = self.kv.k[0].dtype in (torch.bfloat16, torch.int8)  # an int8 cache is widened to bf16
        amx = bf16_reads and CpuKernelForward.prefill_on_amx(num_heads, hkv, d)
        self.kernel_words = "our C kernel (AMX)" if amx else "our C kernel"
        super().choose_prefill(setting, num_heads, max_model_len)

    def prepare(self, meta: AttnMetadata, tables: list[tuple[list[int], int]], positions: list[int]) -> None:
        meta.cpu_tokens = CpuKernelForward.token_queries(tables, positions, meta.slot_mapping.device)
        super().prepare(meta, tables, positions)


class TritonAttention(PrefillPaths):
    """Our Triton kernels (the GPU's backend). auto measures SDPA against them on CUDA only."""

    kernel_words = "our Triton kernel"
    # shorter prompts are launch-bound on either path, and our kernel takes all of a step's prompts
    # in one launch where SDPA takes one call per prompt
    auto_min_tokens = 512

    def measures(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "auto off CUDA: our Triton kernel, unmeasured (interpreted here, to check it)"
        return None

    def prepare(self, meta: AttnMetadata, tables: list[tuple[list[int], int]], positions: list[int]) -> None:
        nd = meta.num_decode
        if nd:  # the first num_decode tokens are decodes: each one's context ends at it
            meta.decode_max_seq_len = max(positions[:nd]) + 1
        super().prepare(meta, tables, positions)


_PREFILL_TIMES: dict[tuple, dict[str, float]] = {}  # measured once per process and shape


@dataclass
class SdpaSplit:
    """A step's extend sequences as the SDPA path takes them (`SdpaPrompt`s) and the others, for
    the kernel (None: there are none)."""

    prompts: list[SdpaPrompt]
    rest: SimpleNamespace | None  # rows [R] (their tokens), block_tables, cu_seqlens_q, seq_lens


@dataclass
class SdpaPrompt:
    """One sequence's new tokens for SDPA: the first's index among the step's extend tokens and
    their count; with cached context, the slots of all its keys (context, then the new tokens')
    and the mask that lets new token i see keys up to its own position (None: a fresh prompt,
    whose keys are its new tokens' own slots, causal)."""

    at: int
    n: int
    key_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


def sdpa_split(tables, positions: list[int], first: int, min_tokens: int, cached: bool, block_size: int, device):
    """Split a step's extend sequences (`tables`: block table and token count, their tokens from
    flat index `first`): those of at least `min_tokens` new tokens for SDPA (with `cached`, also
    those that read cached keys: later chunks, prefix hits), the rest for the kernel. None when
    SDPA takes none."""
    prompts, rest, rows, at = [], [], [], 0
    dev = torch.device(device)
    for table, n in tables:
        start = positions[first + at]
        if n >= min_tokens and (start == 0 or cached):
            if start == 0:
                prompts.append(SdpaPrompt(at, n))
            else:
                span = start + n
                slots = [table[p // block_size] * block_size + p % block_size for p in range(span)]
                mask = torch.ones(n, span, dtype=torch.bool).tril(start)
                prompts.append(SdpaPrompt(at, n, to_device(slots, torch.int64, dev), mask.to(dev)))
        else:
            rest.append((table, n, start + n))
            rows.extend(range(at, at + n))
        at += n
    if not prompts:
        return None
    if not rest:
        return SdpaSplit(prompts, None)
    cu = [0]
    for _, n, _ in rest:
        cu.append(cu[-1] + n)
    i32 = torch.int32
    return SdpaSplit(
        prompts,
        SimpleNamespace(
            rows=to_device(rows, torch.int64, dev),
            block_tables=pad_tables([t for t, _, _ in rest], dev),
            cu_seqlens_q=to_device(cu, i32, dev),
            seq_lens=to_device([n for _, _, n in rest], i32, dev),
        ),
    )


def sdpa_prompts(q, k_cache, v_cache, slots, prompts: list[SdpaPrompt], scale: float) -> torch.Tensor:
    """Causal attention of `prompts` (q [T, Hq, D]; `slots`: where the T tokens' keys are), one SDPA
    call each over its keys and values read back from the cache, where RoPE wrote them. Rows of no
    prompt are left unset."""
    hkv, d = k_cache.shape[2:]
    k_all, v_all = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    gqa = q.shape[1] != hkv
    out = torch.empty_like(q)
    for p in prompts:
        s = slice(p.at, p.at + p.n)
        keys = slots[s] if p.key_slots is None else p.key_slots
        k, v = k_all.index_select(0, keys), v_all.index_select(0, keys)
        # [1, H, n, D] views: the fused (flash, cuDNN) kernels take 4-D inputs only, 3-D ones fall to the math path
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[s], k, v))
        causal = p.mask is None
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[s] = o[0].transpose(0, 1)
    return out


def measure_prefill(backend: PrefillPaths, num_heads: int, n: int) -> dict[str, float]:
    """Seconds per call of our extend kernel and of `sdpa_prompts` on one causal `n`-token prompt at
    the backend's cache shape (random values on a scratch cache), the median of a few runs."""
    k0 = backend.kv.k[0]
    _, block_size, hkv, d = k0.shape
    key = (backend.name, str(k0.device), k0.dtype, num_heads, hkv, d, block_size, n)
    if key not in _PREFILL_TIMES:
        dev, dt = k0.device, k0.dtype
        gen = torch.Generator(device=dev).manual_seed(0)
        blocks = -(-n // block_size)
        kc, vc = (torch.randn(blocks, block_size, hkv, d, generator=gen, device=dev, dtype=dt) for _ in "kv")
        q = torch.randn(n, num_heads, d, generator=gen, device=dev, dtype=dt)
        table = torch.arange(blocks, dtype=torch.int32, device=dev).view(1, blocks)
        cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        slots = torch.arange(n, device=dev)
        paths = {
            "kernel": lambda: backend.ops.extend_attention(q, kc, vc, table, cu, lens, backend.scale),
            "sdpa": lambda: sdpa_prompts(q, kc, vc, slots, [SdpaPrompt(0, n)], backend.scale),
        }
        from workbench_kernels.bench import Timer

        timer = Timer(dev, flush_l2=False)  # no 256 MB flush buffer at an engine's start
        _PREFILL_TIMES[key] = {name: timer(fn, iters=5, warmup=2) for name, fn in paths.items()}
    return _PREFILL_TIMES[key]


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
