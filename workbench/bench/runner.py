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
  `hf_static` in batches of `hf_batch_size`, its KV in transformers' dynamic or static cache
  (`hf_cache`), compiled by `generate` where `hf_compile` (a static cache on CUDA; the whole
  workload is run once untimed first, so the timed run finds its graphs compiled);
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
from .compare import add_comparisons
from .driver import run_workload
from .peers import cache_kwargs
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
    hf_cache: str = "dynamic",
    hf_compile: bool = False,
    llama_server: str | None = None,
    vllm_python: str | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the benchmark and return the report (see the module doc).

    `quick` shrinks everything (prompt 32-128, output 16-64 tokens unless given, a 64-token single
    stream, smaller roofline probes) for smoke tests; the default is the full workload.
    """
    from ..settings import EngineSettings, validate

    systems = list(systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; known: {', '.join(SYSTEMS)}")
    if hf_dtype not in HF_DTYPES:
        raise ValueError(f"invalid hf_dtype {hf_dtype!r}; allowed: {', '.join(HF_DTYPES)}")
    hf_generate_kw = cache_kwargs(hf_cache, hf_compile)  # refuses a bad pair before anything loads
    notes: list[str] = []
    peers = _find_peers(model, systems, llama_server, vllm_python, notes)
    settings = validate(dict(settings or {}))
    eff = EngineSettings(**settings)
    dtype = {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        eff.dtype
    ]
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if eff.device == "auto" else eff.device)
    (log or (lambda msg: None))("loading the model")
    config, tokenizer, hf_path = _model_config(model, systems, dtype)
    run = _Run(
        model=model,
        systems=systems,
        settings=settings,
        eff=eff,
        device=device,
        config=config,
        hf_path=hf_path,
        single_stream=single_stream,
        progress=progress or _no_progress,
        log=log or (lambda msg: None),
        notes=notes,
    )
    run.make_workloads(
        tokenizer,
        num_requests=num_requests,
        seed=seed,
        prompt_len=tuple(prompt_len or ((32, 128) if quick else DEFAULT_PROMPT_LEN)),
        output_len=tuple(output_len or ((16, 64) if quick else DEFAULT_OUTPUT_LEN)),
        arrival=arrival,
        rate=rate,
        ss_tokens=single_stream_tokens or (64 if quick else SINGLE_STREAM_TOKENS),
    )
    report = run.report = {
        "model": config.name,
        "model_path": config.path,
        "machine": machine_info(),
        "loadavg_start": _loadavg(),
        "settings": eff.as_dict(),
        "workload": run.workload.describe(),
        "systems": systems,
        "notes": notes,
    }
    run.log("measuring the roofline")
    costs = model_costs(config, dtype, eff.quantization, eff.quant_group_size)
    run.roof = report["roofline"] = measure_roofline(
        costs, dtype=dtype, quick=quick, workload=run.workload, hidden_size=config.hidden_size, device=device
    )
    if "workbench" in systems:
        run.workbench()
        _release(device)  # its engine, before the next system loads its model
    if "hf_static" in systems or "hf_sequential" in systems:
        run.transformers(hf_dtype, dtype, hf_batch_size, hf_generate_kw if "hf_static" in systems else {})
        _release(device)
    if "llama_server" in systems:
        run.llama_server(*peers["llama_server"])
    for name in ("workbench_http", "vllm"):
        if name in systems:
            run.server(name, peers.get("vllm"))
    report["results"] = {name: run.results[name] for name in RESULT_ORDER if name in run.results}
    add_comparisons(report, run.records)
    report["loadavg_end"] = _loadavg()
    report["argv"] = sys.argv[1:]
    return report


# results in this order: each system's single stream after it
RESULT_ORDER = (
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


def _release(device: torch.device) -> None:
    """Give a finished system's memory back: on CUDA to the device too, so the next system's large
    tensors (an 8B model's KV caches) do not have to fit the cached blocks' sizes."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _find_peers(model, systems: list[str], llama_server, vllm_python, notes: list[str]) -> dict:
    """The peers' builds: llama-server and its GGUF, vLLM's Python. A peer not found is dropped
    from `systems` with a note saying how to get it."""
    from .llama_cpp import HOW_TO_GET, find_llama_server, model_gguf
    from .vllm_peer import HOW_TO_GET as HOW_TO_GET_VLLM
    from .vllm_peer import find_vllm_python

    peers: dict[str, Any] = {}
    if "llama_server" in systems:
        binary, gguf = find_llama_server(llama_server), model_gguf(model)
        if binary is None or gguf is None:
            notes.append(f"llama_server skipped: {HOW_TO_GET if binary is None else 'the model has no GGUF file'}")
            systems.remove("llama_server")
        peers["llama_server"] = (binary, gguf)
    if "vllm" in systems:
        peers["vllm"] = find_vllm_python(vllm_python)
        if peers["vllm"] is None:
            notes.append(f"vllm skipped: {HOW_TO_GET_VLLM}")
            systems.remove("vllm")
    if "vllm" in systems and "workbench" in systems and "workbench_http" not in systems:
        systems.append("workbench_http")  # the same server path as vLLM's, for the ratio
    return peers


def _model_config(model, systems: list[str], dtype: torch.dtype):
    """(config, tokenizer, the transformers folder the peers load): a shape's config (no weights
    read), or the model loaded once for its config and tokenizer."""
    from ..models import shapes
    from ..models.loader import load_model

    if shapes.shape_of(model):
        return shapes.shape_config(shapes.shape_of(model)), None, model
    loaded = load_model(model, dtype=dtype)
    hf_path = hf_folder(model, loaded) if any(s.startswith("hf_") or s == "vllm" for s in systems) else None
    config, tokenizer = loaded.config, loaded.tokenizer
    del loaded
    gc.collect()
    return config, tokenizer, hf_path


@dataclasses.dataclass
class _Run:
    """One benchmark run's shared state: what it runs on, its workloads, and what it found."""

    model: Any
    systems: list[str]
    settings: dict
    eff: Any
    device: torch.device
    config: Any
    hf_path: str | None
    single_stream: bool
    progress: Progress
    log: Callable[[str], None]
    notes: list[str]
    report: dict = dataclasses.field(default_factory=dict)
    roof: dict = dataclasses.field(default_factory=dict)
    results: dict[str, dict] = dataclasses.field(default_factory=dict)
    records: dict[str, list[RequestRecord]] = dataclasses.field(default_factory=dict)

    def make_workloads(self, tokenizer, *, num_requests, seed, prompt_len, output_len, arrival, rate, ss_tokens):
        config = self.config
        self.workload = make_workload(
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
        self.ss_workload = Workload([ss_req], seed)
        # ours and transformers: the same tokens in segments, the bandwidth read around each
        part = dataclasses.replace(ss_req, max_tokens=max(2, ss_tokens // SINGLE_STREAM_SEGMENTS))
        self.ss_part = Workload([part], seed)

    def _bar(self, name: str, total: int, fn):
        bar = self.progress(name, total)
        try:
            return fn(bar)
        finally:
            bar.close()

    def workbench(self) -> None:
        from ..llm import LLM

        self.log("workbench: loading the engine")
        engine = LLM(self.model, **self.settings)
        warm_up_engine(engine, self.config.vocab_size)
        recs, start = self._bar(
            "workbench", len(self.workload), lambda bar: run_workload(engine, self.workload.requests, progress=bar)
        )
        self.results["workbench"] = {**summarize(recs, start), "step_breakdown": _breakdown(engine, start)}
        self.records["workbench"] = recs
        self.report["engine_status"] = {k: v for k, v in engine.status().items() if k not in ("pid", "uptime_s")}
        if self.single_stream:
            engine.reset_prefix_cache()
            segments = self._bar(
                "workbench_single_stream",
                SINGLE_STREAM_SEGMENTS,
                lambda bar: run_segments(
                    lambda: run_workload(engine, self.ss_part.requests, progress=bar), self.device
                ),
            )
            # the last segment's steps: the span of all of them would count the bandwidth readings
            # between segments as time between steps
            self.results["workbench_single_stream"] = {
                **single_stream_summary(segments, self.roof),
                "step_breakdown": _breakdown(engine, segments[-1][1]),
            }
            self.records["workbench_single_stream"] = segment_records(segments)

    def transformers(self, hf_dtype: str, dtype: torch.dtype, hf_batch_size: int, hf_static_kw: dict) -> None:
        from .peers import load_hf_model, run_hf, warm_up

        hf_torch_dtype, self.report["hf_dtype_reason"] = _hf_dtype(hf_dtype, dtype, self.device, self.roof)
        self.report["hf_dtype"] = str(hf_torch_dtype).removeprefix("torch.")
        self.log(f"hf: loading transformers in {self.report['hf_dtype']} ({self.report['hf_dtype_reason']})")
        hf = load_hf_model(self.hf_path, hf_torch_dtype, self.device)
        warm_up(hf, self.config.vocab_size)
        for name in [s for s in ("hf_static", "hf_sequential") if s in self.systems]:
            batch = hf_batch_size if name == "hf_static" else 1
            kw = hf_static_kw if name == "hf_static" else {}
            if name == "hf_static":
                self.report["hf_static"] = self._hf_static_warm(hf, batch, kw)

            def serve(bar, batch=batch, kw=kw):
                return run_hf(hf, self.workload, batch_size=batch, progress=bar.update, generate_kw=kw)

            recs, start = self._bar(name, len(self.workload), serve)
            self.results[name] = summarize(recs, start)
            self.records[name] = recs
        if self.single_stream and "hf_sequential" in self.systems:
            segments = self._bar(
                "hf_single_stream",
                SINGLE_STREAM_SEGMENTS,
                lambda bar: run_segments(
                    lambda: run_hf(hf, self.ss_part, batch_size=1, progress=bar.update), self.device
                ),
            )
            self.results["hf_single_stream"] = single_stream_summary(segments, self.roof)
            self.records["hf_single_stream"] = segment_records(segments)

    def _hf_static_warm(self, hf, batch: int, kw: dict) -> dict:
        """How `hf_static` runs (batch, cache, compiled?); compiling, it serves the workload once
        untimed first: each batch shape compiles once, and the timed run must find it compiled."""
        from torch._dynamo.utils import counters

        from .peers import run_hf

        before = counters["frames"]["ok"]
        if not kw.get("disable_compile", True):
            self.log("hf_static: the workload once untimed, compiling generate's forward")
            run_hf(hf, self.workload, batch_size=batch, generate_kw=kw)
        return {
            "batch_size": batch,
            "cache": kw.get("cache_implementation", "dynamic"),
            "compile_asked": kw.get("disable_compile") is False,
            "frames_compiled": counters["frames"]["ok"] - before,  # torch.compile's: 0 where nothing compiled
        }

    def _runs(self, name: str) -> dict:
        return {name: self.workload, **({f"{name}_single_stream": self.ss_workload} if self.single_stream else {})}

    def llama_server(self, binary, gguf) -> None:
        from .llama_cpp import run_llama_server

        try:
            summaries, self.report["llama_server"] = run_llama_server(
                binary, gguf, self._runs("llama_server"), threads=torch.get_num_threads(), progress=self.progress,
                log=self.log,
            )  # fmt: skip
        except RuntimeError as e:
            self.notes.append(f"llama_server failed: {e}")
            summaries = {}
        self._add_endpoint("llama_server", summaries)

    def server(self, name: str, vllm_python) -> None:
        """A system measured through its HTTP server: vLLM's, or ours (the same client for both)."""
        from .vllm_peer import run_vllm_server, workbench_http_server

        runs = self._runs(name)
        try:
            if name == "vllm":
                summaries, self.report["vllm"] = run_vllm_server(
                    vllm_python, self.hf_path, runs, threads=torch.get_num_threads(),
                    max_num_seqs=self.eff.max_num_seqs, progress=self.progress, log=self.log,
                )  # fmt: skip
            else:
                peer = workbench_http_server(self.model, self.settings, name=f"bench-http-{os.getpid()}")
                summaries, self.report[name] = serve_workloads(peer, runs, progress=self.progress, log=self.log)
        except RuntimeError as e:
            self.notes.append(f"{name} failed: {e}")
            summaries = {}
        self._add_endpoint(name, summaries)

    def _add_endpoint(self, name: str, summaries: dict) -> None:
        self.results.update(summaries)
        if f"{name}_single_stream" in self.results:
            _endpoint_single_stream(self.results[f"{name}_single_stream"])


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
