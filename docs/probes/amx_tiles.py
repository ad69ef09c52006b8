"""The bf16 tiles on AMX against oneDNN's packed bf16 linears (AMX too, where the CPU has it) and
the tiles on AVX-512: SmolLM2-135M's 120 linears of a step of M rows (30 layers of qkv 576->960,
o 576->576, gate/up 576->3072, down 1536->576; 212 MB of weights, read from memory once a step),
median of 5, ms a step, GFLOP/s and GB/s of weights; at up to MAX_ROWS rows our bf16 GEMVs too.

    python docs/probes/amx_tiles.py [M ...]
"""

import sys

import torch
from workbench_kernels import cpu
from workbench_kernels.bench import Timer

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    if not cpu.amx()[0]:
        sys.exit(f"no AMX path here: {cpu.amx()[1]}")
    g = torch.Generator().manual_seed(0)
    weights = [[(torch.randn(n, k, generator=g) * 0.05).bfloat16() for n, k in SHAPES] for _ in range(30)]
    tiles = [[cpu.Tiles(w) for w in layer] for layer in weights]
    onednn = [[cpu.pack_linear(w) for w in layer] for layer in weights]
    gemvs = [[cpu.Gemv("bf16", w) for w in layer] for layer in weights]
    nbytes = sum(n * k * 2 for n, k in SHAPES) * 30
    timer = Timer("cpu")

    def best(fn):
        return timer(fn, iters=5, warmup=1)

    for m in [int(a) for a in sys.argv[1:]] or (1, 8, 16, 39, 64, 128, 512, 1024):
        x = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in SHAPES}
        flop = sum(2 * m * n * k for n, k in SHAPES) * 30

        def run_tiles(x=x):
            for layer in tiles:
                for t, (_, k) in zip(layer, SHAPES):
                    t(x[k])

        def run_onednn(x=x):
            for layer in onednn:
                for p, (_, k) in zip(layer, SHAPES):
                    cpu.packed_linear(x[k], p)

        def run_gemvs(x=x):
            for layer in gemvs:
                for f, (_, k) in zip(layer, SHAPES):
                    f(x[k])

        gemv = f"  GEMVs {best(run_gemvs) * 1e3:6.2f}" if m <= cpu.MAX_ROWS else ""
        cpu.set_amx(False)
        avx = best(run_tiles)
        cpu.set_amx(True)
        amx, dnn = best(run_tiles), best(run_onednn)
        print(
            f"M {m:5d}: AMX tiles {amx * 1e3:7.2f} ms ({flop / amx / 1e9:5.0f} GFLOP/s, {nbytes / amx / 1e9:3.0f} GB/s)"
            f"  oneDNN {dnn * 1e3:7.2f} ({flop / dnn / 1e9:5.0f})  AVX-512 tiles {avx * 1e3:7.2f}"
            f"  oneDNN / AMX {dnn / amx:4.2f}{gemv}"
        )
    cpu.set_amx(None)


if __name__ == "__main__":
    main()
