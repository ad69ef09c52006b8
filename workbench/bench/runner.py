"""Runs the benchmark: our engine and the peers on one workload, plus the roofline.

`run_bench(...)` returns the report dict that `workbench bench --json` prints: `results` maps each
system run to its summary (`output_tok_s`, `ttft_p50_ms`, `ttft_p99_ms`, `itl_p50_ms`,
`itl_p99_ms`, ...) and `roofline` holds the measured limits.

Systems:
- `workbench`: our engine in this process (`LLM`), served by the workload driver (`driver.py`):
  requests released when their arrival time comes, the engine stepped in between; TTFT counted
  from each request's release;
- `workbench_single_stream`: a short prompt, 256 output tokens in SINGLE_STREAM_SEGMENTS requests
  one after another, the read bandwidth measured before and after each: decode tok/s, achieved
  GB/s (weight bytes x tok/s) and the median over segments of each one's fraction of its own
  bandwidth (a shared host's rate swings within seconds, so a fraction pairs close-by readings);
- `hf_sequential`, `hf_static`: transformers `generate` (see `peers.py`), in the dtype that is
  faster on this host (`hf_dtype="auto"`: bf16 where the measured bf16 matmul beats fp32, else fp32);
- `llama_server`: llama.cpp's server on the model's GGUF, same requests (see `llama_cpp.py`); with
  a single stream, `llama_server_single_stream` too. Skipped, with a note saying how to get it,
  when no binary is found.
- `vllm`: vLLM's server (its CPU build on a CPU) on the model's Hugging Face folder, same requests
  through the same endpoint client (see `vllm_peer.py`); skipped, saying how to get it, when no
  Python with vLLM is found. With it, `workbench_http` runs too: our engine behind `workbench serve
  --http` through that same client, so the two servers are compared on one path (ratios
  `workbench_http_vs_vllm`); it can also be asked for on its own.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..runs import machine_facts, record_bench
from .driver import run_workload
from .roofline import measure_bandwidth, measure_roofline, model_costs
from .server_peer import serve_workloads
from .stats import NoProgress, RequestRecord, summarize
from .workload import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PROMPT_LEN,
    Workload,
    make_workload,
    single_stream_request,
    text_token_ids,
)

SYSTEMS = ("workbench", "hf_sequential", "hf_static", "llama_server", "vllm", "workbench_http")
DEFAULT_SYSTEMS = ("workbench", "hf_sequential", "hf_static", "llama_server", "vllm")
HF_DTYPES = ("auto", "bfloat16", "float32")
HF_STATIC_BATCH = 16
SINGLE_STREAM_TOKENS = 256

# The targets.
TARGET_VS_HF_SEQUENTIAL = 8.0
TARGET_VS_HF_STATIC = 2.0
TARGET_SINGLE_STREAM_BW_FRACTION = 0.60
TARGET_VS_LLAMA_SERVER = 1.5
TARGET_VS_VLLM = 1.3  # issue 27: W64 output tok/s, both servers through the same client

Progress = Callable[[str, int], Any]  # (description, total) -> object with update(n) and close()


def _no_progress(desc: str, total: int):
    return NoProgress()


# ----------------------------------------------------------------------------- our engine
def warm_up_engine(engine, vocab_size: int) -> None:
    """A prefill and a few batched decodes so one-time costs stay out of the timed run."""
    from ..sampling_params import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    base = [min(7 + i, vocab_size - 1) for i in range(24)]
    engine.generate(prompt_token_ids=[base, base[::-1][:9]], params=sp)
    engine.reset_prefix_cache()


SINGLE_STREAM_SEGMENTS = 4

# One segment of a single-stream run: its records, its start, and the best read bandwidth measured
# just before and just after it.
Segment = tuple[list[RequestRecord], float, float]


def segment_records(segments: list[Segment]) -> list[RequestRecord]:
    """The segments' request records, in order."""
    return [r for recs, _, _ in segments for r in recs]


