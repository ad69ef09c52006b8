"""The machine's limits, measured on the spot, and what they mean for a model.

- memory read bandwidth: `torch.sum` over a large buffer (1 GiB), best of a few runs;
- matmul FLOP/s: a batch-shaped GEMM (64 x hidden @ hidden x 4*hidden, i.e. 64x576 @ 576x2304 for
  SmolLM2) and a large square one, in the compute dtype and, for bf16 on a CPU, in fp32 too (what
  runs where bf16 is slow); the best of all is the compute peak;
- decode limit per stream = bandwidth / bytes of weights read per decode step;
- compute limit = FLOP/s / (2 * matmul parameters) tokens per second (attention FLOPs ignored, so
  it is an upper bound), and for a workload: the output tok/s at which prompt + output tokens
  would take exactly the compute floor.
"""

from __future__ import annotations

import time

import torch

DTYPE_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def _clock(device: torch.device):
    """A timer that waits for the device's queued work before reading the time."""
    if device.type == "cuda":

        def now() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return now
    return time.perf_counter


def measure_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, device="cpu") -> list[float]:
    """Read bandwidth samples in GB/s (1e9 bytes/s) from summing an fp32 buffer of `nbytes`."""
    device = torch.device(device)
    now = _clock(device)
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    x.sum()  # fault the pages in, warm the kernel
    samples = []
    for _ in range(repeats):
        t = now()
        x.sum()
        samples.append(x.numel() * 4 / (now() - t) / 1e9)
    del x
    return samples


SLOW_DTYPE_RATIO = 4  # a dtype this many times slower on the batch shape gets no square GEMM


def measure_matmul(
    m: int,
    k: int,
    n: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    min_time: float = 0.25,
    repeats: int = 3,
    device="cpu",
) -> float:
    """Best achieved GFLOP/s of `[m,k] @ [k,n]` in `dtype`."""
    device = torch.device(device)
    now = _clock(device)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)
    # Enough iterations per sample to last ~min_time.
    t = now()
    torch.matmul(a, b, out=out)
    one = max(now() - t, 1e-6)
    if one >= min_time:  # a slow path (bf16 without bf16 instructions: a minute a call): one sample will do
        return 2.0 * m * k * n / one / 1e9
    iters = max(1, int(min_time / one))
    best = 0.0
    for _ in range(repeats):
        t = now()
        for _ in range(iters):
            torch.matmul(a, b, out=out)
        dt = now() - t
        best = max(best, 2.0 * m * k * n * iters / dt / 1e9)
    return best


def _packed_rate(dtype: torch.dtype, m: int, k: int, n: int) -> float:
    """GFLOP/s of the linear as the engine runs it on a CPU (oneDNN's packed layout, bf16 or fp32;
    in bf16 also our tiles where this build has them), 0 where unavailable."""
    from ..models.cpu_forward import CpuKernelForward

    try:
        return CpuKernelForward.gemm_rate(m, k, n, budget_s=0.25, dtype=dtype)
    except RuntimeError:
        return 0.0


def model_costs(config, dtype: torch.dtype = torch.bfloat16, quantization: str = "none", group_size: int = 128) -> dict:
    """Parameter counts, FLOPs per token and bytes of weights read per decode step.

    Decode reads every linear layer (the LM head included, which is the embedding table when tied)
    and the norms; the embedding lookup itself reads one row and is not counted.
    """
    from ..models.loader import expected_weight_shapes

    shapes = expected_weight_shapes(config)
    wbytes = DTYPE_BYTES.get(dtype, 2)

    def numel(shape) -> int:
        n = 1
        for d in shape:
            n *= d
        return n

    params = sum(numel(s) for s in shapes.values())
    linears = {k: s for k, s in shapes.items() if k.endswith("_proj.weight") or k == "lm_head.weight"}
    if config.tie_word_embeddings:
        linears["model.embed_tokens.weight"] = shapes["model.embed_tokens.weight"]
    small = {k: s for k, s in shapes.items() if len(s) == 1}
    matmul_params = sum(numel(s) for s in linears.values())

    def linear_bytes(shape) -> float:
        out_f, in_f = shape
        n = out_f * in_f
        if quantization == "int8" or quantization == "fp8":
            return n + out_f * wbytes
        if quantization == "int4":
            g = group_size
            while g > 16 and in_f % g:
                g //= 2
            return n / 2 + (n / g) * 2 * wbytes
        return n * wbytes

    weight_bytes = sum(linear_bytes(s) for s in linears.values()) + sum(numel(s) * wbytes for s in small.values())
    return {
        "params": params,
        "matmul_params": matmul_params,
        "flop_per_token": 2 * matmul_params,
        "weight_bytes": int(weight_bytes),
        "weight_dtype": str(dtype).removeprefix("torch.") if quantization == "none" else quantization,
    }


