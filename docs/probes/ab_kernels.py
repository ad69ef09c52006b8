"""A/B two or more versions of cpu_kernels.c in one process, interleaved (a shared host's speed
moves by a third within a minute, so separate runs cannot be compared).

    python docs/probes/ab_kernels.py gemv avx2 old=/tmp/old/cpu_kernels.c new=kernels/cpu_kernels.c
    python docs/probes/ab_kernels.py attention avx512_bf16 old=... new=...

tiles: SmolLM2's 120 linears of a step of M rows (env M, default 176) on the bf16 tiles, GFLOP/s.
gemv: SmolLM2's 121 bf16 GEMVs of a token (M activation rows, env M, default 1), GB/s of weights;
GEMV=ymm for the ymm-register GEMVs, HUGE=1 for weights in 2 MiB pages (both as the engine on Zen 4).
quant: the same token as `quantization=int4` runs it: 120 int4 GEMVs (groups of 32) and the int8
head, GB/s of what they read (codes, scales). Every version gets today's operand layouts
(linear.native_int4: bf16 scale and zero pairs since 2026-12-03; older sources took fp32 pairs).
attention: paged decode attention, 64 sequences x 300 tokens (env B, L), 9 query / 3 KV heads of
64, over 30 layers' caches (env LAYERS; 30 read from DRAM, as in a wide decode step; 1 stays in
the caches), ms per layer call. extend: prefill attention of a mixed step's prompts (env N, the
new tokens of each of S sequences, default 2 x 238, after CTX cached tokens), same heads, GFLOP/s
of the causal work over LAYERS layers. Each version is
built with the variant's flags; the output's max difference from the first version is printed.
"""

import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from workbench_kernels import cpu

torch.set_num_threads(2)
what, variant, specs = sys.argv[1], sys.argv[2], sys.argv[3:]
tmp = Path(tempfile.mkdtemp())
libs = {}
for spec in specs:
    name, src = spec.split("=", 1)
    so, gomp = tmp / f"{name}.so", cpu._torch_libgomp()
    flags = cpu.COMMON_FLAGS + cpu.VARIANT_FLAGS[variant] + [f"-I{cpu.HERE}"]
    subprocess.run(["gcc", *flags, "-c", src, "-o", f"{so}.o"], check=True)
    subprocess.run(
        ["gcc", "-shared", f"{so}.o", "-o", str(so), str(gomp), f"-Wl,-rpath,{gomp.parent}", "-lm"], check=True
    )
    libs[name] = ctypes.CDLL(str(so))
g = torch.Generator().manual_seed(0)

if what == "gemv":
    M = int(os.environ.get("M", "1"))
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    ws = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes]
    if os.environ.get("HUGE") == "1":  # the weights in 2 MiB pages, as the engine holds them
        from workbench_kernels import hostmem

        ws = [hostmem.ARENA.copy(w) for w in ws]
    if os.environ.get("GEMV") == "ymm":  # bf16 GEMVs in ymm registers (what gemv_width picks on Zen 4)
        for lib in libs.values():
            lib.wb_set_gemv_ymm(ctypes.c_int64(1))
    xs = {k: torch.randn(M, k, generator=g).bfloat16() for _, k in shapes}
    ys = [torch.empty(M, n, dtype=torch.bfloat16) for n, _ in shapes]
    fns = {}
    for name, lib in libs.items():
        f = lib.wb_gemv_bf16
        f.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
        fns[name] = lambda f=f: (
            [
                f(xs[k].data_ptr(), w.data_ptr(), None, None, y.data_ptr(), M, n, k, 0)
                for w, (n, k), y in zip(ws, shapes, ys)
            ]
            and ys[-1].clone()
        )
    unit, scale = "GB/s", sum(n * k * 2 for n, k in shapes) / 1e9
elif what == "quant":
    from workbench.models.linear import int4_codes, native_int4, quantize_int8

    M = int(os.environ.get("M", "1"))
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    ops = []  # (kind, weights, aux, n, k, group): int4 layers in groups of 32, the head in int8
    for i, (n, k) in enumerate(shapes):
        w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
        if i < len(shapes) - 1:
            ops.append(("int4", *native_int4(*int4_codes(w, 32)), n, k, 32))
        else:
            ops.append(("int8", *quantize_int8(w), n, k, 0))
    if os.environ.get("HUGE") == "1":
        from workbench_kernels import hostmem

        ops = [(kind, hostmem.ARENA.copy(a), hostmem.ARENA.copy(b), n, k, gr) for kind, a, b, n, k, gr in ops]
    xs = {k: torch.randn(M, k, generator=g).bfloat16() for _, k in shapes}
    ys = [torch.empty(M, n, dtype=torch.bfloat16) for n, _ in shapes]
    fns = {}
    for name, lib in libs.items():
        for f in (lib.wb_gemv_int4, lib.wb_gemv_int8):
            f.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4

        def run(lib=lib):
            for (kind, a, b, n, k, gr), y in zip(ops, ys):
                getattr(lib, f"wb_gemv_{kind}")(
                    xs[k].data_ptr(), a.data_ptr(), b.data_ptr(), None, y.data_ptr(), M, n, k, gr
                )
            return torch.cat([y.flatten() for y in ys[-2:]])

        fns[name] = run
    unit, scale = "GB/s", sum(a.numel() * a.element_size() + b.numel() * b.element_size() for _, a, b, *_ in ops) / 1e9