def single_stream_summary(segments: list[Segment], roof: dict) -> dict:
    """Summary of the single-stream requests plus decode tok/s, achieved GB/s and the fraction of
    the bandwidth measured around each segment, their median: on a shared guest the rate moved
    24-52 GB/s within minutes and a decode step 10.6-18.2 ms within seconds, so one pair of
    readings around a whole run paired a slow run with a fast reading. The roofline's bandwidth
    (the bench's start) is reported beside it."""
    s = summarize(segment_records(segments), segments[0][1])
    weight_bytes, start_bw = roof["weight_bytes"], roof["memory_bandwidth_gb_s"]
    tokens = seconds = 0.0
    fractions, bandwidths = [], []
    for recs, _, bw in segments:
        times = recs[0].token_times
        if len(times) < 2 or times[-1] <= times[0]:
            continue
        n, dt = len(times) - 1, times[-1] - times[0]
        tokens, seconds = tokens + n, seconds + dt
        fractions.append(weight_bytes * n / dt / 1e9 / bw if bw else 0.0)
        bandwidths.append(bw)
    decode_tok_s = tokens / seconds if seconds else 0.0
    gb_s = weight_bytes * decode_tok_s / 1e9
    bandwidth_gb_s = statistics.median(bandwidths) if bandwidths else 0.0
    s.update(
        decode_tok_s=decode_tok_s,
        achieved_gb_s=gb_s,
        bandwidth_gb_s=bandwidth_gb_s,
        bandwidth_fraction=statistics.median(fractions) if fractions else 0.0,
        bandwidth_fraction_segments=fractions,
        bandwidth_fraction_of_roofline=gb_s / start_bw if start_bw else 0.0,
        decode_limit_tok_s=bandwidth_gb_s * 1e9 / weight_bytes,
    )
    return s


def bandwidth_around(run, device) -> tuple[Any, float]:
    """`run()`'s result and the best read bandwidth measured just before and just after it."""
    before = measure_bandwidth(1 << 28, repeats=3, device=device)
    out = run()
    return out, max(before + measure_bandwidth(1 << 28, repeats=3, device=device))


def run_segments(run, device) -> list[Segment]:
    """SINGLE_STREAM_SEGMENTS runs of `run()` (it returns records and start), each between two
    bandwidth readings."""
    out = []
    for _ in range(SINGLE_STREAM_SEGMENTS):
        (recs, start), bw = bandwidth_around(run, device)
        out.append((recs, start, bw))
    return out


# ----------------------------------------------------------------------------- helpers
def hf_folder(model, loaded) -> str:
    """A Hugging Face folder with these weights (a .gguf is converted once into the cache)."""
    if loaded.config.path and Path(loaded.config.path).is_dir():
        return loaded.config.path
    if model is not None and str(model).lower().endswith(".gguf"):
        from ..models.loader import ensure_converted

        return str(ensure_converted(model, Path(model).stem))
    raise ValueError(f"no Hugging Face folder for model {model!r}: the hf_* peers cannot load it")


def token_agreement(reference: list[RequestRecord], other: list[RequestRecord]) -> dict:
    """How far two systems' greedy outputs agree: identical requests, and the share of tokens
    before the first difference (bf16 rounding differs between implementations, so long greedy
    runs can drift apart without either being wrong)."""
    same = 0
    prefix = total = 0
    for a, b in zip(reference, other):
        same += a.token_ids == b.token_ids
        n = 0
        for x, y in zip(a.token_ids, b.token_ids):
            if x != y:
                break
            n += 1
        prefix += n
        total += len(a.token_ids)
    return {
        "identical_requests": same,
        "requests": len(reference),
        "common_prefix_token_fraction": prefix / total if total else 1.0,
    }


