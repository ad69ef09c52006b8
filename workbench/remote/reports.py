"""What a remote OpenAI-compatible server reports about itself, in our names: its settings (each
dialect says them its own way) and its metrics (this client's own measurements, and the server's
Prometheus /metrics where it has them)."""

from __future__ import annotations

import json
import time
from typing import Any

from .prometheus import parse_prometheus, server_metrics
from .wire import sglang_settings

_TOK_WINDOW_S = 10.0  # output_tok_s window (as the engine's metrics())


async def server_settings(client) -> dict:
    """What the server reports about its settings, under our setting names (read-only)."""
    from ..settings import setting_names

    out: dict[str, Any] = {}
    if client.kind == "workbench":
        got = await client._get_json("/workbench/settings")
        out = dict(got.get("settings") or {})
    elif client.kind == "vllm" and client.has_metrics:
        text = await client._get_text("/metrics")
        info = (parse_prometheus(text).get("vllm:cache_config_info") or [({}, 0)])[0][0] if text else {}
        if info.get("block_size", "").isdigit():
            out["block_size"] = int(info["block_size"])
        if info.get("num_gpu_blocks", "").isdigit():
            out["num_kv_blocks"] = int(info["num_gpu_blocks"])
        if "enable_prefix_caching" in info:
            out["prefix_caching"] = info["enable_prefix_caching"].lower() == "true"
        if info.get("cache_dtype"):
            out["kv_cache_dtype"] = info["cache_dtype"]
    elif client.kind == "sglang":
        for path in ("/get_server_info", "/server_info"):
            text = await client._get_text(path)
            if text:
                out = sglang_settings(json.loads(text))
                break
    elif client.kind == "llama.cpp":
        text = await client._get_text("/props")
        if text:
            props = json.loads(text)
            if isinstance(props.get("total_slots"), int):
                out["max_num_seqs"] = props["total_slots"]
            n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
            if isinstance(n_ctx, int):
                out["max_model_len"] = n_ctx
    if client.max_model_len and "max_model_len" not in out:
        out["max_model_len"] = client.max_model_len
    known = set(setting_names())
    return {k: v for k, v in out.items() if k in known and v is not None}


async def metrics_of(client, recent: list, pending: list, totals: dict) -> dict:
    """The engine's metrics, as far as this client and the server can tell: latencies and
    throughput from this client's own requests, the server's /metrics where it has one (each
    metric's `sources` says which); what nobody reports is absent, never made up."""
    from ..reports import percentile

    now = time.monotonic()
    ttft = [o.metrics.ttft for o in recent if o.metrics.ttft is not None]
    itl = [x for o in recent for x in o.metrics.itl]
    window = [t for o in recent for t in o.metrics.token_times if t >= now - _TOK_WINDOW_S]
    running = sum(1 for p in pending if p.first is not None)
    m: dict[str, Any] = {
        "output_tok_s": len(window) / _TOK_WINDOW_S if window else 0.0,
        "num_waiting": len(pending) - running,
        "num_running": running,
        "kv_blocks_used": None,
        "kv_blocks_total": None,
        "kv_usage": None,
        "prefix_hit_rate": None,
        "spec_acceptance_rate": None,
        "spec_mean_accepted": None,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "total_prompt_tokens": totals["prompt_tokens"],
        "total_output_tokens": totals["output_tokens"],
        "total_finished": totals["finished"],
    }
    sources = {
        k: "client"
        for k in (
            "output_tok_s",
            "num_waiting",
            "num_running",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "itl_p50_ms",
            "itl_p99_ms",
            "total_prompt_tokens",
            "total_output_tokens",
            "total_finished",
        )
    }
    m["client_num_waiting"], m["client_num_running"] = m["num_waiting"], m["num_running"]
    if client.has_metrics:
        text = await client._get_text("/metrics")
        if text:
            srv = server_metrics(parse_prometheus(text))
            gen = srv.get("total_output_tokens")
            if gen is not None and "output_tok_s" not in srv:
                last = client._last_scrape
                if last is not None and now > last[0] and gen >= last[1]:
                    srv["output_tok_s"] = (gen - last[1]) / (now - last[0])
                client._last_scrape = (now, gen)
            m.update(srv)
            sources.update({k: "server" for k in srv})
    m = {k: v for k, v in m.items() if v is not None}  # absent: nobody reports it (never made up)
    m["sources"] = {k: v for k, v in sources.items() if k in m}
    m["remote"] = client.base
    return m
