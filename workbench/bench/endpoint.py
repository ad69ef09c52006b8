"""`workbench bench --endpoint URL`: the same seeded workload against any OpenAI-compatible server.

    workbench bench --endpoint http://127.0.0.1:8000 --endpoint vllm=http://gpu-box:8000 \\
        --requests 64 --arrival poisson --rate 4 --seed 0 --json

    from workbench.bench.endpoint import run_endpoint_bench
    report = run_endpoint_bench(["http://127.0.0.1:8000"], num_requests=32, arrival="poisson", rate=2.0)

Each endpoint gets the identical workload (`make_workload`: prompts cut from the shipped English
text, output lengths and Poisson arrival gaps drawn from one seeded generator), sent as streamed
completions with ``max_tokens`` fixed and ``ignore_eos`` where the server has it, one request
released at each arrival time by the workload driver (`driver.py`, as for our engine), through
`RemoteEngineClient`.

Measured on the client, as vLLM's `benchmark_serving` does: TTFT from sending a request to its
first streamed token; ITL as the gaps between streamed chunks; output tok/s as the tokens the
server reports in `usage` (chunks when it reports none) over first release to last token. The
percentiles are `workbench.bench.stats`' (same code as the engine benchmark).

Prompts travel as text, tokenized here by `--tokenizer` (default: the embedded SmolLM2
tokenizer), so servers with other tokenizers get the same text; `--token-ids` sends the ids
instead, for servers of the same model (exact prompt lengths).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from ..runs import record_bench
from ..sampling_params import SamplingParams
from .driver import Served, serve_workload
from .stats import RequestRecord, summarize
from .workload import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN, Workload, make_workload

DEFAULT_RATE = 4.0  # requests per second for Poisson arrivals


def endpoint_label(url: str, kind: str) -> str:
    from ..remote.wire import split_url

    base, _ = split_url(url)
    return f"{kind}@{base.split('://', 1)[1]}"


def parse_endpoint(spec: str) -> tuple[str | None, str]:
    """'URL' or 'LABEL=URL'."""
    if "=" in spec and not spec.startswith(("http://", "https://")):
        label, url = spec.split("=", 1)
        return label.strip() or None, url.strip()
    return None, spec.strip()


def load_tokenizer(model=None):
    """A tokenizer for the workload text: `model` in the loader's forms (default: the embedded one)."""
    from ..http.server import load_front_tokenizer

    tok = load_front_tokenizer(model if model is not None else "smollm2-135m")
    if tok is None:
        raise ValueError(f"no tokenizer found for {model!r}; pass a model folder with tokenizer.json or a .gguf file")
    return tok


def endpoint_summary(served: list[Served], start: float) -> dict:
    """`summarize` over chunk times, with token counts from the server's usage when it gives them."""
    records, tokens, prompt_tokens, errors = [], 0, 0, 0
    for i, s in enumerate(served):
        out = s.output
        usage = (out.usage if out is not None else None) or {}
        if s.error is not None or (out is not None and out.error is not None):
            errors += 1
        times = list(out.metrics.token_times) if out is not None else []
        n = usage.get("completion_tokens") or (len(out.token_ids) if out is not None else 0) or len(times)
        p = usage.get("prompt_tokens") or (len(out.prompt_token_ids) if out is not None else 0) or s.request.prompt_len
        tokens += n
        prompt_tokens += p
        # ITL as gaps between streamed chunks (a chunk's tokens share its arrival time)
        chunks = [t for k, t in enumerate(times) if k == 0 or t != times[k - 1]]
        records.append(
            RequestRecord(
                i,
                s.arrival,
                p,
                list(out.token_ids) if out is not None else [],
                chunks,
                out.metrics.finished if out is not None else None,
            )
        )
    summary = summarize(records, start)
    duration = summary["duration_s"]
    summary.update(
        output_tokens=tokens,
        prompt_tokens=prompt_tokens,
        output_tok_s=tokens / duration,
        total_tok_s=(tokens + prompt_tokens) / duration,
        errors=errors,
        request_throughput=len(served) / duration,
    )
    return summary


