"""What a benchmark report concludes: each system's fraction of the roofline, ours over each
peer's throughput (and, both served over HTTP, vLLM's latencies), how far greedy outputs agree,
and the targets met."""

from __future__ import annotations

from .stats import RequestRecord

# The targets: (ratio, what it is, at least)
TARGETS = (
    ("workbench_vs_hf_sequential", "throughput vs hf_sequential", 8.0),
    ("workbench_vs_hf_static", "throughput vs hf_static", 2.0),
    ("workbench_vs_llama_server", "throughput vs llama_server", 1.5),
    # issue 27: W64 output tok/s, both servers through the same client
    ("workbench_http_vs_vllm", "throughput vs vllm (both served over HTTP)", 1.3),
)
TARGET_SINGLE_STREAM_BW_FRACTION = 0.60


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


def add_comparisons(report: dict, records: dict[str, list[RequestRecord]]) -> None:
    """The report's `roofline_fraction`, `ratios`, `token_agreement` and `targets`."""
    results = report["results"]
    report["roofline_fraction"] = _roofline_fractions(results, report["roofline"])
    report["ratios"] = ratios = _ratios(results)
    agreement = {}
    if "workbench" in records:
        for peer in ("hf_sequential", "hf_static"):
            if peer in records:
                agreement[peer] = token_agreement(records["workbench"], records[peer])
    if "workbench_single_stream" in records and "hf_single_stream" in records:
        agreement["hf_single_stream"] = token_agreement(records["workbench_single_stream"], records["hf_single_stream"])
    report["token_agreement"] = agreement
    targets = [
        {"name": name, "value": ratios[key], "target": least, "met": ratios[key] >= least}
        for key, name, least in TARGETS
        if key in ratios
    ]
    ss = results.get("workbench_single_stream")
    if ss:
        v, least = ss["bandwidth_fraction"], TARGET_SINGLE_STREAM_BW_FRACTION
        targets.append({"name": "single-stream decode, fraction of bandwidth roofline", "value": v, "target": least,
                        "met": v >= least})  # fmt: skip
    report["targets"] = targets


def _roofline_fractions(results: dict, roof: dict) -> dict[str, float]:
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
    return fractions


def _ratios(results: dict) -> dict[str, float]:
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
    return ratios
