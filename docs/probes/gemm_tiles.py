"""Our bf16 tiles against oneDNN's packed bf16 GEMM on the 120 linears of a SmolLM2 decode step
(weights cold: 214 MB, read once per pass), by rows, interleaved in one process (best of 5).

    python docs/probes/gemm_tiles.py [ROWS ...]      (default: 4 16 36 64 512)
"""

import sys
import time

import torch
from workbench_kernels import cpu

torch.set_num_threads(2)
if not cpu.tiles_available():
    raise SystemExit(f"the bf16 tiles need the avx512_bf16 build; this host runs {cpu.variant()}")
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
g = torch.Generator().manual_seed(0)
weights = [(torch.randn(n, k, generator=g) * 0.02).bfloat16() for n, k in shapes]
onednn = [cpu.pack_linear(w) for w in weights]
tiles = [cpu.Tiles(w) for w in weights]
for rows in [int(a) for a in sys.argv[1:]] or [4, 16, 36, 64, 512]:
    xs = {k: torch.randn(rows, k, generator=g).bfloat16() for _, k in shapes}
    runs = {
        "tiles": lambda xs=xs: [t(xs[t.k]) for t in tiles],
        "oneDNN bf16": lambda xs=xs: [cpu.packed_linear(xs[k], p) for p, (_, k) in zip(onednn, shapes)],
    }
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(5):
        for name, run in runs.items():
            t = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t)
    flop = sum(2 * rows * n * k for n, k in shapes) / 1e9
    print(
        f"{rows:4d} rows: " + ", ".join(f"{name} {s * 1e3:.1f} ms ({flop / s:.0f} GFLOP/s)" for name, s in best.items())
    )