@record_bench  # recorded in the run log (workbench/runs/); record=False / run_log=PATH per call
def run_endpoint_bench(
    endpoints: list[str],
    *,
    num_requests: int = 64,
    arrival: str = "poisson",
    rate: float | None = DEFAULT_RATE,
    seed: int = 0,
    prompt_len: tuple[int, int] = DEFAULT_PROMPT_LEN,
    output_len: tuple[int, int] = DEFAULT_OUTPUT_LEN,
    tokenizer_model=None,
    token_ids: bool = False,
    ignore_eos: bool = True,
    api_key: str | None = None,
    model: str | None = None,
    max_concurrency: int | None = None,
    warmup: bool = True,
    timeout: float | None = 3600.0,
    progress: Callable[[str, int], Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Run the workload on each endpoint in turn; the report has `results` keyed by endpoint
    label ("<kind>@host:port" or the LABEL of 'LABEL=URL'), as `workbench bench --json`."""
    import warnings

    from ..remote import RemoteEngineClient

    log = log or (lambda msg: None)
    tok = load_tokenizer(tokenizer_model)
    workload: Workload = make_workload(
        num_requests,
        seed=seed,
        tokenizer=tok,
        prompt_len=tuple(prompt_len),
        output_len=tuple(output_len),
        arrival=arrival,
        rate=rate if arrival in ("poisson", "bursty") else None,
    )
    requests = [
        r if token_ids else dataclasses.replace(r, prompt=tok.decode(r.prompt_token_ids, skip_special_tokens=True))
        for r in workload.requests
    ]
    report: dict[str, Any] = {
        "mode": "endpoint",
        "workload": {
            **workload.describe(),
            "prompt_format": "token_ids" if token_ids else "text",
            "ignore_eos": ignore_eos,
            "max_concurrency": max_concurrency,
        },
        "endpoints": {},
        "results": {},
        "roofline": {},  # the servers' hardware is not measured from here
        "notes": [
            "TTFT: send to first streamed token; ITL: gaps between streamed chunks; output tokens from the "
            "server's usage counts (client-side timing, network included)"
        ],
    }
    for spec in endpoints:
        label, url = parse_endpoint(spec)
        log(f"connecting to {url}")
        with RemoteEngineClient(url, api_key=api_key, model=model) as client:
            label = label or endpoint_label(url, client.kind)
            if warmup:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    client.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0), timeout=timeout)
            bar = progress(label, len(requests)) if progress is not None else None
            log(f"{label}: {len(requests)} requests ({arrival}{f' at {rate}/s' if arrival != 'all' else ''})")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    served, start = serve_workload(
                        client,
                        requests,
                        max_concurrency=max_concurrency,
                        progress=bar,
                        ignore_eos=ignore_eos,
                        keep_errors=True,
                        check=_deadline(timeout),
                    )
            finally:
                if bar is not None:
                    bar.close()
            summary = endpoint_summary(served, start)
            report["results"][label] = summary
            report["endpoints"][label] = {
                "url": client.base,
                "server": client.kind,
                "model": client.model,
                "metrics_endpoint": client.has_metrics,
                "dropped_params": sorted({str(w.message).split("SamplingParams.")[-1].split(";")[0] for w in caught}),
                "server_metrics_after": {
                    k: v
                    for k, v in client.metrics().items()
                    if k.startswith("server_") or k in ("total_output_tokens", "kv_usage")
                },
            }
            if summary["errors"]:
                first = next(
                    s.error or s.output.error
                    for s in served
                    if s.error is not None or (s.output is not None and s.output.error is not None)
                )
                log(f"{label}: {summary['errors']} requests failed, e.g. {type(first).__name__}: {first}")
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return report


def format_endpoint_report(rep: dict) -> str:
    from .report import _ms

    w = rep["workload"]
    arrival = "all at t=0" if w["arrival"] == "all" else f"Poisson, {w['rate']} req/s"
    lines = [
        f"workbench bench --endpoint: {w['num_requests']} requests ({arrival}), {w['prompt_tokens']:,} prompt + "
        f"{w['output_tokens']:,} output tokens asked ({w['prompt_format']} prompts, seed {w['seed']}, "
        f"ignore_eos={w['ignore_eos']})",
        "",
    ]
    header = (
        f"{'endpoint':<34}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
        f"{'ITL p99':>9}{'errors':>7}"
    )
    lines += [header, "-" * len(header)]
    for name, r in rep["results"].items():
        lines.append(
            f"{name:<34}{r['output_tok_s']:>10.1f}{r['request_throughput']:>8.2f}{_ms(r['ttft_p50_ms']):>10}"
            f"{_ms(r['ttft_p99_ms']):>10}{_ms(r['itl_p50_ms']):>9}{_ms(r['itl_p99_ms']):>9}{r['errors']:>7}"
        )
    for name, e in rep["endpoints"].items():
        extra = f"; dropped params: {', '.join(e['dropped_params'])}" if e["dropped_params"] else ""
        lines.append(
            f"{name}: {e['server']} serving {e['model']!r} at {e['url']}"
            f"{'' if e['metrics_endpoint'] else ' (no /metrics)'}{extra}"
        )
    lines += rep.get("notes", [])
    return "\n".join(lines)


def _deadline(timeout: float | None) -> Callable[[], None] | None:
    """A driver `check` that stops the run after `timeout` seconds (None: never)."""
    if timeout is None:
        return None
    end = time.monotonic() + timeout

    def check() -> None:
        if time.monotonic() > end:
            raise TimeoutError(f"the endpoint run did not finish within {timeout}s")

    return check
