"""The `structured` scenario (`scenarios.py` runs it): W64 asking for JSON lists of people,
served free and under a JSON schema (jump-forward on and off), in this process; with peers, the
same workloads over HTTP on `workbench serve --http` and on vLLM's server."""

from __future__ import annotations

from typing import Any

from .driver import run_workload
from .stats import summarize
from .workload import BenchRequest, Workload

STRUCTURED_VS_FREE = 0.95  # the target: constrained output tok/s over free

# People as JSON, more of them than max_tokens can hold: every constrained request runs to max_tokens.
PEOPLE_SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 24},
            "email": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age", "city", "email"],
    },
}
_CITIES = ("Lisbon", "Oslo", "Kyoto", "Lima", "Accra", "Perth", "Quito", "Tartu")


def structured_requests(engine, num_requests: int, output_len: int) -> list[BenchRequest]:
    """Chat prompts asking for a JSON list of people (each names another city and count)."""
    tok = engine.tokenizer
    out = []
    for i in range(num_requests):
        ask = (
            f"List {10 + i % 30} people who live in {_CITIES[i % len(_CITIES)]} as a JSON array of objects "
            "with their name, age, city and email."
        )
        text = tok.apply_chat_template(ask) if tok is not None else None
        ids = tok.encode(text, add_special_tokens=False) if tok is not None else [1 + i, 2 + i, 3 + i]
        out.append(BenchRequest(i, ids, output_len))
    return out


def structured_scenario(
    engine,
    *,
    num_requests: int = 64,
    output_len: int = 128,
    rounds: int = 3,
    vllm_python: str | None = None,
    model=None,
) -> dict:
    from ..sampling_params import StructuredOutput

    requests = structured_requests(engine, num_requests, output_len)
    schema = StructuredOutput(json=PEOPLE_SCHEMA)
    out: dict[str, Any] = {
        "workload": {
            "requests": num_requests,
            "arrival": "all at once",
            "prompt_tokens": sum(r.prompt_len for r in requests),
            "max_tokens": output_len,
            "schema": "a JSON array of >= 40 people (name, age, city, email): never closes within max_tokens",
        }
    }
    modes = (("free", None, True), ("json", schema, True), ("json_no_jump", schema, False))
    # the whole workload once first: its first run also pays for touching the KV cache's pages
    run_workload(engine, requests, ignore_eos=True)
    # W64, and one stream (where a step is memory-bound, forced tokens ride along almost free)
    by_mode: dict[str, list[dict]] = {}
    for _ in range(rounds):  # the modes take turns, so a drift of the host touches each alike
        for name, constraint, jump in modes:
            engine.configure(jump_forward=jump)
            by_mode.setdefault(name, []).append(_structured_run(engine, requests, constraint))
            by_mode.setdefault(f"{name}_single_stream", []).append(_structured_run(engine, requests[:1], constraint))
    for name, runs in by_mode.items():  # each mode's median run
        runs.sort(key=lambda r: r["output_tok_s"])
        out[name] = {**runs[len(runs) // 2], "output_tok_s_runs": [r["output_tok_s"] for r in runs]}
    engine.configure(jump_forward=True)
    out["structured_vs_free"] = out["json"]["output_tok_s"] / out["free"]["output_tok_s"]
    out["structured_no_jump_vs_free"] = out["json_no_jump"]["output_tok_s"] / out["free"]["output_tok_s"]
    out["single_stream_structured_vs_free"] = (
        out["json_single_stream"]["output_tok_s"] / out["free_single_stream"]["output_tok_s"]
    )
    out["single_stream_no_jump_vs_free"] = (
        out["json_no_jump_single_stream"]["output_tok_s"] / out["free_single_stream"]["output_tok_s"]
    )
    out["target"] = STRUCTURED_VS_FREE
    if vllm_python is not None:
        out.update(_structured_peers(engine, requests, schema, vllm_python, model))
    return out


def _structured_run(engine, requests: list[BenchRequest], constraint) -> dict:
    """One run of the workload, free (EOS ignored) or under `constraint`, with its steps' story."""

    run_workload(engine, requests[:2], structured=constraint, ignore_eos=constraint is None)  # warm, compiled
    before = engine.metrics()
    since = engine.engine.timeline.next_seq()
    records, start = run_workload(engine, requests, structured=constraint, ignore_eos=constraint is None)
    after = engine.metrics()
    steps = engine.engine.timeline.read(since).steps
    busy = sum(s.end - s.start for s in steps)
    summary = summarize(records, start)

    def delta(key: str) -> int:
        return after[key] - before[key]

    return {
        "output_tok_s": summary["output_tok_s"],
        "itl_p50_ms": summary["itl_p50_ms"],
        "tokens": sum(len(r.token_ids) for r in records),
        "steps": len(steps),
        "mask_share": sum(s.parts.get("mask", 0.0) for s in steps) / 1e3 / busy if busy else 0.0,
        "jump_forward_tokens": delta("total_jump_forward_tokens"),
        "jump_forward_proposed": delta("total_jump_forward_proposed"),
    }


def _structured_peers(engine, requests, schema, vllm_python: str, model) -> dict:
    """The free and constrained workloads over HTTP on our server and on vLLM's (same client)."""
    import os

    import torch

    from .server_peer import serve_workloads
    from .vllm_peer import run_vllm_server, workbench_http_server

    runs = {
        "free": Workload(requests, seed=0),
        "json": Workload(requests, seed=0, extra={"structured": schema}),
    }
    out: dict[str, Any] = {}
    peer = workbench_http_server(model, {}, name=f"bench-structured-{os.getpid()}")
    ours, how = serve_workloads(peer, runs)
    out["workbench_http"] = {k: _peer_numbers(v) for k, v in ours.items()} | {"how": how}
    hf = engine.engine.model_config.path
    try:
        theirs, how = run_vllm_server(
            vllm_python, hf, runs, threads=torch.get_num_threads(), max_num_seqs=len(requests)
        )
        out["vllm"] = {k: _peer_numbers(v) for k, v in theirs.items()} | {"how": how}
        out["vllm_structured_vs_free"] = out["vllm"]["json"]["output_tok_s"] / out["vllm"]["free"]["output_tok_s"]
        out["workbench_http_structured_vs_vllm"] = (
            out["workbench_http"]["json"]["output_tok_s"] / out["vllm"]["json"]["output_tok_s"]
        )
    except RuntimeError as e:
        out["vllm_error"] = str(e)
    return out


def _peer_numbers(summary: dict) -> dict:
    keys = ("output_tok_s", "itl_p50_ms", "ttft_p50_ms", "errors", "output_tokens")
    return {k: summary[k] for k in keys if k in summary}