def measure_roofline(
    costs: dict,
    *,
    dtype: torch.dtype = torch.bfloat16,
    quick: bool = False,
    workload=None,
    hidden_size: int = 576,
    device="cpu",
) -> dict:
    """Measure bandwidth and FLOP/s now and derive the model's limits (see the module doc)."""
    bw = measure_bandwidth(1 << (28 if quick else 30), repeats=3 if quick else 5, device=device)
    square = 1024 if quick else 2048
    # A decode-batch-shaped GEMM at the model's width (64x576 @ 576x2304 for SmolLM2) and a big square,
    # in the model's dtype and, for bf16 on a CPU, in fp32 as well: the engine (cpu.gemm_path) and the
    # peers multiply in whichever is faster on this host, so the peak is the best of both (on a CPU
    # without bf16 instructions torch's bf16 GEMM is ~60x slower than its fp32 one).
    dtypes = [dtype] + ([torch.float32] if torch.device(device).type == "cpu" and dtype == torch.bfloat16 else [])
    shapes = [(64, hidden_size, 4 * hidden_size), (square, square, square)]
    flops, by_dtype, skipped = {}, {}, {}
    for i, (m, k, n) in enumerate(shapes):
        for dt in dtypes:
            name = str(dt).removeprefix("torch.")
            if i and by_dtype[name] * SLOW_DTYPE_RATIO < max(by_dtype.values()):
                # it cannot be the peak, and its square GEMM would take minutes
                skipped[f"{name} {m}x{k} @ {k}x{n}"] = (
                    f"not measured: {by_dtype[name]:.0f} GFLOP/s on the batch "
                    f"shape, under 1/{SLOW_DTYPE_RATIO} of the best"
                )
                continue
            # the batch-shaped GEMM as the engine runs it (oneDNN's packed weights)
            rate = _packed_rate(dt, m, k, n) if i == 0 and torch.device(device).type == "cpu" else 0.0
            flops[f"{name} {m}x{k} @ {k}x{n}"] = max(
                rate,
                measure_matmul(m, k, n, dt, min_time=0.1 if quick else 0.25, repeats=2 if quick else 3, device=device),
            )
            if i == 0:
                by_dtype[name] = flops[f"{name} {m}x{k} @ {k}x{n}"]
    best_bw = max(bw)
    peak_key = max(flops, key=flops.get)
    peak = flops[peak_key]
    out = {
        "memory_bandwidth_gb_s": best_bw,
        "memory_bandwidth_samples_gb_s": bw,
        "matmul_gflop_s": flops,
        "matmul_by_dtype_gflop_s": by_dtype,
        **({"matmul_skipped": skipped} if skipped else {}),
        "peak_gflop_s": peak,
        "compute_dtype": peak_key.split()[0],
        "device": str(device),
        **costs,
        "decode_limit_tok_s": best_bw * 1e9 / costs["weight_bytes"],
        "compute_limit_tok_s": peak * 1e9 / costs["flop_per_token"],
    }
    if workload is not None:
        out["workload"] = workload_limit(out, workload.prompt_tokens, workload.output_tokens)
    return out


def workload_limit(roof: dict, prompt_tokens: int, output_tokens: int) -> dict:
    """The compute floor of a workload and the output tok/s it caps throughput at."""
    flop = roof["flop_per_token"] * (prompt_tokens + output_tokens)
    seconds = flop / (roof["peak_gflop_s"] * 1e9)
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "tflop": flop / 1e12,
        "min_seconds": seconds,
        "output_tok_s_limit": output_tokens / seconds if seconds > 0 else 0.0,
    }