def machine_info() -> dict:
    """The report's machine: the run log's machine facts, with the library versions."""
    facts = machine_facts()
    info = {
        "cpu": facts["cpu"],
        "cpu_count": facts["cpu_count"],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": facts["platform"],
        "env": facts["env"],
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ----------------------------------------------------------------------------- the benchmark
@record_bench  # every run lands in the run log (workbench/runs/); record=False / run_log=PATH per call
def run_bench(
    model=None,
    *,
    systems=DEFAULT_SYSTEMS,
    num_requests: int = DEFAULT_NUM_REQUESTS,
    arrival: str = "all",
    rate: float | None = None,
    seed: int = 0,
    quick: bool = False,
    settings: dict | None = None,
    prompt_len: tuple[int, int] | None = None,
    output_len: tuple[int, int] | None = None,
    single_stream: bool = True,
    single_stream_tokens: int | None = None,
    hf_batch_size: int = HF_STATIC_BATCH,
    hf_dtype: str = "auto",
    llama_server: str | None = None,
    vllm_python: str | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the benchmark and return the report (see the module doc).

    `quick` shrinks everything (prompt 32-128, output 16-64 tokens unless given, a 64-token single
    stream, smaller roofline probes) for smoke tests; the default is the full workload.
    """
    from ..models import shapes
    from ..models.loader import load_model
    from ..settings import EngineSettings, validate

    progress = progress or _no_progress
    log = log or (lambda msg: None)
    systems = list(systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if hf_dtype not in HF_DTYPES:
        raise ValueError(f"invalid hf_dtype {hf_dtype!r}; allowed: {', '.join(HF_DTYPES)}")
    from .llama_cpp import HOW_TO_GET, find_llama_server, model_gguf, run_llama_server

    notes: list[str] = []
    llama_binary = find_llama_server(llama_server) if "llama_server" in systems else None
    llama_gguf = model_gguf(model) if "llama_server" in systems else None
    if "llama_server" in systems and (llama_binary is None or llama_gguf is None):
        notes.append(f"llama_server skipped: {HOW_TO_GET if llama_binary is None else 'the model has no GGUF file'}")
        systems.remove("llama_server")
    from .vllm_peer import HOW_TO_GET as HOW_TO_GET_VLLM
    from .vllm_peer import find_vllm_python, run_vllm_server, workbench_http_server

    vllm = find_vllm_python(vllm_python) if "vllm" in systems else None
    if "vllm" in systems and vllm is None:
        notes.append(f"vllm skipped: {HOW_TO_GET_VLLM}")
        systems.remove("vllm")
    if "vllm" in systems and "workbench" in systems and "workbench_http" not in systems:
        systems.append("workbench_http")  # the same server path as vLLM's, for the ratio
    settings = validate(dict(settings or {}))
    eff = EngineSettings(**settings)
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        eff.dtype
    ]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if eff.device == "auto" else eff.device)
    prompt_len = tuple(prompt_len or ((32, 128) if quick else DEFAULT_PROMPT_LEN))
    output_len = tuple(output_len or ((16, 64) if quick else DEFAULT_OUTPUT_LEN))
    ss_tokens = single_stream_tokens or (64 if quick else SINGLE_STREAM_TOKENS)

    log("loading the model")
    hf_path = None
    if shapes.shape_of(model):  # no weights to read here: the config
        config, tokenizer, hf_path = shapes.shape_config(shapes.shape_of(model)), None, model
    else:
        loaded = load_model(model, dtype=dtype)
        config, tokenizer = loaded.config, loaded.tokenizer
        if any(s.startswith("hf_") for s in systems) or "vllm" in systems:
            hf_path = hf_folder(model, loaded)
        del loaded
        gc.collect()
    model_name = config.name

    workload = make_workload(
        num_requests,
        seed=seed,
        tokenizer=tokenizer,
        vocab_size=config.vocab_size,
        prompt_len=prompt_len,
        output_len=output_len,
        arrival=arrival,
        rate=rate,
        special_token_ids=tuple(config.eos_token_ids)
        + ((config.bos_token_id,) if config.bos_token_id is not None else ()),
    )
    ss_req = single_stream_request(
        text_token_ids(tokenizer) if tokenizer is not None else None,
        vocab_size=config.vocab_size,
        max_tokens=ss_tokens,
        seed=seed,
    )
    ss_workload = Workload([ss_req], seed)
    # ours and transformers: the same tokens in segments, the bandwidth read around each
    ss_part = Workload([dataclasses.replace(ss_req, max_tokens=max(2, ss_tokens // SINGLE_STREAM_SEGMENTS))], seed)

    report: dict[str, Any] = {
        "model": model_name,
        "model_path": config.path,
        "machine": machine_info(),
        "loadavg_start": _loadavg(),
        "settings": eff.as_dict(),
        "workload": workload.describe(),
        "systems": systems,
        "notes": notes,
    }

    log("measuring the roofline")
    costs = model_costs(config, dtype, eff.quantization, eff.quant_group_size)
    roof = measure_roofline(
        costs, dtype=dtype, quick=quick, workload=workload, hidden_size=config.hidden_size, device=device
    )
    report["roofline"] = roof

    results: dict[str, dict] = {}
    records: dict[str, list[RequestRecord]] = {}

    if "workbench" in systems:
        from ..llm import LLM

        log("workbench: loading the engine")
        engine = LLM(model, **settings)
        warm_up_engine(engine, config.vocab_size)
        bar = progress("workbench", len(workload))
        try:
            recs, start = run_workload(engine, workload.requests, progress=bar)
        finally:
            bar.close()
        results["workbench"] = summarize(recs, start)
        results["workbench"]["step_breakdown"] = _breakdown(engine, start)
        records["workbench"] = recs
        report["engine_status"] = {k: v for k, v in engine.status().items() if k not in ("pid", "uptime_s")}
        if single_stream:
            engine.reset_prefix_cache()
            bar = progress("workbench_single_stream", SINGLE_STREAM_SEGMENTS)
            try:
                segments = run_segments(lambda: run_workload(engine, ss_part.requests, progress=bar), device)
            finally:
                bar.close()
            results["workbench_single_stream"] = single_stream_summary(segments, roof)
            # the last segment's steps: the span of all of them would count the bandwidth readings
            # between segments as time between steps
            results["workbench_single_stream"]["step_breakdown"] = _breakdown(engine, segments[-1][1])
            records["workbench_single_stream"] = segment_records(segments)
        del engine
        gc.collect()

    hf_systems = [s for s in ("hf_static", "hf_sequential") if s in systems]
    if hf_systems:
        from .peers import load_hf_model, run_hf, warm_up

        hf_torch_dtype, report["hf_dtype_reason"] = _hf_dtype(hf_dtype, dtype, device, roof)
        report["hf_dtype"] = str(hf_torch_dtype).removeprefix("torch.")
        log(f"hf: loading transformers in {report['hf_dtype']} ({report['hf_dtype_reason']})")
        hf = load_hf_model(hf_path, hf_torch_dtype, device)
        warm_up(hf, config.vocab_size)
        for name in hf_systems:
            bar = progress(name, len(workload))
            try:
                recs, start = run_hf(
                    hf, workload, batch_size=hf_batch_size if name == "hf_static" else 1, progress=bar.update
                )
            finally:
                bar.close()
            results[name] = summarize(recs, start)
            records[name] = recs
        if single_stream and "hf_sequential" in systems:
            bar = progress("hf_single_stream", SINGLE_STREAM_SEGMENTS)
            try:
                segments = run_segments(lambda: run_hf(hf, ss_part, batch_size=1, progress=bar.update), device)
            finally:
                bar.close()
            results["hf_single_stream"] = single_stream_summary(segments, roof)
            records["hf_single_stream"] = segment_records(segments)
        del hf
        gc.collect()

    if "llama_server" in systems:
        runs = {"llama_server": workload, **({"llama_server_single_stream": ss_workload} if single_stream else {})}
        try:
            summaries, report["llama_server"] = run_llama_server(
                llama_binary, llama_gguf, runs, threads=torch.get_num_threads(), progress=progress, log=log
            )
        except RuntimeError as e:
            notes.append(f"llama_server failed: {e}")
            summaries = {}
        results.update(summaries)
        if "llama_server_single_stream" in results:
            _endpoint_single_stream(results["llama_server_single_stream"])

    for name in ("workbench_http", "vllm"):
        if name not in systems:
            continue
        runs = {name: workload, **({f"{name}_single_stream": ss_workload} if single_stream else {})}
        try:
            if name == "vllm":
                summaries, report["vllm"] = run_vllm_server(
                    vllm,
                    hf_path,
                    runs,
                    threads=torch.get_num_threads(),
                    max_num_seqs=eff.max_num_seqs,
                    progress=progress,
                    log=log,
                )
            else:
                peer = workbench_http_server(model, settings, name=f"bench-http-{os.getpid()}")
                summaries, report["workbench_http"] = serve_workloads(peer, runs, progress=progress, log=log)
        except RuntimeError as e:
            notes.append(f"{name} failed: {e}")
            summaries = {}
        results.update(summaries)
        if f"{name}_single_stream" in results:
            _endpoint_single_stream(results[f"{name}_single_stream"])

    # Order results as asked, single streams after their system.
    order = [
        s
        for s in (
            "workbench",
            "workbench_single_stream",
            "workbench_http",
            "workbench_http_single_stream",
            "hf_sequential",
            "hf_static",
            "hf_single_stream",
            "llama_server",
            "llama_server_single_stream",
            "vllm",
            "vllm_single_stream",
        )
        if s in results
    ]
    report["results"] = {name: results[name] for name in order}
    _add_comparisons(report, records)
    report["loadavg_end"] = _loadavg()
    report["argv"] = sys.argv[1:]
    return report


def _breakdown(engine, start: float) -> dict:
    """Where the engine's steps since `start` spent their time (`timeline.step_breakdown`)."""
    from ..timeline import step_breakdown

    return step_breakdown(s for s in engine.timeline().steps if s.start >= start)


def _hf_dtype(choice: str, dtype: torch.dtype, device: torch.device, roof: dict) -> tuple[torch.dtype, str]:
    """The transformers peers' dtype: as asked, or (auto) the faster of bf16 and fp32 on this host
    for a bf16 model on a CPU, judged by the roofline's batch-shaped matmuls."""
    if choice != "auto":
        return getattr(torch, choice), "asked for (--hf-dtype)"
    if device.type != "cpu" or dtype != torch.bfloat16:
        return dtype, "the model's dtype"
    rates = roof.get("matmul_by_dtype_gflop_s", {})
    bf, fp = rates.get("bfloat16", 0.0), rates.get("float32", 0.0)
    if fp > bf:
        return torch.float32, f"faster here: fp32 matmul {fp:.0f} GFLOP/s vs bf16 {bf:.0f}"
    return torch.bfloat16, f"faster here: bf16 matmul {bf:.0f} GFLOP/s vs fp32 {fp:.0f}"


def _endpoint_single_stream(summary: dict) -> None:
    """Adds decode tok/s, from its ITL (client-side chunk gaps), to a one-request endpoint run. Its
    weight bytes differ (a GGUF), so no bandwidth fraction is claimed for it."""
    itl = summary.get("itl_p50_ms") or 0.0
    summary["decode_tok_s"] = 1e3 / itl if itl > 0 else 0.0


def _add_comparisons(report: dict, records: dict[str, list[RequestRecord]]) -> None:
    results, roof = report["results"], report["roofline"]
    wl_limit = roof.get("workload", {}).get("output_tok_s_limit", 0.0)
    fractions: dict[str, float] = {}
    for name, r in results.items():
        if name.endswith("single_stream"):
            if "bandwidth_fraction" not in r:
                continue  # another system's weights (llama.cpp's GGUF): our byte count does not apply
            fractions[name] = r["bandwidth_fraction"]
            r["roofline_fraction"] = fractions[name]
        elif wl_limit:
            fractions[name] = r["output_tok_s"] / wl_limit
            r["roofline_fraction"] = fractions[name]
    report["roofline_fraction"] = fractions

    ratios: dict[str, float] = {}
    ours = results.get("workbench")
    for peer in ("hf_sequential", "hf_static", "llama_server", "vllm"):
        if ours and peer in results and results[peer]["output_tok_s"] > 0:
            ratios[f"workbench_vs_{peer}"] = ours["output_tok_s"] / results[peer]["output_tok_s"]
    http, peer = results.get("workbench_http"), results.get("vllm")
    if http and peer and peer["output_tok_s"] > 0:  # both servers, one client: the like-for-like ratio
        ratios["workbench_http_vs_vllm"] = http["output_tok_s"] / peer["output_tok_s"]
        for key in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
            if peer.get(key):
                ratios[f"workbench_http_vs_vllm_{key}"] = http[key] / peer[key]
    ss = results.get("workbench_single_stream")
    for peer, key in (
        ("hf_single_stream", "single_stream_vs_hf"),
        ("llama_server_single_stream", "single_stream_vs_llama_server"),
        ("vllm_single_stream", "single_stream_vs_vllm"),
    ):
        if ss and peer in results and results[peer]["decode_tok_s"] > 0:
            ratios[key] = ss["decode_tok_s"] / results[peer]["decode_tok_s"]
    report["ratios"] = ratios

    agreement = {}
    if "workbench" in records:
        for peer in ("hf_sequential", "hf_static"):
            if peer in records:
                agreement[peer] = token_agreement(records["workbench"], records[peer])
    if "workbench_single_stream" in records and "hf_single_stream" in records:
        agreement["hf_single_stream"] = token_agreement(records["workbench_single_stream"], records["hf_single_stream"])
    report["token_agreement"] = agreement

    targets = []
    if "workbench_vs_hf_sequential" in ratios:
        v = ratios["workbench_vs_hf_sequential"]
        targets.append(
            {
                "name": "throughput vs hf_sequential",
                "value": v,
                "target": TARGET_VS_HF_SEQUENTIAL,
                "met": v >= TARGET_VS_HF_SEQUENTIAL,
            }
        )
    if "workbench_vs_hf_static" in ratios:
        v = ratios["workbench_vs_hf_static"]
        targets.append(
            {
                "name": "throughput vs hf_static",
                "value": v,
                "target": TARGET_VS_HF_STATIC,
                "met": v >= TARGET_VS_HF_STATIC,
            }
        )
    if "workbench_vs_llama_server" in ratios:
        v = ratios["workbench_vs_llama_server"]
        targets.append(
            {
                "name": "throughput vs llama_server",
                "value": v,
                "target": TARGET_VS_LLAMA_SERVER,
                "met": v >= TARGET_VS_LLAMA_SERVER,
            }
        )
    if "workbench_http_vs_vllm" in ratios:
        v = ratios["workbench_http_vs_vllm"]
        targets.append(
            {
                "name": "throughput vs vllm (both served over HTTP)",
                "value": v,
                "target": TARGET_VS_VLLM,
                "met": v >= TARGET_VS_VLLM,
            }
        )
    if ss:
        v = ss["bandwidth_fraction"]
        targets.append(
            {
                "name": "single-stream decode, fraction of bandwidth roofline",
                "value": v,
                "target": TARGET_SINGLE_STREAM_BW_FRACTION,
                "met": v >= TARGET_SINGLE_STREAM_BW_FRACTION,
            }
        )
    report["targets"] = targets
