"""`workbench bench`: its arguments and its three runs (the peer comparison, `--scenario`,
`--endpoint`). Heavy imports stay inside the run functions, so `workbench --help` is fast."""

from __future__ import annotations

import argparse
import sys

from ..settings import add_setting_flags, settings_from_flags


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`workbench bench`: the peer comparison, a scenario (--scenario) or endpoints (--endpoint)."""
    p = sub.add_parser(
        "bench",
        help="benchmark the engine against Hugging Face transformers, with the measured roofline",
        description="Run a fixed, seeded workload (default: 64 requests released at once, prompts 32-512 "
        "tokens of English text, outputs 32-256 tokens with ignore_eos, greedy) on each system; "
        "measure memory bandwidth and matmul FLOP/s on the spot; report output tok/s, TTFT and "
        "ITL percentiles, ratios and fractions of the roofline. Progress goes to stderr.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of a table")
    p.add_argument(
        "--requests", type=int, default=None, metavar="N", help="number of requests (default 64; 8 with --quick)"
    )
    p.add_argument(
        "--systems",
        default="workbench,hf_sequential,hf_static,llama_server,vllm",
        help="comma-separated: workbench, hf_sequential, hf_static, llama_server, vllm, workbench_http "
        "(default: all but workbench_http, which vllm brings along: our engine behind `serve --http`, "
        "measured through the same client as vLLM's server); llama_server and vllm run when found, "
        "else the report says how to get them",
    )
    p.add_argument(
        "--hf-dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="dtype of the transformers peers (auto: bf16 or fp32, whichever matmul measures faster here)",
    )
    p.add_argument(
        "--hf-batch-size", type=int, default=None, help="requests per padded batch of hf_static (default 16)"
    )
    p.add_argument(
        "--hf-cache",
        choices=["dynamic", "static"],
        default="dynamic",
        help="hf_static's KV cache: transformers' growing dynamic cache (default) or its preallocated static one",
    )
    p.add_argument(
        "--hf-compile",
        action="store_true",
        help="with --hf-cache static: let generate compile its forward (torch.compile; transformers does on "
        "CUDA); the workload is run once untimed first",
    )
    p.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-server binary (default: $WORKBENCH_LLAMA_SERVER, then PATH)",
    )
    p.add_argument(
        "--vllm-python",
        default=None,
        metavar="PATH",
        help="the Python of a venv with vLLM (default: $WORKBENCH_VLLM_PYTHON, then .peers/vllm from `make peers`)",
    )
    p.add_argument(
        "--arrival",
        choices=["all", "poisson", "bursty"],
        default="all",
        help="all: every request at t=0 (default); poisson: exponential gaps at --rate; bursty: clumps "
        "and lulls at the same mean --rate (gamma gaps, twice the spread)",
    )
    p.add_argument("--rate", type=float, default=0.5, help="poisson arrivals: requests per second (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--model", default=None, help="'smollm2-135m' (default), a HF folder or a .gguf file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small smoke run: 8 requests, prompts 32-128, outputs 16-64, 64-token single stream "
        "(with --scenario: the small sizes of scenarios.QUICK)",
    )
    p.add_argument(
        "--no-single-stream", dest="single_stream", action="store_false", help="skip the single-stream decode scenario"
    )
    p.add_argument("--output", default=None, metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch intra-op threads for every system (default: torch's choice)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        default=None,
        choices=["prefix", "quant", "spec", "stall", "long_prompt", "structured"],
        help="instead of the peer comparison, measure one optimisation on and off in this run "
        "(workbench/bench/scenarios.py): prefix caching TTFT, int8/int4 decode (with "
        "transformers' TorchAoConfig int8/int4 as the peer), n-gram/draft speculation (with "
        "transformers' prompt lookup as the peer), a stream's worst stall while oversized "
        "prompts arrive (stall), or 8 streams' worst gap while an 8,000-token prompt prefills "
        "(long_prompt: the step bounded by the settings, and by tokens alone), or W64 under a JSON schema "
        "against the same workload free (structured; with vLLM's constrained run as the peer); repeatable; "
        "recorded in the run log",
    )
    g = p.add_argument_group("OpenAI-compatible endpoints (workbench/bench/endpoint.py; replaces --systems)")
    g.add_argument(
        "--endpoint",
        action="append",
        default=None,
        metavar="[LABEL=]URL",
        help="benchmark this server (ours via `serve --http`, vLLM, SGLang, TGI, llama.cpp) with the same "
        "seeded workload; repeat to compare several side by side (e.g. --arrival poisson --rate 4)",
    )
    g.add_argument("--api-key", default=None, help="bearer token for the endpoints (default: $WORKBENCH_API_KEY)")
    g.add_argument("--served-model", default=None, help="model name at the endpoints (default: their first)")
    g.add_argument("--tokenizer", default=None, help="tokenizer for the workload text (default: the embedded one)")
    g.add_argument("--token-ids", action="store_true", help="send prompts as token ids (servers of the same model)")
    g.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="at most N requests in flight")
    g.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS (default: ignore_eos where the server supports it)",
    )
    add_setting_flags(p)
    p.set_defaults(_run=_run_bench)


def _progress_factory():
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None

    def make(desc: str, total: int):
        if tqdm is not None:
            return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True, dynamic_ncols=True)
        return _PlainProgress(desc, total)

    return make


class _PlainProgress:
    def __init__(self, desc: str, total: int):
        self.desc, self.total, self.n = desc, total, 0
        print(f"{desc}: 0/{total}", file=sys.stderr, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{self.desc}: {self.n}/{self.total}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "endpoint", None):
        return _run_bench_endpoints(args)
    if getattr(args, "scenario", None):
        return _run_bench_scenarios(args)
    from . import SYSTEMS, format_report, run_bench
    from .report import single_stream_line

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in SYSTEMS]
    try:
        if bad or not systems:
            raise ValueError(f"unknown system(s) {bad or systems}; choose from {', '.join(SYSTEMS)}")
        settings = settings_from_flags(args)
        _check_workload(args)
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        if args.llama_server is not None:
            from .llama_cpp import find_llama_server

            find_llama_server(args.llama_server)
        if args.vllm_python is not None:
            from .vllm_peer import find_vllm_python

            find_vllm_python(args.vllm_python)
    except (ValueError, TypeError) as e:
        print(f"workbench bench: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    report = run_bench(
        args.model,
        systems=systems,
        num_requests=args.requests or (8 if args.quick else 64),
        arrival=args.arrival,
        rate=args.rate if args.arrival in ("poisson", "bursty") else None,
        seed=args.seed,
        quick=args.quick,
        settings=settings,
        single_stream=args.single_stream,
        hf_dtype=args.hf_dtype,
        **({"hf_batch_size": args.hf_batch_size} if args.hf_batch_size else {}),
        hf_cache=args.hf_cache,
        hf_compile=args.hf_compile,
        llama_server=args.llama_server,
        vllm_python=args.vllm_python,
        progress=_progress_factory(),
        log=_log,
    )
    text = _write_json(report, args.output)
    # gpt-fast style: every run prints tok/s, GB/s and % of the limit (stderr when stdout is JSON).
    for name, r in report["results"].items():
        if name.endswith("single_stream"):
            _log(single_stream_line(name, r))
    print(text if args.json else format_report(report))
    return 0


def _run_bench_scenarios(args: argparse.Namespace) -> int:
    """`workbench bench --scenario NAME`: one optimisation on and off, ratios against the targets."""
    from .scenarios import run_scenarios

    try:
        settings = settings_from_flags(args)
    except (ValueError, TypeError) as e:
        print(f"workbench bench: {e}", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    report = run_scenarios(args.scenario, args.model, quick=args.quick, vllm_python=args.vllm_python, **settings)
    text = _write_json(report, args.output)
    print(text)
    return 0


def _run_bench_endpoints(args: argparse.Namespace) -> int:
    """`workbench bench --endpoint URL ...`: the seeded workload against OpenAI-compatible servers."""
    from .endpoint import format_endpoint_report, run_endpoint_bench

    try:
        _check_workload(args)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    except ValueError as e:
        print(f"workbench bench: {e}", file=sys.stderr)
        return 2

    kw = dict(prompt_len=(32, 128), output_len=(16, 64)) if args.quick else {}
    report = run_endpoint_bench(
        args.endpoint,
        num_requests=args.requests or (8 if args.quick else 64),
        arrival=args.arrival,
        rate=args.rate,
        seed=args.seed,
        tokenizer_model=args.tokenizer,
        token_ids=args.token_ids,
        ignore_eos=args.ignore_eos,
        api_key=args.api_key,
        model=args.served_model,
        max_concurrency=args.max_concurrency,
        progress=_progress_factory(),
        log=_log,
        **kw,
    )
    text = _write_json(report, args.output)
    print(text if args.json else format_endpoint_report(report))
    return 0


def _check_workload(args: argparse.Namespace) -> None:
    """The workload flags every run takes (ValueError naming the flag)."""
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    if args.arrival in ("poisson", "bursty") and args.rate <= 0:
        raise ValueError(f"--rate must be > 0, got {args.rate}")


def _write_json(report: dict, output: str | None) -> str:
    """The report as JSON; also written to `output` (--output) when given."""
    import json

    text = json.dumps(report, indent=2)
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    return text


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)
