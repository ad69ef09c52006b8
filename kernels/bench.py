"""GPU benchmark of the Triton paged-attention kernels against the machine's own limits.

    python -m workbench_kernels.bench [--json] [--kv bf16,int8,fp8] [--sweep]
    python kernels/bench.py ...            (from the repository root, without installing)

Limits: device-to-device copy bandwidth (bytes read + bytes written per second) and the FLOP/s
of a large bf16 matmul.
Decode: batch 64 x 4096-token context, one query each, bf16 activations, GQA 8:1 (32 q / 4 kv
heads) and the SmolLM2 shape (9 q / 3 kv heads), head dims 64 and 128, paged cache with 16-token
blocks scattered at random. Achieved GB/s = bytes of KV cache (and scales) read / time, shown
with its fraction of the copy bandwidth, for the automatic split-KV choice and for no split.
Prefill: one causal 4096-token prompt through extend_attention (paged cache) against
torch.nn.functional.scaled_dot_product_attention on contiguous K/V expanded to every query head
(its fastest path); ratio = SDPA time / Triton time (> 1: Triton is faster).
Every case is also checked against the reference (decode) or SDPA's output (prefill).
--sweep also times a grid of launch configurations and prints the fastest per shape.
CUDA only: elsewhere it exits with a message.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

DECODE_BATCH, DECODE_CTX, PREFILL_LEN, BLOCK_SIZE = 64, 4096, 4096, 16
DEVICE = "cuda"
REL_TOL = 3e-2  # max |error| / max |expected| above which a row is flagged (bf16 reference maths)
SHAPES = [  # (label, q heads, kv heads, head dim)
    ("gqa8:1", 32, 4, 128),
    ("gqa8:1", 32, 4, 64),
    ("smollm2", 9, 3, 64),
    ("smollm2", 9, 3, 128),
]


def _import_ops():
    """(triton_ops, reference), whether installed as workbench_kernels or run from the repo."""
    try:
        from workbench_kernels import reference, triton_ops
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from kernels import reference, triton_ops  # type: ignore[no-redef]
    return triton_ops, reference


class Timer:
    """Median wall time of fn on the device: CUDA events, with L2 flushed before every run unless
    `flush_l2` is off (the flush buffer is 256 MB), on a GPU; on a CPU (`workbench gpucheck
    --dry-run`, the Triton interpreter) the wall clock."""

    def __init__(self, device, flush_l2: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) if self.cuda and flush_l2 else None

    def __call__(self, fn, iters: int = 20, warmup: int = 3) -> float:
        for _ in range(warmup):
            fn()
        if not self.cuda:
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return sorted(times)[len(times) // 2]
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            if self.flush is not None:
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] / 1e3


def _copy_GBps(timer: Timer, device, n: int) -> float:
    src = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * n / timer(lambda: dst.copy_(src), iters=20) / 1e9


def _matmul_TFLOPs(timer: Timer, device, m: int) -> float:
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    return 2 * m**3 / timer(lambda: a @ b, iters=20) / 1e12


def measure_limits(timer: Timer, device, copy_bytes: int = 1 << 30, matmul_n: int = 8192) -> dict:
    limits = {
        "copy_GBps": _copy_GBps(timer, device, copy_bytes),
        "copy_bytes": 2 * copy_bytes,
        "matmul_TFLOPs": _matmul_TFLOPs(timer, device, matmul_n),
        "matmul_n": matmul_n,
    }
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return limits


def _kv_store(kv: str):
    return {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]


def _num_sms(device) -> int:
    device = torch.device(device)
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _random_cache(num_blocks, hkv, d, kv, device, gen, dtype=torch.bfloat16):
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    if kv == "bf16":  # the activations' dtype (fp32 under the interpreter)
        kc = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        vc = torch.randn(shape, device=device, dtype=dtype, generator=gen)
        return kc, vc, None, None
    if kv == "int8":
        kc = torch.randint(-127, 128, shape, device=device, dtype=torch.int8, generator=gen)
        vc = torch.randint(-127, 128, shape, device=device, dtype=torch.int8, generator=gen)
    else:
        kc = (torch.randn(shape, device=device, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        vc = (torch.randn(shape, device=device, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    ks = torch.rand(shape[:3], device=device, generator=gen) * 0.02 + 0.005
    vs = torch.rand(shape[:3], device=device, generator=gen) * 0.02 + 0.005
    return kc, vc, ks, vs


def decode_case(
    ops,
    ref,
    timer,
    hq,
    hkv,
    d,
    kv,
    device,
    iters,
    config=None,
    *,
    batch: int = DECODE_BATCH,
    ctx: int = DECODE_CTX,
    dtype=torch.bfloat16,
) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    per_seq = ctx // BLOCK_SIZE
    num_blocks = batch * per_seq
    kc, vc, ks, vs = _random_cache(num_blocks, hkv, d, kv, device, gen, dtype)
    bt = torch.randperm(num_blocks).to(device, torch.int32).view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, dtype=dtype, device=device, generator=gen)
    scale = d**-0.5
    kv_bytes = 2 * batch * ctx * hkv * d * kc.element_size()
    if ks is not None:
        kv_bytes += 2 * batch * ctx * hkv * 4
    total_bytes = kv_bytes + 2 * q.numel() * q.element_size() + bt.numel() * 4

    def run(splits, cfg=None):
        return ops.decode_attention(
            q, kc, vc, bt, lens, scale, ks, vs, num_splits=splits, max_seq_len=ctx, **(cfg or {})
        )

    if config is not None:  # sweep mode: one configuration, automatic splits
        return {"time_s": timer(lambda: run(None, config), iters=iters)}
    block_n = ops.decode_config(d, kc.dtype, q.dtype)["block_n"]
    auto = ops.pick_num_splits(batch, hkv, ctx, block_n, _num_sms(device))
    expect = ref.decode_attention_ref(q, kc, vc, bt, lens, scale, ks, vs).float()
    err = max((run(s).float() - expect).abs().max().item() for s in (None, 1))
    rel = err / max(expect.abs().max().item(), 1e-6)
    del expect
    t_auto = timer(lambda: run(None), iters=iters)
    t_one = timer(lambda: run(1), iters=iters) if auto != 1 else t_auto
    return {
        "kv_bytes": kv_bytes,
        "bytes": total_bytes,
        "splits_auto": auto,
        "time_auto_s": t_auto,
        "GBps_auto": total_bytes / t_auto / 1e9,
        "time_nosplit_s": t_one,
        "GBps_nosplit": total_bytes / t_one / 1e9,
        "max_abs_err": err,
        "max_rel_err": rel,
    }


def prefill_case(
    ops, timer, hq, hkv, d, device, iters, config=None, *, n: int = PREFILL_LEN, dtype=torch.bfloat16
) -> dict:
    gen = torch.Generator(device=device).manual_seed(1)
    group = hq // hkv
    q = torch.randn(n, hq, d, dtype=dtype, device=device, generator=gen)
    k = torch.randn(n, hkv, d, dtype=dtype, device=device, generator=gen)
    v = torch.randn(n, hkv, d, dtype=dtype, device=device, generator=gen)
    num_blocks = n // BLOCK_SIZE
    perm = torch.randperm(num_blocks).to(device)
    kc = torch.empty(num_blocks, BLOCK_SIZE, hkv, d, dtype=dtype, device=device)
    vc = torch.empty_like(kc)
    kc[perm] = k.view(num_blocks, BLOCK_SIZE, hkv, d)
    vc[perm] = v.view(num_blocks, BLOCK_SIZE, hkv, d)
    bt = perm.to(torch.int32).view(1, num_blocks)
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    lens = torch.tensor([n], dtype=torch.int32, device=device)
    scale = d**-0.5

    def triton_fn():
        return ops.extend_attention(q, kc, vc, bt, cu, lens, scale, **(config or {}))

    if config is not None:
        return {"time_s": timer(triton_fn, iters=iters)}
    qs = q.transpose(0, 1).unsqueeze(0).contiguous()
    ks = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
    vs = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()

    def sdpa_fn():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)

    expect = sdpa_fn().squeeze(0).transpose(0, 1).float()
    err = (triton_fn().float() - expect).abs().max().item()
    rel = err / max(expect.abs().max().item(), 1e-6)
    del expect
    t_tri = timer(triton_fn, iters=iters)
    t_sdpa = timer(sdpa_fn, iters=iters)
    flops = 4 * hq * d * n * (n + 1) / 2  # QK^T and PV over the causal half
    # bytes the kernel must move at least: q, k, v in and the output out
    moved = (2 * q.numel() + k.numel() + v.numel()) * q.element_size()
    return {
        "time_triton_s": t_tri,
        "time_sdpa_s": t_sdpa,
        "ratio_sdpa_over_triton": t_sdpa / t_tri,
        "TFLOPs_triton": flops / t_tri / 1e12,
        "TFLOPs_sdpa": flops / t_sdpa / 1e12,
        "bytes": moved,
        "GBps": moved / t_tri / 1e9,
        "max_abs_err": err,
        "max_rel_err": rel,
    }


def kv_write_case(
    ops,
    ref,
    timer,
    hkv,
    d,
    kv,
    device,
    iters,
    *,
    tokens: int = DECODE_BATCH * 16,
    num_blocks: int = 4096,
    dtype=torch.bfloat16,
) -> dict:
    """Scattering `tokens` new keys and values into random slots of the paged cache."""
    gen = torch.Generator(device=device).manual_seed(2)
    k = torch.randn(tokens, hkv, d, dtype=dtype, device=device, generator=gen)
    v = torch.randn(tokens, hkv, d, dtype=dtype, device=device, generator=gen)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=torch.Generator().manual_seed(2))[:tokens].to(device)
    ours = _random_cache(num_blocks, hkv, d, kv, device, gen, dtype)
    theirs = tuple(None if t is None else t.clone() for t in ours)
    ops.write_kv(k, v, ours[0], ours[1], slots, ours[2], ours[3])
    ref.write_kv_ref(k, v, theirs[0], theirs[1], slots, theirs[2], theirs[3])
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip(ours, theirs) if a is not None)
    t = timer(lambda: ops.write_kv(k, v, ours[0], ours[1], slots, ours[2], ours[3]), iters=iters)
    moved = (k.numel() + v.numel()) * (k.element_size() + ours[0].element_size()) + slots.numel() * 8
    return {"time_s": t, "bytes": moved, "GBps": moved / t / 1e9, "max_abs_err": err}


def fused_moe_case(
    ops,
    ref,
    timer,
    device,
    iters,
    *,
    tokens: int = 256,
    hidden: int = 2048,
    inter: int = 768,
    experts: int = 64,
    top_k: int = 8,
    dtype=torch.bfloat16,
) -> dict:
    """The MoE MLP of `tokens` tokens routed to `top_k` of `experts` (Qwen3-30B-A3B's shape by
    default): bytes = the chosen experts' weights, read once."""
    gen = torch.Generator(device=device).manual_seed(3)
    h = torch.randn(tokens, hidden, dtype=dtype, device=device, generator=gen) * 0.1
    w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device=device, generator=gen) * 0.02
    w2 = torch.randn(experts, hidden, inter, dtype=dtype, device=device, generator=gen) * 0.02
    logits = torch.randn(tokens, experts, device=device, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, -1)
    weights = weights.to(dtype)
    out = ops.fused_moe(h, w13, w2, weights, ids)
    expect = ref.fused_moe_ref(h, w13, w2, weights, ids)
    err = (out.float() - expect.float()).abs().max().item()
    t = timer(lambda: ops.fused_moe(h, w13, w2, weights, ids), iters=iters)
    used = int(torch.unique(ids).numel())
    moved = used * (w13[0].numel() + w2[0].numel()) * w13.element_size() + 2 * h.numel() * h.element_size()
    return {"time_s": t, "bytes": moved, "GBps": moved / t / 1e9, "max_abs_err": err, "experts_used": used}


