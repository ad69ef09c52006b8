"""GFLOP/s of the linear layer's candidate paths on this host: torch's F.linear (MKL's sgemm in
fp32), oneDNN's packed weights (what the engine runs, `cpu.pack_linear`), at decode-batch,
LM-head and prefill shapes, fp32 and bf16.

    python docs/probes/linear_paths.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python docs/probes/linear_paths.py   # an AVX2 host
"""

import time

import torch
import torch.nn.functional as F
from workbench_kernels import cpu

torch.set_num_threads(2)


def rate(fn, flops: float, n: int = 20) -> float:
    fn(), fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return flops * n / (time.perf_counter() - t) / 1e9


for dtype in (torch.float32, torch.bfloat16):
    for m, n, k in [(9, 2304, 576), (64, 2304, 576), (64, 49152, 576), (64, 576, 1536), (512, 2304, 576)]:
        x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
        packed = cpu.pack_linear(w, cpu.WIDE_BATCH_HINT if dtype == torch.float32 else 1)
        fl = 2.0 * m * n * k
        row = {"F.linear": rate(lambda x=x, w=w: F.linear(x, w), fl)}
        if packed is not None:
            row["oneDNN packed"] = rate(lambda x=x, p=packed: cpu.packed_linear(x, p), fl)
        print(
            f"{str(dtype).removeprefix('torch.'):9s} {m}x{k} @ {k}x{n}:",
            ", ".join(f"{name} {v:.0f}" for name, v in row.items()),
            "GFLOP/s",
        )
