"""The CPU fast path: C kernels (cpu_kernels.c over the vector layer cpu_vec.h) for bf16 decode,
one source built per instruction set, the best variant the CPU runs picked at load time.

Variants, best first: x86 "avx512_bf16" (vdpbf16ps, and VNNI for int8), "avx512", "avx2" (AVX2 + FMA + F16C), and on
ARM "neon"; "portable" (plain C the compiler vectorises) runs anywhere. Each is built on first use
with the system C compiler into a per-user cache keyed by the sources, the variant's flags and the
torch build, then loaded with ctypes (no torch headers, so a build takes seconds). The library links
against the libgomp torch has already loaded, so its parallel loops share torch's thread pool and
`torch.set_num_threads` governs both.

`WORKBENCH_CPU_ISA=<variant>` forces a variant (an AVX-512 host then runs and tests the AVX2 path);
one the CPU cannot execute is refused, with the reason, for the best one it can.
`WORKBENCH_CPU_KERNELS=0` disables the kernels. `variant()` / `variant_reason()` say what runs and
why; `available()` is False, with `unavailable_reason()`, when nothing could be built or loaded.

Layouts (all row-major and contiguous):
    activations and bf16 weights: bfloat16; linear weights [N, K] as in torch;
    int8 weights: q int8 [N, K] with one bfloat16 scale per row (w = q * scale);
    int4 weights: q uint8 [N, K / 2], in runs of 32 values where byte j packs value j (low
    nibble) and value j + 16 (high nibble); scale_zero bfloat16 [N, K / group, 2] with
    w = (q - 8) * scale + zero (torch's convention and values), groups a power of two >= 32;
    paged KV cache as documented in reference.py (bf16 caches only; head_dim % 16 == 0).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from . import hostmem

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_kernels.c", HERE / "cpu_vec.h")
COMMON_FLAGS = ["-O3", "-fPIC", "-fopenmp", "-std=c11", "-ffp-contract=off", "-Wall", "-Werror"]
# Compiler flags, and the CPU features (/proc/cpuinfo names) each variant needs, best first per
# architecture. -ffp-contract=off: multiplies and adds are fused only where the source says so,
# so every variant keeps torch's rounding points in the elementwise ops.
VARIANT_FLAGS = {
    "avx512_bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "neon": [],  # NEON (Advanced SIMD) is part of every aarch64 CPU
    "portable": ["-DWB_PORTABLE"],
}
VARIANT_NEEDS = {
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "fma"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "fma"),
    "avx2": ("avx2", "fma", "f16c"),
    "neon": ("asimd",),
    "portable": (),
}
ARCH_VARIANTS = {"x86_64": ("avx512_bf16", "avx512", "avx2", "portable"), "aarch64": ("neon", "portable")}
# Most activation rows (tokens) the GEMV kernels take: decode steps of a few sequences and
# speculative verifies (k + 1 tokens); more rows go to the GEMM path (`gemm_path`). The one-call
# layer takes as many, or FUSED_MAX_ROWS where every linear of the layer has its bf16 tiles.
MAX_ROWS = 8
FUSED_MAX_ROWS = 64


def _arch() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features` in /proc/cpuinfo)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def variants() -> tuple[str, ...]:
    """This architecture's variants, best first (only "portable" on an unknown one)."""
    return ARCH_VARIANTS.get(_arch(), ("portable",))


def missing(variant: str) -> list[str]:
    """The CPU features `variant` needs that this CPU lacks (empty: it runs here)."""
    if variant not in variants():
        return [f"an {_arch()} build ({variant} is for another architecture)"]
    flags = cpu_flags()
    return [f for f in VARIANT_NEEDS[variant] if f not in flags]


def runnable() -> list[str]:
    """The variants this CPU executes, best first."""
    return [v for v in variants() if not missing(v)]


def _torch_libgomp() -> Path | None:
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libgomp*.so*"))
    return found[0] if found else None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "workbench" / "cpu-kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def build(variant: str) -> Path:
    """Compile `variant` (cached); raises RuntimeError saying what failed."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc/cc) on PATH")
    gomp = _torch_libgomp()
    link = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else ["-lgomp"]
    flags = COMMON_FLAGS + VARIANT_FLAGS[variant]
    src = b"".join(p.read_bytes() for p in SOURCES)
    key = hashlib.sha256(src + " ".join(flags + link + [torch.__version__, cc]).encode()).hexdigest()[:16]
    out = _cache_dir() / f"libwbcpu-{variant}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj, so = Path(tmp) / "k.o", Path(tmp) / "k.so"
        # Compile with -fopenmp but link torch's libgomp by path: one OpenMP runtime in the process.
        for cmd in (
            [cc, *flags, "-c", str(SOURCES[0]), "-o", str(obj)],
            [cc, "-shared", str(obj), "-o", str(so), *link, "-lm"],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode:
                raise RuntimeError(f"building the {variant} CPU kernels failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
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
    "wb_paged_decode_i8": [_P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float],
    "wb_paged_extend": [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float],
    "wb_decode_layer": [_P, _P, _P, _P, _P, _P, _P],
    "wb_decode_layers": [_P, _I, _P, _P, _P, _P, _P, _P, _P],
    "wb_set_gemv_ymm": [_I],
    "wb_gemm_tiles": [_P, _P, _P, _P, _I, _I, _I],
    "wb_gemm_q8_tiles": [_P, _P, _P, _P, _P, _I, _I, _I],
    "wb_gemm_q4_tiles": [_P, _P, _P, _P, _P, _I, _I, _I, _I],
    "wb_set_amx": [_I],
}

_libs: dict[str, ctypes.CDLL] = {}
_errors: dict[str, str] = {}


def load(variant: str) -> ctypes.CDLL:
    """The built and loaded library of `variant`; raises RuntimeError (cached) if it can't be had."""
    if variant in _libs:
        return _libs[variant]
    if variant not in _errors:
        lacks = missing(variant)
        try:
            if lacks:
                raise RuntimeError(f"this CPU lacks {', '.join(lacks)}")
            lib = ctypes.CDLL(str(build(variant)))
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, None
            lib.wb_variant.restype = ctypes.c_char_p
            for name in ("wb_gemv_ymm", "wb_amx", "wb_amx_init"):
                getattr(lib, name).argtypes, getattr(lib, name).restype = [], _I
            lib.wb_extend_amx.argtypes, lib.wb_extend_amx.restype = [_I, _I, _I], _I
            assert lib.wb_variant().decode() == variant, "the library was built for another variant"
            _libs[variant] = lib
            return lib
        except (RuntimeError, OSError, AttributeError, AssertionError) as e:
            _errors[variant] = str(e)
    raise RuntimeError(_errors[variant])