DECODE_GRID = [
    dict(block_n=bn, num_warps=w, num_stages=s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
]
PREFILL_GRID = [
    dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
    for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
]


def sweep(
    ops,
    timer,
    device,
    log,
    *,
    shapes=SHAPES,
    grids=None,
    deadline: float | None = None,
    decode_sizes: dict | None = None,
    prefill_sizes: dict | None = None,
    dtype=torch.bfloat16,
    iters: tuple[int, int] = (10, 5),
) -> dict:
    """Time each launch configuration of `grids` ({"decode": [...], "prefill": [...]}) per shape;
    per shape and kind, the three fastest and the default configuration's time (timed first, as
    the grid's, so both meet the same conditions). Stops where time.monotonic() passes `deadline`
    (what was timed is kept, `complete` False)."""
    grids = grids or {"decode": DECODE_GRID, "prefill": PREFILL_GRID}
    best: dict = {}
    for label, hq, hkv, d in shapes:
        for kind, grid in grids.items():
            default = ops.decode_config(d, dtype, dtype) if kind == "decode" else ops.extend_config(d, dtype)
            key = f"{kind} {label} {hq}q/{hkv}kv d{d}"
            rows, complete = [], True
            for i, cfg in enumerate([default, *(c for c in grid if c != default)]):
                if deadline is not None and time.monotonic() > deadline:
                    complete = False
                    break
                try:
                    if kind == "decode":
                        sized = decode_sizes or {}
                        its = iters[0]
                        r = decode_case(ops, None, timer, hq, hkv, d, "bf16", device, its, cfg, dtype=dtype, **sized)
                    else:
                        sized = prefill_sizes or {}
                        r = prefill_case(ops, timer, hq, hkv, d, device, iters[1], cfg, dtype=dtype, **sized)
                except Exception as e:  # e.g. out of shared memory
                    log(f"  sweep {key} {cfg}: failed ({type(e).__name__})")
                    continue
                rows.append((r["time_s"], cfg, i == 0))
            if not rows:
                continue
            default_us = next((t * 1e6 for t, _, first in rows if first), None)
            rows.sort(key=lambda r: r[0])
            best[key] = {
                "default": {**default, "time_us": default_us},
                "fastest": [{"time_us": t * 1e6, **cfg} for t, cfg, _ in rows[:3]],
                "configs_timed": len(rows),
                "complete": complete,
            }
            speedup = f", {default_us / (rows[0][0] * 1e6):.2f}x the default" if default_us else ""
            log(f"  {key}: best {rows[0][1]} {rows[0][0] * 1e6:.1f} us{speedup} ({len(rows)} configs)")
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout (the table goes to stderr)")
    p.add_argument("--kv", default="bf16", help="comma-separated KV cache formats for decode: bf16,int8,fp8")
    p.add_argument("--iters", type=int, default=20, help="timed runs per measurement (median reported)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch configurations")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kernels/bench.py measures GPU kernels and needs CUDA, which this machine does not have "
            "(torch.cuda.is_available() is False). Nothing to do.",
            file=sys.stderr,
        )
        return 2
    kvs = [s.strip() for s in args.kv.split(",") if s.strip()]
    for s in kvs:
        _kv_store(s)  # KeyError on an unknown format

    import triton

    ops, ref = _import_ops()
    out_stream = sys.stderr if args.json else sys.stdout

    def log(msg=""):
        print(msg, file=out_stream, flush=True)

    device = torch.device(DEVICE)
    props = torch.cuda.get_device_properties(device)
    result = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "decode_batch": DECODE_BATCH,
        "decode_ctx": DECODE_CTX,
        "prefill_len": PREFILL_LEN,
        "block_size": BLOCK_SIZE,
    }
    timer = Timer(device)
    t0 = time.time()
    log(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}")
    limits = measure_limits(timer, device)
    result["limits"] = limits
    log(
        f"limits: device copy {limits['copy_GBps']:.0f} GB/s (read + write), "
        f"bf16 matmul {limits['matmul_n']}^3 {limits['matmul_TFLOPs']:.0f} TFLOP/s"
    )

    log(f"\ndecode: batch {DECODE_BATCH} x {DECODE_CTX} context, bf16 queries, {BLOCK_SIZE}-token blocks")
    head = (
        f"{'shape':<10}{'heads':>7}{'d':>5}{'kv':>6}{'splits':>7}{'us':>9}{'GB/s':>8}{'%copy':>7}"
        f"{'us(1)':>9}{'GB/s(1)':>9}{'%copy':>7}{'rel err':>10}"
    )
    log(head)
    result["decode"] = []
    for (label, hq, hkv, d), kv in itertools.product(SHAPES, kvs):
        row = {"shape": label, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "kv": kv}
        try:
            row.update(decode_case(ops, ref, timer, hq, hkv, d, kv, device, args.iters))
            row["frac_copy_auto"] = row["GBps_auto"] / limits["copy_GBps"]
            row["frac_copy_nosplit"] = row["GBps_nosplit"] / limits["copy_GBps"]
            flag = "" if row["max_rel_err"] < REL_TOL else "  MISMATCH"
            log(
                f"{label:<10}{f'{hq}/{hkv}':>7}{d:>5}{kv:>6}{row['splits_auto']:>7}"
                f"{row['time_auto_s'] * 1e6:>9.1f}{row['GBps_auto']:>8.0f}{100 * row['frac_copy_auto']:>6.0f}%"
                f"{row['time_nosplit_s'] * 1e6:>9.1f}{row['GBps_nosplit']:>9.0f}{100 * row['frac_copy_nosplit']:>6.0f}%"
                f"{row['max_rel_err']:>10.2e}{flag}"
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"{label:<10}{f'{hq}/{hkv}':>7}{d:>5}{kv:>6}  FAILED {row['error'][:200]}")
        result["decode"].append(row)
        torch.cuda.empty_cache()

    log(f"\nprefill: one causal {PREFILL_LEN}-token prompt, bf16; SDPA on contiguous head-expanded K/V")
    log(
        f"{'shape':<10}{'heads':>7}{'d':>5}{'triton us':>11}{'TFLOP/s':>9}{'sdpa us':>10}{'TFLOP/s':>9}"
        f"{'sdpa/triton':>13}{'rel err':>10}"
    )
    result["prefill"] = []
    for label, hq, hkv, d in SHAPES:
        row = {"shape": label, "q_heads": hq, "kv_heads": hkv, "head_dim": d}
        try:
            row.update(prefill_case(ops, timer, hq, hkv, d, device, max(5, args.iters // 2)))
            flag = "" if row["max_rel_err"] < REL_TOL else "  MISMATCH"
            log(
                f"{label:<10}{f'{hq}/{hkv}':>7}{d:>5}{row['time_triton_s'] * 1e6:>11.1f}{row['TFLOPs_triton']:>9.0f}"
                f"{row['time_sdpa_s'] * 1e6:>10.1f}{row['TFLOPs_sdpa']:>9.0f}{row['ratio_sdpa_over_triton']:>13.2f}"
                f"{row['max_rel_err']:>10.2e}{flag}"
            )
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"{label:<10}{f'{hq}/{hkv}':>7}{d:>5}  FAILED {row['error'][:200]}")
        result["prefill"].append(row)
        torch.cuda.empty_cache()

    if args.sweep:
        log("\nsweep (bf16, automatic splits for decode):")
        result["sweep"] = sweep(ops, timer, device, log)
    result["wall_s"] = time.time() - t0
    log(f"\n{result['wall_s']:.0f} s")
    if args.json:
        print(json.dumps(result, default=str))
    failed = any("error" in r for r in result["decode"] + result["prefill"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
