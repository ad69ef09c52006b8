"""GFLOP/s of a layer's four linears (Llama-3.2-1B's shapes, or SmolLM2's with `smol`) on our bf16
tiles (`cpu.Tiles`: on AMX, spans of groups from 2 rows) and on oneDNN's packed bf16 kernels,
interleaved in one process, best of 3 per row count. The weights are small enough to sit in the
last-level cache: the compute side, not the stream.

    MS=2,32,512,1024 python docs/probes/tiles_rows.py [smol]
"""

import os
import sys
import time

import torch
from workbench_kernels import cpu

SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}
SMOL = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best(fn, reps: int = 3) -> float:
    t = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - start)
    return t


def main():
    shapes = SMOL if sys.argv[1:] == ["smol"] else SHAPES
    torch.manual_seed(0)
    ws = {k: (torch.randn(*s) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    tiles = {k: cpu.Tiles(w) for k, w in ws.items()}
    onednn = {k: cpu.pack_linear(w) for k, w in ws.items()}
    for m in [int(v) for v in os.environ.get("MS", "2,32,128,512,1024,1536").split(",")]:
        xs = {k: torch.randn(m, s[1]).to(torch.bfloat16) for k, s in shapes.items()}
        flop = sum(2 * m * n * k for n, k in shapes.values())
        t_tiles = t_onednn = float("inf")
        for _ in range(3):
            t_tiles = min(t_tiles, best(lambda xs=xs: [tiles[k](xs[k]) for k in shapes]))
            t_onednn = min(t_onednn, best(lambda xs=xs: [cpu.packed_linear(xs[k], onednn[k]) for k in shapes]))
        print(f"M={m}: tiles {flop / t_tiles / 1e9:.0f}, oneDNN {flop / t_onednn / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