class _Selection:
    """Which variant serves (the module-level kernels and newly bound weights use it) and why."""

    lib: ctypes.CDLL | None = None
    variant: str | None = None
    reason: str = ""
    chosen = False


_sel = _Selection()


def _choose() -> None:
    if _sel.chosen:
        return
    _sel.chosen = True
    if os.environ.get("WORKBENCH_CPU_KERNELS", "1") == "0":
        _sel.reason = "disabled by WORKBENCH_CPU_KERNELS=0"
        return
    forced = os.environ.get("WORKBENCH_CPU_ISA", "").strip().lower()
    note = ""
    order = list(variants())
    if forced:
        if forced not in VARIANT_FLAGS:
            note = f"WORKBENCH_CPU_ISA={forced!r} is not a variant (allowed: {', '.join(VARIANT_FLAGS)}); "
        elif missing(forced):
            note = f"WORKBENCH_CPU_ISA={forced} refused ({'; '.join(missing(forced))}); "
        else:
            order = [forced] + [v for v in order if v != forced]
    failures = []
    for v in order:
        try:
            _sel.lib = load(v)
        except RuntimeError as e:
            failures.append((v, str(e).splitlines()[0]))
            continue
        _sel.variant = v
        _apply_gemv_width()
        _apply_amx()
        if v == forced:
            _sel.reason = f"forced by WORKBENCH_CPU_ISA={forced}"
        elif not failures:
            _sel.reason = note + "the best variant for this CPU"
        else:  # the variant just above this one says why it is not used, e.g. "this CPU lacks avx512f"
            _sel.reason = note + f"not {failures[-1][0]}: {failures[-1][1]}"
        return
    _sel.reason = note + "; ".join(f"{f}: {why}" for f, why in failures)


def use(variant: str | None) -> None:
    """Serve with `variant` from now on (None: choose again as at load time). Weights bind their
    kernels when they are laid out, so already bound ones keep theirs; the engine re-lays out."""
    if variant is None:
        _sel.chosen, _sel.lib, _sel.variant = False, None, None
        _choose()
        return
    _sel.lib, _sel.variant, _sel.reason, _sel.chosen = load(variant), variant, "chosen by use()", True
    _apply_gemv_width()
    _apply_amx()


def available() -> bool:
    _choose()
    return _sel.lib is not None


def variant() -> str | None:
    """The variant in use ("avx512_bf16", "avx512", "avx2", "neon", "portable"), None if none."""
    _choose()
    return _sel.variant


def variant_reason() -> str:
    """Why this variant serves (or why none does), e.g. "not avx512_bf16: this CPU lacks avx512f"."""
    _choose()
    return _sel.reason


def unavailable_reason() -> str | None:
    return None if available() else _sel.reason


def _require():
    _choose()
    if _sel.lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_sel.reason}")
    return _sel.lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class Gemv:
    """A weight bound to its GEMV kernel: `gemv(x)` for x [M <= MAX_ROWS, K] contiguous bf16 returns
    [M, N] bf16. Binding once keeps the per-call cost of a decode step's ~120 matmuls low."""

    __slots__ = ("_fn", "_w", "_aux", "_bias", "_keep", "kind", "n", "k", "group")
    KINDS = ("bf16", "int8", "int4")

    def __init__(
        self,
        kind: str,
        weight: torch.Tensor,
        aux: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        group: int = 0,
    ):
        lib = _require()
        self._fn = {"bf16": lib.wb_gemv_bf16, "int8": lib.wb_gemv_int8, "int4": lib.wb_gemv_int4}[kind]
        self._keep = (weight, aux, bias)  # the pointers below stay valid while these live
        self._w, self._aux, self._bias = weight.data_ptr(), _ptr(aux), _ptr(bias)
        self.kind = kind
        self.n = weight.shape[0]
        self.k = weight.shape[1] * (2 if kind == "int4" else 1)
        self.group = group
        if kind == "int4" and (group < 32 or group & (group - 1) or self.k % group):  # so k % 32 == 0 too
            raise ValueError(
                f"the int4 kernel takes rows of a multiple of 32 values in groups of a power of two >= 32 "
                f"that divides them; got {self.k} values in groups of {group}"
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.bfloat16)
        self._fn(x.data_ptr(), self._w, self._aux, self._bias, y.data_ptr(), m, self.n, self.k, self.group)
        return y

    @property
    def operands(self) -> tuple:
        """The tensors the kernel reads (weight, aux, bias; None where absent)."""
        return self._keep

    def descriptor(self, tiles: Tiles | None = None) -> _Linear:
        """This weight for the one-call layer; with `tiles` (the same bf16 weights packed for the
        tiles), steps of more than MAX_ROWS rows multiply on them."""
        return _Linear(
            self.KINDS.index(self.kind),
            self._w,
            self._aux,
            self._bias,
            self.n,
            self.k,
            self.group,
            tiles.ptr if tiles is not None else None,
        )


