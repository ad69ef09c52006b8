"""The CPU fast path: C kernels (cpu_kernels.c) for bf16 decode on x86 with AVX-512 BF16.

Built on first use with the system C compiler into a per-user cache keyed by the source, the
compiler flags and the torch build, then loaded with ctypes (no torch headers, so a build takes
seconds). The library links against the libgomp torch has already loaded, so its parallel loops
share torch's thread pool and `torch.set_num_threads` governs both.

`available()` is False, with `unavailable_reason()` saying why, when the CPU lacks AVX-512 BF16,
there is no compiler, the build fails, or WORKBENCH_CPU_KERNELS=0; callers then use torch.

Layouts (all row-major and contiguous):
    activations and bf16 weights: bfloat16; linear weights [N, K] as in torch;
    int8 weights: q int8 [N, K] with one bfloat16 scale per row (w = q * scale);
    int4 weights: q uint8 [N, K / 2], in runs of 32 values where byte j packs value j (low
    nibble) and value j + 16 (high nibble); scale_low float32 [N, K / group, 2] with
    w = q * scale + low;
    paged KV cache as documented in reference.py (bf16 caches only).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
CFLAGS = ["-O3", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
          "-std=c11", "-Wall", "-Werror"]
# Most activation rows (tokens) the GEMV kernels and the one-call layer take: decode steps of a
# few sequences and speculative verifies (k + 1 tokens); more rows go to oneDNN / torch.
MAX_ROWS = 8

_lib = None
_reason: str | None = None


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _torch_libgomp() -> Path | None:
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench" / "cpu-kernels"


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    gomp = _torch_libgomp()
    link = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-lgomp"]
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(CFLAGS + link + [torch.__version__, cc]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libwbcpu-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
        # Compile with -fopenmp but link torch's libgomp by path: one OpenMP runtime in the process.
        for cmd in ([cc, *CFLAGS, "-c", str(SOURCE), "-o", str(obj)],
                    [cc, "-shared", str(obj), "-o", str(so), *link, "-lm"]):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"building the CPU kernels failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
        os.replace(so, out)  # atomic: a concurrent or interrupted build never leaves a broken library
    return out


_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "wb_gemv_bf16": [_P, _P, _P, _P, _P, _I, _I, _I, _I],
    "wb_gemv_int8": [_P, _P, _P, _P, _P, _I, _I, _I, _I],
    "wb_gemv_int4": [_P, _P, _P, _P, _P, _I, _I, _I, _I],
    "wb_add_rms_norm": [_P, _P, _P, _P, _I, _I, ctypes.c_float],
    "wb_silu_mul": [_P, _P, _I, _I],
    "wb_rope_write_kv": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I],
    "wb_paged_decode": [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float],
    "wb_decode_layer": [_P, _P, _P, _P, _P, _P, _P],
}


def _load():
    global _lib, _reason
    if _lib is not None or _reason is not None:
        return _lib
    if os.environ.get("WORKBENCH_CPU_KERNELS", "1") == "0":
        _reason = "disabled by WORKBENCH_CPU_KERNELS=0"
        return None
    missing = {"avx512f", "avx512bw", "avx512_bf16"} - _cpu_flags()
    if missing:
        _reason = f"this CPU lacks {', '.join(sorted(missing))}"
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (RuntimeError, OSError) as e:
        _reason = str(e)
        return None
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    _lib = lib
    return lib


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def _require():
    lib = _lib or _load()
    if lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_reason}")
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Gemv:
    """A weight bound to its GEMV kernel: `gemv(x)` for x [M <= MAX_ROWS, K] contiguous bf16 returns
    [M, N] bf16. Binding once keeps the per-call cost of a decode step's ~120 matmuls low."""

    __slots__ = ("_fn", "_w", "_aux", "_bias", "_keep", "kind", "n", "k", "group")
    KINDS = ("bf16", "int8", "int4")

    def __init__(self, kind: str, weight: torch.Tensor, aux: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, group: int = 0):
        lib = _require()
        self._fn = {"bf16": lib.wb_gemv_bf16, "int8": lib.wb_gemv_int8, "int4": lib.wb_gemv_int4}[kind]
        self._keep = (weight, aux, bias)  # the pointers below stay valid while these live
        self._w, self._aux, self._bias = weight.data_ptr(), _ptr(aux), _ptr(bias)
        self.kind = kind
        self.n = weight.shape[0]
        self.k = weight.shape[1] * (2 if kind == "int4" else 1)
        self.group = group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.bfloat16)
        self._fn(x.data_ptr(), self._w, self._aux, self._bias, y.data_ptr(), m, self.n, self.k, self.group)
        return y

    def descriptor(self) -> _Linear:
        return _Linear(self.KINDS.index(self.kind), self._w, self._aux, self._bias, self.n, self.k, self.group)


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I), ("w", _P), ("aux", _P), ("bias", _P), ("n", _I), ("k", _I), ("group", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("ln1", _P), ("ln2", _P), ("eps", ctypes.c_float)]


class _Step(ctypes.Structure):
    _fields_ = [(n, _I) for n in ("T", "H", "Hq", "Hkv", "D", "I")] + [
        ("pos", _P), ("slots", _P), ("tables", _P), ("lens", _P), ("W", _I), ("bs", _I), ("cos", _P), ("sin", _P),
        ("scale", ctypes.c_float)] + [(n, _P) for n in ("h", "qkv", "q", "att", "o", "gu", "act", "xf")]