elif what == "tiles":
    M = int(os.environ.get("M", "176"))
    layers = 1
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
    packed = [cpu.pack_tiles((torch.randn(n, k, generator=g) * 0.02).bfloat16()) for n, k in shapes]
    xs = {k: torch.randn(M, k, generator=g).bfloat16() for _, k in shapes}
    ys = [torch.empty(M, n, dtype=torch.bfloat16) for n, _ in shapes]
    fns = {}
    for name, lib in libs.items():
        f = lib.wb_gemm_tiles
        f.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        fns[name] = lambda f=f: (
            [f(xs[k].data_ptr(), w.data_ptr(), None, y.data_ptr(), M, n, k) for w, (n, k), y in zip(packed, shapes, ys)]
            and torch.cat([y.flatten() for y in ys])
        )
    unit, scale = "GFLOP/s", sum(2 * M * n * k for n, k in shapes) / 1e9
elif what in ("attention", "extend"):
    Hq, Hkv, D, bs = 9, 3, 64, 16
    if what == "attention":
        B, L, layers = (int(os.environ.get(k, d)) for k, d in (("B", 64), ("L", 300), ("LAYERS", 30)))
        S, per_seq = B, (L + bs - 1) // bs
        q, lens = torch.randn(B, Hq, D, generator=g).bfloat16(), torch.full((B,), L, dtype=torch.int32)
    else:
        S, N, ctx, layers = (int(os.environ.get(k, d)) for k, d in (("S", 2), ("N", 238), ("CTX", 0), ("LAYERS", 30)))
        per_seq = (ctx + N + bs - 1) // bs
        q = torch.randn(S * N, Hq, D, generator=g).bfloat16()
        cu = torch.arange(0, S * N + 1, N, dtype=torch.int32)
        lens = torch.full((S,), ctx + N, dtype=torch.int32)
    nb = S * per_seq + 4
    kc = [torch.randn(nb, bs, Hkv, D, generator=g).bfloat16() for _ in range(layers)]
    vc = [torch.randn(nb, bs, Hkv, D, generator=g).bfloat16() for _ in range(layers)]
    tables = torch.randperm(nb, generator=g)[: S * per_seq].view(S, -1).int().contiguous()
    fns = {}
    for name, lib in libs.items():
        f = lib.wb_paged_decode if what == "attention" else lib.wb_paged_extend
        pointers = 6 if what == "attention" else 7
        f.argtypes = [ctypes.c_void_p] * pointers + [ctypes.c_int64] * 6 + [ctypes.c_float]

        def run(f=f):
            for i in range(layers):
                out = torch.empty_like(q)
                tensors = (
                    (q, kc[i], vc[i], tables, lens, out)
                    if what == "attention"
                    else (q, kc[i], vc[i], tables, cu, lens, out)
                )
                f(*(t.data_ptr() for t in tensors), S, Hq, Hkv, D, bs, tables.shape[1], 0.125)
            return out

        fns[name] = run
    if what == "attention":
        unit, scale = "ms per layer", None
    else:  # QK and PV over the causal pairs of every query head
        unit, scale = "GFLOP/s", layers * S * Hq * 4 * D * (N * ctx + N * (N + 1) / 2) / 1e9
else:
    raise SystemExit(f"unknown probe {what!r}; allowed: gemv, quant, tiles, attention, extend")

best, outs = dict.fromkeys(fns, float("inf")), {}
for _ in range(8):
    for name, fn in fns.items():
        t = time.perf_counter()
        outs[name] = fn()
        best[name] = min(best[name], time.perf_counter() - t)
first = next(iter(outs.values())).float()
for name, t in best.items():
    figure = scale / t if scale else t * 1e3 / layers
    diff = (outs[name].float() - first).abs().max().item()
    print(f"{variant} {what} {name}: {figure:.2f} {unit}  (max |diff| vs the first {diff:.3g})")