class _Linear(ctypes.Structure):
    _fields_ = [("kind", _I), ("w", _P), ("aux", _P), ("bias", _P), ("n", _I), ("k", _I), ("group", _I), ("tiles", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("ln1", _P),
        ("ln2", _P),
        ("eps", ctypes.c_float),
    ]


class _Step(ctypes.Structure):
    _fields_ = (
        [(n, _I) for n in ("T", "H", "Hq", "Hkv", "D", "I")]
        + [
            ("pos", _P),
            ("slots", _P),
            ("tables", _P),
            ("lens", _P),
            ("W", _I),
            ("bs", _I),
            ("cos", _P),
            ("sin", _P),
            ("scale", ctypes.c_float),
        ]
        + [(n, _P) for n in ("h", "qkv", "q", "att", "o", "gu", "act", "xf")]
    )


class DecodeStep:
    """What every layer of one decode step shares: positions, cache slots, block tables and the
    scratch activations of `wb_decode_layer` (T <= MAX_ROWS tokens, each attending as a one-query
    decode over its own causal context)."""

    def __init__(
        self,
        *,
        hidden: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        intermediate: int,
        block_size: int,
        positions,
        slot_mapping,
        block_tables,
        seq_lens,
        cos,
        sin,
        scale: float,
    ):
        t = positions.shape[0]
        bf = torch.bfloat16
        self._scratch = [
            torch.empty(t, n, dtype=bf)
            for n in (
                hidden,
                (heads + 2 * kv_heads) * head_dim,
                heads * head_dim,
                heads * head_dim,
                hidden,
                2 * intermediate,
                intermediate,
            )
        ]
        # the GEMVs' activation scratch: fp32 copies, or the quantised kernels' re-laid-out rows
        # (under 2 K + 128 floats a row: cpu_kernels.c, quant_scratch_bytes)
        xf = torch.empty(t * (2 * max(hidden, heads * head_dim, intermediate) + 128), dtype=torch.float32)
        self._keep = (positions, slot_mapping, block_tables, seq_lens, cos, sin, xf)
        self.t, self.hidden = t, hidden
        self.struct = _Step(
            t,
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            positions.data_ptr(),
            slot_mapping.data_ptr(),
            block_tables.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.shape[1],
            block_size,
            cos.data_ptr(),
            sin.data_ptr(),
            scale,
            *(x.data_ptr() for x in self._scratch),
            xf.data_ptr(),
        )


class DecodeLayer:
    """A decoder layer's weights bound to `wb_decode_layer`: norm, fused qkv, RoPE + KV write, paged
    attention, o, norm, gate/up, SiLU*up, down, in one call and one parallel region."""

    def __init__(
        self,
        qkv: Gemv,
        o: Gemv,
        gate_up: Gemv,
        down: Gemv,
        ln1: torch.Tensor,
        ln2: torch.Tensor,
        eps: float,
        tiles: tuple[Tiles | None, ...] = (None,) * 4,
    ):
        self._keep = (qkv, o, gate_up, down, ln1, ln2, tiles)
        self.struct = _Layer(
            *(g.descriptor(t) for g, t in zip((qkv, o, gate_up, down), tiles)), ln1.data_ptr(), ln2.data_ptr(), eps
        )
        self.max_rows = FUSED_MAX_ROWS if all(t is not None for t in tiles) else MAX_ROWS
        self._fn = _require().wb_decode_layer

    def __call__(
        self,
        step: DecodeStep,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Adds `delta` into the residual stream `x` (in place); returns this layer's MLP output."""
        out = torch.empty(step.t, step.hidden, dtype=torch.bfloat16)
        self._fn(
            ctypes.byref(self.struct),
            ctypes.byref(step.struct),
            x.data_ptr(),
            _ptr(delta),
            out.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        return out


class DecodeStack:
    """Consecutive DecodeLayers in one call (one parallel region for the whole decoder of a small
    step), over their layers' bf16 caches."""

    def __init__(self, layers: list[DecodeLayer], k_caches: list[torch.Tensor], v_caches: list[torch.Tensor]):
        n = len(layers)
        self._keep = (layers, k_caches, v_caches)
        self._layers = (_Layer * n)(*(layer.struct for layer in layers))
        self._k = (_P * n)(*(k.data_ptr() for k in k_caches))
        self._v = (_P * n)(*(v.data_ptr() for v in v_caches))
        self.n = n
        self._fn = _require().wb_decode_layers

    def __call__(self, step: DecodeStep, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """Adds every layer into the residual stream `x` (in place) but the last one's MLP output,
        which it returns."""
        out = torch.empty(step.t, step.hidden, dtype=torch.bfloat16)
        tmp = torch.empty_like(out)
        self._fn(
            self._layers,
            self.n,
            ctypes.byref(step.struct),
            x.data_ptr(),
            _ptr(delta),
            out.data_ptr(),
            tmp.data_ptr(),
            self._k,
            self._v,
        )
        return out


def gemv_bf16(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] bf16, w [N, K] bf16 -> [M, N] bf16."""
    return Gemv("bf16", w, bias=bias)(x.contiguous())


def gemv_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return Gemv("int8", q, scale, bias)(x.contiguous())


def gemv_int4(
    x: torch.Tensor, q: torch.Tensor, scale_zero: torch.Tensor, group: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return Gemv("int4", q, scale_zero, bias, group)(x.contiguous())


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15, [N, K] (K % 32 == 0) -> the nibble layout of the int4 kernel, uint8 [N, K/2]."""
    n, k = q.shape
    runs = q.to(torch.uint8).view(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """`pack_int4`'s inverse: uint8 [N, K/2] nibbles -> codes 0..15, int32 [N, K]."""
    n, half = packed.shape
    runs = packed.view(n, half // 16, 1, 16)
    return torch.cat((runs & 15, runs >> 4), dim=2).reshape(n, 2 * half).to(torch.int32)


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
    _require().wb_rope_write_kv(
        qkv.data_ptr(),
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        slot_mapping.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        t,
        num_q_heads,
        hkv,
        d,
    )
    return q


def _bf16_cache(q, k_cache, k_scale) -> bool:
    """Whether the attention kernel takes these operands (a bf16 query over an unquantised bf16
    cache); otherwise the torch reference runs."""
    return k_scale is None and k_cache.dtype == torch.bfloat16 and q.dtype == torch.bfloat16


def _int8_cache(q, k_cache, k_scale) -> bool:
    """An 8-bit cache (kv_cache_dtype=int8: int8 rows, an fp32 scale per slot and KV head) under
    a bf16 query."""
    return k_scale is not None and k_cache.dtype == torch.int8 and q.dtype == torch.bfloat16


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, k_scale=None, v_scale=None):
    """Same contract as reference.decode_attention_ref, for bf16 and int8 caches."""
    int8 = _int8_cache(q, k_cache, k_scale)
    if not int8 and not _bf16_cache(q, k_cache, k_scale):
        from .reference import decode_attention_ref

        return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, sm_scale, k_scale, v_scale)
    b, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    caches = [q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()]
    if int8:
        caches += [k_scale.contiguous().data_ptr(), v_scale.contiguous().data_ptr()]
    kernel = _require().wb_paged_decode_i8 if int8 else _require().wb_paged_decode
    kernel(*caches, tables.data_ptr(), lens.data_ptr(), out.data_ptr(), b, hq, hkv, d, bs, tables.shape[1], sm_scale)
    return out


EXTEND_MAX_GD = 512  # the tiled prefill kernel's most query heads per KV head x head dim (EXT_GD)


def extend_on_amx(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `extend_attention` multiplies on AMX at these heads: where the tiles do (`amx()`),
    for head dims in multiples of 32 and up to 6 query heads per KV head."""
    return bool(_require().wb_extend_amx(num_heads, num_kv_heads, head_dim))


def extend_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sm_scale, k_scale=None, v_scale=None):
    """Same contract as reference.extend_attention_ref, for bf16 caches: each sequence's new
    tokens in tiles of 16 consecutive queries against its cached keys (wb_paged_extend: causal, no
    gathered copy, keys past a tile's last query never computed). Where G x head_dim exceeds the
    tile kernel's buffers, every new token is a one-query decode over its own causal context. An
    int8 cache is widened to bf16 first, only the blocks these sequences read (a prefill's few
    sequences: a small copy beside the step's matmuls), as the torch reference computes it."""
    if _int8_cache(q, k_cache, k_scale):
        k_cache, v_cache, block_tables = _widened_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens)
        k_scale = v_scale = None
    if not _bf16_cache(q, k_cache, k_scale):
        from .reference import extend_attention_ref

        return extend_attention_ref(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, sm_scale, k_scale, v_scale
        )
    _, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    if hq // hkv * d <= EXTEND_MAX_GD:
        q = q.contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        cu = cu_seqlens_q.to(torch.int32).contiguous()
        lens = seq_lens.to(torch.int32).contiguous()
        out = torch.empty_like(q)
        _require().wb_paged_extend(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            cu.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            lens.shape[0],
            hq,
            hkv,
            d,
            bs,
            tables.shape[1],
            sm_scale,
        )
        return out
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    owner = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
    # token i of sequence b sits at position seq_lens[b] - counts[b] + i
    first = (seq_lens.long() - counts)[owner]
    offset = torch.arange(owner.shape[0]) - cu_seqlens_q[:-1].long()[owner]
    lens = (first + offset + 1).to(torch.int32)
    return decode_attention(q, k_cache, v_cache, block_tables[owner], lens, sm_scale)


def _widened_blocks(k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens):
    """The blocks `block_tables` uses up to each sequence's length, dequantised to bf16 into a
    compact cache of their own, and the tables renumbered to it."""
    bs = k_cache.shape[1]
    used = torch.clamp((seq_lens.long() + bs - 1) // bs, min=1)
    width = int(used.max())
    tables = block_tables[:, :width].long()
    live = torch.arange(width).unsqueeze(0) < used.unsqueeze(1)
    blocks, renumbered = torch.unique(tables[live], return_inverse=True)
    compact = torch.zeros_like(tables)
    compact[live] = renumbered
    from .reference import _dequant

    k, v = (_dequant(c[blocks], s[blocks], torch.bfloat16) for c, s in ((k_cache, k_scale), (v_cache, v_scale)))
    return k, v, compact.to(torch.int32)


def supports_decode(head_dim: int, num_q_heads: int, num_kv_heads: int) -> bool:
    return head_dim % 16 == 0 and head_dim <= 256 and num_q_heads // num_kv_heads <= 16


# -- the compute path of large steps ------------------------------------------------------------
# Prefills and big decode batches are matmuls, not GEMVs. Three paths: oneDNN in bf16 ("bf16"),
# fast only where the CPU has bf16 instructions (AVX-512 BF16, AMX); oneDNN in fp32 over an fp32
# copy of the bf16 weights ("fp32"), where torch's bf16 GEMM is a slow fallback (1.3 GFLOP/s
# against 74 in fp32 on an AVX2 Zen 3); and our bf16 tiles ("tiles", `Tiles`: AVX-512 BF16 builds),
# which beat oneDNN's AVX-512 kernels on a Zen 4 (not its AMX ones). Which is fastest is measured,
# once per process, on a step-shaped matmul; WORKBENCH_CPU_GEMM=bf16|fp32|tiles forces it.
GEMM_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GEMM_PATHS = ("bf16", "fp32", "tiles")
TILE_OUTPUTS = 64  # outputs per packed group (TN in cpu_kernels.c)
_gemm: tuple[str, str, dict] | None = None
WIDE_BATCH_HINT = 64  # oneDNN's blocking for the fp32 path (pack_linear)


def pack_linear(weight: torch.Tensor, batch_hint: int = 1) -> torch.Tensor | None:
    """oneDNN's blocked layout of a [N, K] bf16 or fp32 weight (a copy), or None where torch has no
    oneDNN. In bf16 it is ~1.4x faster than F.linear; in fp32 it beats torch's default fp32 GEMM
    (MKL's) 1.3-3x on 9-512 rows at these widths, on AVX2 and AVX-512 alike (docs/benchmarks.md).
    `batch_hint` picks the blocking: 64 measured best for every fp32 step from 9 to 512 rows."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.bfloat16, torch.float32)
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
    except (RuntimeError, AttributeError):
        return None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T + bias with W laid out by `pack_linear` (x, W and bias in one dtype)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def gemm_rate(dtype: torch.dtype, m: int = 64, k: int = 1024, n: int = 1024, budget_s: float = 0.15) -> float:
    """GFLOP/s of an m x k @ k x n linear in `dtype` the way the engine runs it (oneDNN's packed
    weights where torch has them: bf16 for the model's own linears, fp32 for the wide path)."""

    return _best_rate(_gemm_step(dtype, m, k, n), 2.0 * m * k * n, budget_s)


def _gemm_step(dtype: torch.dtype, m: int, k: int, n: int):
    """A call of an m x k @ k x n linear in `dtype` as the engine runs it on oneDNN."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = pack_linear(w, WIDE_BATCH_HINT if dtype == torch.float32 else 1)
    return (lambda: F.linear(x, w)) if packed is None else (lambda: packed_linear(x, packed))


def _best_rate(fn, flop: float, budget_s: float) -> float:
    """GFLOP/s of the fastest of up to 20 calls of `fn` (after one warm-up) within `budget_s`."""
    import time

    fn()
    best, spent = 0.0, 0.0
    for _ in range(20):
        t = time.perf_counter()
        fn()
        dt = time.perf_counter() - t
        spent += dt
        best = max(best, flop / dt / 1e9)
        if spent > budget_s:
            break
    return best


def _interleaved_rates(
    steps: dict, flop: float, rounds: int = 12, calls: int = 3, gap_s: float = 0.004
) -> dict[str, list[float]]:
    """GFLOP/s of each step's fastest call in each round, the steps taking turns, `calls` each (the
    later ones with its weights in cache, as a step's are), round after round, `gap_s` apart:
    whatever else the host runs then (another server starting, a neighbour's burst) slows them
    alike. Measured one after another, each in its own ~2 ms, a server started beside vLLM's
    compiling one measured the tiles at 563 GFLOP/s and oneDNN at 1,815 (2,300 and 1,700 alone)."""
    import time

    per_round: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            best = 0.0
            for _ in range(calls):
                t = time.perf_counter()
                fn()
                best = max(best, flop / (time.perf_counter() - t) / 1e9)
            per_round[name].append(best)
        time.sleep(gap_s)
    return per_round


# A measurement is steady where every path's median round reaches this share of its best round. With
# two busy threads beside it on 2 vCPUs, every call of every path took a timeslice (~8 ms: 17-34
# GFLOP/s, whichever path got the luckier slices "won", fp32 among them); quiet, the median round
# is within ~10% of the best.
STEADY_SHARE, MEASURE_TRIES = 0.6, 2


def usual_gemm_path() -> tuple[str, str]:
    """The path that was fastest on CPUs of this kind (docs/benchmarks.md), for a host too busy to
    measure: the tiles where this build has them (AMX Xeons; Zen 4: tiles 389, oneDNN bf16 327,
    fp32 174 GFLOP/s), else oneDNN bf16 on a CPU with bf16 arithmetic, else fp32."""
    if tiles_available():
        return "tiles", "our bf16 tiles, fastest on AMX Xeons and Zen 4"
    if {"avx512_bf16", "amx_bf16"} & cpu_flags():
        return "bf16", "oneDNN bf16, on a CPU with bf16 arithmetic"
    return "fp32", "oneDNN fp32, on a CPU without bf16 arithmetic"


def measure_gemm_paths(m: int = 64, k: int = 1024, n: int = 1024) -> tuple[dict[str, float], bool]:
    """({path: GFLOP/s of its best round}, whether the measurement was steady: `STEADY_SHARE`,
    tried `MEASURE_TRIES` times)."""
    import statistics
    import time

    steps = {name: _gemm_step(dt, m, k, n) for name, dt in GEMM_DTYPES.items()}
    if tiles_available():
        steps["tiles"] = _tiles_step(m, k, n)
    for attempt in range(MEASURE_TRIES):
        if attempt:
            time.sleep(0.1)
        per_round = _interleaved_rates(steps, 2.0 * m * k * n)
        rates = {p: round(max(r), 1) for p, r in per_round.items()}
        if all(statistics.median(r) >= STEADY_SHARE * max(r) for r in per_round.values()):
            return rates, True
    return rates, False


def gemm_path() -> tuple[str, str, dict]:
    """("bf16" | "fp32" | "tiles", why, {path: GFLOP/s}) for steps above MAX_ROWS rows."""
    global _gemm
    if _gemm is None:
        rates, steady = measure_gemm_paths()
        forced = os.environ.get("WORKBENCH_CPU_GEMM", "").strip().lower()
        measured = ", ".join(f"{_path_name(p)} {r:g}" for p, r in rates.items()) + " GFLOP/s on this CPU"
        if forced in rates:
            _gemm = (forced, f"forced by WORKBENCH_CPU_GEMM={forced} ({measured})", rates)
        elif not steady:
            path, usual = usual_gemm_path()
            _gemm = (path, f"{usual}: the host was too busy to measure steadily ({measured}, unsteady)", rates)
        else:
            path, note = pick_gemm(rates, amx()[0], usual_gemm_path()[0])
            _gemm = (path, f"measured: {measured}{note}", rates)
    path, why, rates = _gemm
    if path == "tiles" and not tiles_available():  # a variant forced since (use()) has no tiles
        others = {p: r for p, r in rates.items() if p != "tiles"}
        return max(others, key=others.get), f"the {variant()} build has no tiles; {why}", rates
    return _gemm


# The tiles on AMX serve where they come within this share of the fastest path at the probe: the
# probe's weights (2 MB) sit in L2, where oneDNN's AMX kernels led (the tiles measured 0.80-0.93 of
# them there, run to run, before their spans of groups; 1.3x since, one run of an Emerald Rapids guest);
# the engine's decode steps stream theirs from memory, where the tiles lead
# 1.1-1.6x and take steps of up to FUSED_MAX_ROWS rows in one call a layer. On an AMX Xeon: W64
# in process +8%, served +3.5% with ITL p50 -8%, TTFT p50 +7% (prefill steps -10%; docs/benchmarks.md).
AMX_TILES_SHARE = 0.7


# Elsewhere the usual path (`usual_gemm_path`) serves unless another leads it by this much at the
# probe: with every path slowed alike (a busy host), none does, and a lucky timeslice picks nothing.
USUAL_MARGIN = 1.2


def pick_gemm(rates: dict[str, float], amx_tiles: bool, usual: str | None = None) -> tuple[str, str]:
    """The path of large steps from the probe's GFLOP/s per path: the fastest, unless the tiles on
    AMX, or else `usual` (this kind of CPU's usual fastest), come within a share of it; and a note
    on why when a path serves without being the fastest."""
    best = max(rates, key=rates.get)
    keep = "tiles" if amx_tiles and "tiles" in rates else usual if usual in rates else None
    if keep is None or keep == best:
        return best, ""
    if keep == "tiles" and amx_tiles:
        if rates[keep] >= AMX_TILES_SHARE * rates[best]:
            return keep, (
                f"; the tiles on AMX within {100 - 100 * AMX_TILES_SHARE:.0f}% of {_PATH_NAMES[best]}: they "
                "stream decode steps' weights faster and take them whole"
            )
    elif rates[keep] * USUAL_MARGIN >= rates[best]:
        return keep, (
            f"; {_PATH_NAMES[keep]}, the usual fastest on this kind of CPU, within {USUAL_MARGIN:g}x of "
            f"{_PATH_NAMES[best]}"
        )
    return best, ""


_PATH_NAMES = {"bf16": "oneDNN bf16", "fp32": "oneDNN fp32", "tiles": "our bf16 tiles"}


def _path_name(path: str) -> str:
    return _PATH_NAMES[path] + (" (AMX)" if path == "tiles" and amx()[0] else "")


def engine_gemm_rate(m: int, k: int, n: int, budget_s: float = 0.15, dtype: torch.dtype | None = None) -> float:
    """GFLOP/s of an m x k @ k x n step on the fastest path the engine can take here in `dtype`
    (None: any): oneDNN in that dtype, or in bf16 our tiles too. What the simulator's CPU profile
    and the roofline count as the peak."""
    rates = [gemm_rate(dt, m, k, n, budget_s) for dt in ([dtype] if dtype else GEMM_DTYPES.values())]
    if tiles_available() and dtype in (None, torch.bfloat16):
        rates.append(tiles_rate(m, k, n, budget_s))
    return max(rates)


def tiles_available() -> bool:
    """Whether `Tiles` runs here: the AVX-512 BF16 build."""
    return variant() == "avx512_bf16"


# -- AMX under the tiles and prefill attention -----------------------------------------------------
# On a CPU with AMX (Xeon Sapphire Rapids and later) the AVX-512 BF16 build multiplies the tiles'
# products on AMX (the packed layout is AMX's B-tile layout already): at SmolLM2's widths 1.3-1.6x
# oneDNN's AMX kernels at 1-16 rows, 1.1-1.2x at 39-128, 0.88-0.95x at 512-1,024 (docs/benchmarks.md),
# where AVX-512 alone does 240 GFLOP/s. `gemm_path` then measures the tiles with it. The prefill
# (extend) attention kernel takes its two products there too (`extend_on_amx`): 1.4-2.6x torch's
# SDPA from 128 new tokens at SmolLM2's heads, where on AVX-512 it was 0.35-0.7x; the decode kernel
# its scores (-15% a layer). WORKBENCH_CPU_AMX=0 keeps AVX-512 for all three.
_amx: tuple[bool, str] | None = None


AMX_GEMV_ROWS = 2  # on AMX, steps of more rows take the tiles rather than the GEMVs (as cpu_kernels.c)


def tiles_take(rows: int, k: int) -> bool:
    """Whether a bf16 step of `rows` rows (<= MAX_ROWS) over `k` inputs multiplies on the tiles rather
    than the GEMVs where a linear has both: on AMX from 3 rows (the one-call layer decides alike)."""
    return rows > AMX_GEMV_ROWS and k % 32 == 0 and amx()[0]


# On AMX, quantised steps of up to this many rows stay on the GEMVs (which read the codes once for
# all rows): widening every code to bf16 costs more below it. Crossovers measured over whole steps'
# linears: SmolLM2 12 rows for int8 and int4; Llama-3.2-1B's shape ~20 (int8) and ~14 (int4).
QUANT_GEMV_ROWS = 12


def quant_gemv_rows() -> int:
    """Most rows an int8 or int4 step multiplies on the GEMVs (more: the tiles or torch's kernels)."""
    return QUANT_GEMV_ROWS if amx()[0] else MAX_ROWS


def codes_on_tiles(rows: int, k: int) -> bool:
    """Whether an int8 or int4 step of `rows` rows over `k` inputs multiplies on AMX from the codes
    widened to bf16 (`gemm_q8_tiles`, `gemm_q4_tiles`), rather than the GEMVs (up to
    `quant_gemv_rows()`) or torch's kernels."""
    return rows > QUANT_GEMV_ROWS and k % 32 == 0 and amx()[0]


def _require_amx() -> None:
    on, why = amx()
    if not on:  # the quantised codes reach the tiles on AMX only (elsewhere torch's kernels: faster there)
        raise RuntimeError(f"the quantised tiles multiply on AMX; here {why}")


def gemm_q4_tiles(x, codes, scale_zero, bias, group: int) -> torch.Tensor:
    """x [M, K] @ W^T + bias for int4 weights in the GEMV's operands (`Gemv("int4", codes,
    scale_zero, ...)`): each weight (q - 8) * scale + zero rounded to bf16, fp32 sums rounded once."""
    _require_amx()
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    lib = _require()
    lib.wb_gemm_q4_tiles(
        x.data_ptr(), codes.data_ptr(), scale_zero.data_ptr(), _ptr(bias), y.data_ptr(), m, n, k, group
    )
    return y


def gemm_q8_tiles(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """(x [M, K] @ q [N, K]^T) * scale [N] + bias, x bf16 contiguous, q int8 contiguous, scale and
    bias bf16: [M, N] bf16, fp32 sums of exact products rounded once (as the int8 GEMV)."""
    _require_amx()
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    _require().wb_gemm_q8_tiles(x.data_ptr(), q.data_ptr(), scale.data_ptr(), _ptr(bias), y.data_ptr(), m, n, k)
    return y


def amx() -> tuple[bool, str]:
    """(whether the bf16 tiles and the attention kernels multiply on AMX here, why)."""
    global _amx
    if variant() != "avx512_bf16":  # a variant forced since (use()) has none
        return False, f"the {variant() or 'no'} build has no AMX path"
    if _amx is None:
        flags = cpu_flags()
        if not {"amx_tile", "amx_bf16"} <= flags:
            _amx = (False, "this CPU has no AMX (amx_tile, amx_bf16)")
        elif os.environ.get("WORKBENCH_CPU_AMX", "1").strip() == "0":
            _amx = (False, "off: WORKBENCH_CPU_AMX=0")
        elif not load("avx512_bf16").wb_amx_init():
            _amx = (False, "the kernel refused this process AMX's tile state (arch_prctl)")
        else:
            _amx = (True, "the CPU has AMX (amx_bf16)")
    return _amx


def set_amx(on: bool | None) -> None:
    """Multiply the tiles and attention on AMX (True, where `amx()` allows it) or AVX-512 (False) from now on;
    None: as at load. For comparing the two in one process (tests, probes)."""
    global _amx
    _amx = None
    if on is not None and (not on or amx()[0]):
        _amx = (on, f"set by set_amx({on})")
    _apply_amx()


def _apply_amx() -> None:
    if _sel.variant == "avx512_bf16":
        _sel.lib.wb_set_amx(int(amx()[0]))


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 (K even) -> the layout of wb_gemm_tiles: [N / 64][K / 2][4][16][2], zero-padded
    to whole groups of 64 outputs."""
    n, k = weight.shape
    if k % 2:
        raise ValueError(f"the tiles take an even number of inputs; got {k}")
    groups = (n + TILE_OUTPUTS - 1) // TILE_OUTPUTS
    src = weight.contiguous()
    if n % TILE_OUTPUTS:
        src = torch.zeros(groups * TILE_OUTPUTS, k, dtype=torch.bfloat16)
        src[:n] = weight
    packed = hostmem.ARENA.empty((groups, k // 2, 4, 16, 2), torch.bfloat16)  # streamed like the weights
    # Each (k, k + 1) pair moves as one 32-bit word: a transpose of [64 outputs][K / 2 pairs] per group,
    # 4.4x faster than the same permutation in bf16 (Llama-3.2-1B's gate/up: 52 -> 12 ms; all of that
    # model's layers 1.9 -> 0.4 s).
    pairs = src.view(torch.int32).view(groups, TILE_OUTPUTS, k // 2)
    packed.view(torch.int32).view(groups, k // 2, TILE_OUTPUTS).copy_(pairs.transpose(1, 2))
    return packed


def tiles_hold_weights() -> tuple[bool, str]:
    """(whether bf16 layers on the tiles path keep their weights in the tiles' layout only, every step
    multiplying there, why): on AMX, where the tiles stream a decode's weights as fast as the GEMVs
    (docs/benchmarks.md, two engines interleaved in one process: Llama-3.2-1B's shape 12.6 tok/s both,
    SmolLM2 115 vs 110; RSS -1.8 GiB on the 1B). On AVX-512 alone the tiles matched the GEMVs at 1-2
    rows but took ~8% longer at 8 (SmolLM2, tiles forced on an AMX host with AMX off): the plain copy
    stays for the GEMVs there. WORKBENCH_CPU_WEIGHTS_ONCE=0 keeps both copies on AMX too (to compare)."""
    if not tiles_available():
        return False, f"the {variant() or 'no'} build has no tiles"
    if os.environ.get("WORKBENCH_CPU_WEIGHTS_ONCE", "1").strip() == "0":
        return False, "off: WORKBENCH_CPU_WEIGHTS_ONCE=0"
    on, why = amx()
    if not on:
        return False, f"the tiles hold the only copy on AMX; here {why}"
    return True, "the tiles multiply on AMX and stream a decode's weights as fast as the GEMVs"


def unpack_tiles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] bf16 weight `pack_tiles` laid out as `packed` (exact: a permutation)."""
    groups, kp = packed.shape[:2]
    out = torch.empty(groups * TILE_OUTPUTS, 2 * kp, dtype=torch.bfloat16)
    out.view(torch.int32).view(groups, TILE_OUTPUTS, kp).copy_(
        packed.view(torch.int32).view(groups, kp, -1).transpose(1, 2)
    )
    return out[:n]


# Groups re-laid out at a time in place: the permutation goes through a buffer of this many bytes.
IN_PLACE_BYTES = 16 << 20


def _permute_in_place(weight: torch.Tensor, to_tiles: bool) -> None:
    """Lay out `weight`'s own bytes ([N, K] bf16 contiguous, N a multiple of 64) as `pack_tiles` does
    (`to_tiles`) or back: each group of 64 outputs is the same contiguous span in both layouts, so a
    few groups at a time go through a buffer and back into their span."""
    n, k = weight.shape
    words = weight.view(torch.int32).view(n // TILE_OUTPUTS, TILE_OUTPUTS * (k // 2))
    step = max(1, IN_PLACE_BYTES // (TILE_OUTPUTS * k * 2))
    for g in range(0, words.shape[0], step):
        span = words[g : g + step]
        was = span.clone().view(-1, TILE_OUTPUTS, k // 2) if to_tiles else span.clone().view(-1, k // 2, TILE_OUTPUTS)
        span.view(was.shape[0], was.shape[2], was.shape[1]).copy_(was.transpose(1, 2))


def holds_in_place(weight: torch.Tensor) -> bool:
    """Whether `Tiles(weight, in_place=True)` can take this weight: [N, K] bf16 contiguous, N a multiple
    of 64 (no padding) and K of 32 (the layout AMX reads whole)."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.is_contiguous() and n % TILE_OUTPUTS == 0 and k % 32 == 0


class Tiles:
    """A bf16 weight packed for `wb_gemm_tiles`: `tiles(x)` for x [M, K] contiguous bf16 (any M)
    returns [M, N] bf16, fp32 sums rounded once, as the GEMVs do. `in_place`: the weight's own bytes
    are re-laid out (then the only copy of it, until `release` lays them back)."""

    __slots__ = ("_fn", "_packed", "_bias", "_weight", "n", "k")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, in_place: bool = False):
        if not tiles_available():
            raise RuntimeError(f"the bf16 tiles need the avx512_bf16 build; this one is {variant()}")
        self._fn = _require().wb_gemm_tiles
        self.n, self.k = weight.shape
        self._weight = None
        if in_place:
            if not holds_in_place(weight):
                raise ValueError(
                    f"the tiles take in place [N, K] bf16 contiguous weights, N % 64 == 0 and K % 32 == 0; "
                    f"got {tuple(weight.shape)} {weight.dtype}"
                )
            _permute_in_place(weight, to_tiles=True)
            self._weight = weight
            self._packed = weight.view(self.n // TILE_OUTPUTS, self.k // 2, 4, 16, 2)
        else:
            self._packed = pack_tiles(weight)
        self._bias = bias

    def release(self) -> torch.Tensor:
        """The weight these tiles were laid out in place from, laid back as it came (this object
        unusable after)."""
        if self._weight is None:
            raise ValueError("only tiles laid out in place (in_place=True) lay their weight back")
        weight, self._weight, self._packed = self._weight, None, None
        _permute_in_place(weight, to_tiles=False)
        return weight

    def weight(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows start..stop of the [N, K] weight as it came: a copy (the tiles' bytes stay as they are)."""
        stop = self.n if stop is None else min(stop, self.n)
        g0 = start // TILE_OUTPUTS
        rows = unpack_tiles(self._packed[g0 : -(-stop // TILE_OUTPUTS)], stop - g0 * TILE_OUTPUTS)
        return rows[start - g0 * TILE_OUTPUTS :]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` ([T] int64) of the weight as it came, [T, K]: an embedding's lookup from the
        tiles' bytes (a tied output head's). Row r's (k, k + 1) pairs lie 64 words apart in its group."""
        words = self._packed.view(torch.int32).view(self._packed.shape[0], self.k // 2, TILE_OUTPUTS)
        return words[ids // TILE_OUTPUTS, :, ids % TILE_OUTPUTS].view(torch.bfloat16)

    @property
    def ptr(self) -> int:
        return self._packed.data_ptr()

    @property
    def packed(self) -> torch.Tensor:
        return self._packed

    def descriptor(self, tiles: Tiles | None = None) -> _Linear:
        """This weight for the one-call layer (as `Gemv.descriptor`): every step on the tiles."""
        return _Linear(3, self.ptr, None, _ptr(self._bias), self.n, self.k, 0, self.ptr)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty((m, self.n), dtype=torch.bfloat16)
        self._fn(x.data_ptr(), self._packed.data_ptr(), _ptr(self._bias), y.data_ptr(), m, self.n, self.k)
        return y


def fused_max_rows() -> int:
    """Most tokens a step may have for the CPU attention backend to describe it for the one-call
    layer: FUSED_MAX_ROWS on the tiles path, else MAX_ROWS (the layer itself checks its linears)."""
    return FUSED_MAX_ROWS if available() and gemm_path()[0] == "tiles" else MAX_ROWS


def tiles_rate(m: int = 64, k: int = 1024, n: int = 1024, budget_s: float = 0.15) -> float:
    """GFLOP/s of `Tiles` on an m x k @ k x n step, as `gemm_rate` measures oneDNN's."""
    return _best_rate(_tiles_step(m, k, n), 2.0 * m * k * n, budget_s)


def _tiles_step(m: int, k: int, n: int):
    g = torch.Generator().manual_seed(0)
    tiles = Tiles((torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    return lambda: tiles(x)


# -- the register width of the bf16 GEMVs ----------------------------------------------------------
# The AVX-512 BF16 build multiplies bf16 weights in zmm or ymm registers. A core whose AVX-512 units
# are 512 bits wide streams weights best in zmm; Zen 4 splits each zmm operation in two 256-bit
# halves and streams faster in ymm (docs/benchmarks.md). Which is faster is measured once per
# process, on weights larger than the last-level cache; WORKBENCH_CPU_GEMV=zmm|ymm forces it.
GEMV_WIDTHS = ("zmm", "ymm")
_gemv: tuple[str, str, dict] | None = None


def gemv_stream_rate(lib: ctypes.CDLL, ymm: bool, rounds: int = 4) -> float:
    """GB/s of one activation row against 48 MB of bf16 weights (more than a last-level cache holds)
    through `lib`'s bf16 GEMV at the given register width, best of `rounds`."""
    import time

    n, k = 42 * 1024, 576
    w = torch.empty(n, k, dtype=torch.bfloat16).fill_(0.01)  # written, so every page is its own
    x, y = torch.ones(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    was = lib.wb_gemv_ymm()
    lib.wb_set_gemv_ymm(int(ymm))
    try:
        best = float("inf")
        for _ in range(rounds):
            t = time.perf_counter()
            lib.wb_gemv_bf16(x.data_ptr(), w.data_ptr(), None, None, y.data_ptr(), 1, n, k, 0)
            best = min(best, time.perf_counter() - t)
    finally:
        lib.wb_set_gemv_ymm(was)
    return w.numel() * 2 / best / 1e9


def gemv_width() -> tuple[str, str, dict]:
    """("zmm" | "ymm", why, {width: GB/s}) for the AVX-512 BF16 build's bf16 GEMVs; ("", why, {})
    where the build in use has one width."""
    global _gemv
    if _gemv is not None:
        return _gemv
    if variant() != "avx512_bf16":
        return "", f"one register width in the {variant() or 'no'} build", {}
    lib = load("avx512_bf16")
    rates: dict[str, float] = {}
    for _ in range(2):  # interleaved: a shared host's speed moves between runs
        for width in GEMV_WIDTHS:
            rates[width] = max(rates.get(width, 0.0), round(gemv_stream_rate(lib, width == "ymm"), 1))
    measured = f"zmm {rates['zmm']:g} GB/s, ymm {rates['ymm']:g} on this CPU"
    forced = os.environ.get("WORKBENCH_CPU_GEMV", "").strip().lower()
    if forced in GEMV_WIDTHS:
        _gemv = (forced, f"forced by WORKBENCH_CPU_GEMV={forced} ({measured})", rates)
    else:
        _gemv = (max(GEMV_WIDTHS, key=rates.get), f"measured: {measured}", rates)
    return _gemv


def set_gemv_width(width: str | None) -> None:
    """Use `width` for the AVX-512 BF16 build's bf16 GEMVs from now on (None: measure again)."""
    global _gemv
    if width is not None and width not in GEMV_WIDTHS:
        raise ValueError(f"invalid GEMV width {width!r}; allowed: {', '.join(GEMV_WIDTHS)}")
    _gemv = None if width is None else (width, "set by set_gemv_width()", {})
    _apply_gemv_width()


def _apply_gemv_width() -> None:
    if _sel.variant == "avx512_bf16":
        _sel.lib.wb_set_gemv_ymm(int(gemv_width()[0] == "ymm"))