class DecodeStep:
    """What every layer of one decode step shares: positions, cache slots, block tables and the
    scratch activations of `wb_decode_layer` (T <= MAX_ROWS tokens, each attending as a one-query
    decode over its own causal context)."""

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 block_size: int, positions, slot_mapping, block_tables, seq_lens, cos, sin, scale: float):
        t = positions.shape[0]
        bf = torch.bfloat16
        self._scratch = [torch.empty(t, n, dtype=bf) for n in (
            hidden, (heads + 2 * kv_heads) * head_dim, heads * head_dim, heads * head_dim, hidden, 2 * intermediate,
            intermediate)]
        xf = torch.empty(t * max(hidden, heads * head_dim, intermediate), dtype=torch.float32)
        self._keep = (positions, slot_mapping, block_tables, seq_lens, cos, sin, xf)
        self.t, self.hidden = t, hidden
        self.struct = _Step(t, hidden, heads, kv_heads, head_dim, intermediate, positions.data_ptr(),
                            slot_mapping.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), block_tables.shape[1],
                            block_size, cos.data_ptr(), sin.data_ptr(), scale, *(x.data_ptr() for x in self._scratch),
                            xf.data_ptr())


class DecodeLayer:
    """A decoder layer's weights bound to `wb_decode_layer`: norm, fused qkv, RoPE + KV write, paged
    attention, o, norm, gate/up, SiLU*up, down, in one call and one parallel region."""

    def __init__(self, qkv: Gemv, o: Gemv, gate_up: Gemv, down: Gemv, ln1: torch.Tensor, ln2: torch.Tensor,
                 eps: float):
        self._keep = (qkv, o, gate_up, down, ln1, ln2)
        self.struct = _Layer(qkv.descriptor(), o.descriptor(), gate_up.descriptor(), down.descriptor(),
                             ln1.data_ptr(), ln2.data_ptr(), eps)
        self._fn = _require().wb_decode_layer

    def __call__(self, step: DecodeStep, x: torch.Tensor, delta: torch.Tensor | None, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> torch.Tensor:
        """Adds `delta` into the residual stream `x` (in place); returns this layer's MLP output."""
        out = torch.empty(step.t, step.hidden, dtype=torch.bfloat16)
        self._fn(ctypes.byref(self.struct), ctypes.byref(step.struct), x.data_ptr(), _ptr(delta), out.data_ptr(),
                 k_cache.data_ptr(), v_cache.data_ptr())
        return out


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] bf16, w [N, K] bf16 -> [M, N] bf16."""
    return Gemv("bf16", w, bias=bias)(x.contiguous())


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return Gemv("int8", q, scale, bias)(x.contiguous())


def gemv_int4(x: torch.Tensor, q: torch.Tensor, scale_low: torch.Tensor, group: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    return Gemv("int4", q, scale_low, bias, group)(x.contiguous())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15, [N, K] (K % 32 == 0) -> the nibble layout of the int4 kernel, uint8 [N, K/2]."""
    n, k = q.shape
    runs = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += delta in place (when given); returns RMSNorm(x) * weight. x [T, H] contiguous bf16."""
    t, h = x.shape
    out = torch.empty_like(x)
    _require().wb_add_rms_norm(x.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(), t, h, eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up, [T, I]."""
    t, two_i = gate_up.shape
    out = torch.empty(t, two_i // 2, dtype=gate_up.dtype)
    _require().wb_silu_mul(gate_up.data_ptr(), out.data_ptr(), t, two_i // 2)
    return out


def rope_write_kv(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, num_q_heads: int) -> torch.Tensor:
    """Rotate q and k of a fused qkv [T, (Hq + 2 Hkv) D]; write k and v to the bf16 paged cache;
    return q [T, Hq, D]."""
    _, _, hkv, d = k_cache.shape
    t = qkv.shape[0]
    q = torch.empty(t, num_q_heads, d, dtype=qkv.dtype)
    _require().wb_rope_write_kv(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          slot_mapping.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                          t, num_q_heads, hkv, d)
    return q


def _bf16_cache(q, k_cache, k_scale) -> bool:
    """Whether the attention kernel takes these operands (a bf16 query over an unquantised bf16
    cache); otherwise the torch reference runs."""
    return k_scale is None and k_cache.dtype == torch.bfloat16 and q.dtype == torch.bfloat16


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, k_scale=None, v_scale=None):
    """Same contract as reference.decode_attention_ref, for bf16 caches."""
    if not _bf16_cache(q, k_cache, k_scale):
        from .reference import decode_attention_ref

        return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, k_scale, v_scale)
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    _require().wb_paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                         out.data_ptr(), b, hq, hkv, d, bs, tables.shape[1], sm_scale)
    return out


def extend_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sm_scale, k_scale=None,
                     v_scale=None):
    """Same contract as reference.extend_attention_ref, for bf16 caches: every new token is a
    one-query decode over its own causal context (its sequence's blocks, length = position + 1).
    Causal prefill needs no mask and no gathered copy of the context this way, and the decode
    kernel's work per query is proportional to that query's context, so the masked half is
    never computed."""
    if not _bf16_cache(q, k_cache, k_scale):
        from .reference import extend_attention_ref

        return extend_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sm_scale,
                                    k_scale, v_scale)
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    # token i of sequence b sits at position seq_lens[b] - counts[b] + i
    first = (seq_lens.long() - counts)[owner]
    offset = torch.arange(owner.shape[0]) - cu_seqlens_q[:-1].long()[owner]
    lens = (first + offset + 1).to(torch.int32)
    return decode_attention(q, k_cache, v_cache, block_tables[owner], lens, sm_scale)


def supports_decode(head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    return head_dim % 16 == 0 and head_dim <= 256 and num_q_heads // num_kv_heads <= 16
