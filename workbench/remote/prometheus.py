"""Prometheus text exposition, parsed, and the engine metrics a serving engine's `/metrics` gives
(vLLM `vllm:*`, SGLang `sglang:*`, llama.cpp `llamacpp:*`, TGI `tgi_*`, ours `workbench:*`)."""

from __future__ import annotations

from typing import Any


# -- Prometheus -----------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _sum(samples, name: str) -> float | None:
    got = samples.get(name)
    return sum(v for _, v in got) if got else None


def _mean(samples, name: str) -> float | None:
    got = samples.get(name)
    return sum(v for _, v in got) / len(got) if got else None


def histogram_quantile(samples, name: str, q: float) -> float | None:
    """Prometheus' histogram_quantile over `name`_bucket (summed over other labels)."""
    buckets: dict[float, float] = {}
    for labels, value in samples.get(name + "_bucket", []):
        le = labels.get("le")
        if le is None:
            continue
        bound = float("inf") if le in ("+Inf", "Inf") else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + value
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        count = buckets[b]
        if count >= rank:
            if b == float("inf"):
                return prev_bound
            if count == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = b, count
    return prev_bound


# name prefix -> where our metric keys come from
_FAMILIES: dict[str, dict[str, Any]] = {
    "vllm:": {},
    "workbench:": {},  # vLLM's names (ours mirror them)
    "sglang:": {
        "running": "num_running_reqs",
        "waiting": "num_queue_reqs",
        "kv": ("token_usage",),
        "prefix_rate": "cache_hit_rate",
        "spec_len": "spec_accept_length",
        "tok_s": "gen_throughput",
        "gen": "generation_tokens_total",
        "prompt": "prompt_tokens_total",
    },
    "llamacpp:": {
        "running": "requests_processing",
        "waiting": "requests_deferred",
        "kv": ("kv_cache_usage_ratio",),
        "gen": "tokens_predicted_total",
        "prompt": "prompt_tokens_total",
        "tok_s": "predicted_tokens_seconds",
    },
    "tgi_": {"running": "batch_current_size", "waiting": "queue_size"},
}
_VLLM_NAMES = {
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "kv": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_rate": "gpu_prefix_cache_hit_rate",
    "prefix_hits": "prefix_cache_hits_total",
    "prefix_queries": "prefix_cache_queries_total",
    "spec_rate": "spec_decode_draft_acceptance_rate",
    "spec_accepted": "spec_decode_num_accepted_tokens_total",
    "spec_draft": "spec_decode_num_draft_tokens_total",
    "gen": "generation_tokens_total",
    "prompt": "prompt_tokens_total",
    "finished": "request_success_total",
    "ttft": "time_to_first_token_seconds",
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
}
_FAMILIES["vllm:"] = _FAMILIES["workbench:"] = _VLLM_NAMES
_FAMILIES["sglang:"].update(
    ttft="time_to_first_token_seconds", itl=("inter_token_latency_seconds", "time_per_output_token_seconds")
)


def metrics_prefix(samples) -> str | None:
    for prefix in ("workbench:", "vllm:", "sglang:", "llamacpp:", "tgi_"):
        if any(name.startswith(prefix) for name in samples):
            return prefix
    return None


def server_metrics(samples) -> dict[str, Any]:
    """Our metric keys from a parsed /metrics (only those the server reports)."""
    prefix = metrics_prefix(samples)
    if prefix is None:
        return {}
    names = _FAMILIES[prefix]
    out: dict[str, Any] = {}

    def first(key, fn=_sum):
        spec = names.get(key)
        for n in (spec,) if isinstance(spec, str) else spec or ():
            v = fn(samples, prefix + n)
            if v is not None:
                return v
        return None

    if (v := first("running")) is not None:
        out["num_running"] = int(v)
    if (v := first("waiting")) is not None:
        out["num_waiting"] = int(v)
    if (v := first("kv", _mean)) is not None:
        out["kv_usage"] = v
    hits, queries = first("prefix_hits"), first("prefix_queries")
    if hits is not None and queries:
        out["prefix_hit_rate"] = hits / queries
    elif (v := first("prefix_rate", _mean)) is not None:
        out["prefix_hit_rate"] = v
    acc, draft = first("spec_accepted"), first("spec_draft")
    if acc is not None and draft:
        out["spec_acceptance_rate"] = acc / draft
    elif (v := first("spec_rate", _mean)) is not None:
        out["spec_acceptance_rate"] = v
    if (v := first("spec_len", _mean)) is not None:
        out["spec_mean_accepted"] = v
    if (v := first("gen")) is not None:
        out["total_output_tokens"] = int(v)
    if (v := first("prompt")) is not None:
        out["total_prompt_tokens"] = int(v)
    if (v := first("tok_s")) is not None:
        out["output_tok_s"] = v
    for key, label in (("ttft", "ttft"), ("itl", "itl")):
        spec = names.get(key)
        for n in (spec,) if isinstance(spec, str) else spec or ():
            if prefix + n + "_bucket" in samples:
                for q in (50, 99):
                    v = histogram_quantile(samples, prefix + n, q / 100)
                    if v is not None:
                        out[f"server_{label}_p{q}_ms"] = v * 1e3
                break
    info = samples.get(prefix + "cache_config_info")
    if info:
        labels = info[0][0]
        if str(labels.get("num_gpu_blocks", "")).isdigit():
            out["kv_blocks_total"] = int(labels["num_gpu_blocks"])
    return out
