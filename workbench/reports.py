"""What an engine reports, defined once: `EngineMetrics` (`metrics()`) and `EngineStatus` /
`ProcessStatus` (`status()`).

`metrics()` and `status()` return these structs as plain dicts (the public contract), so every
front end reads the same keys: the engine process and HTTP front pass them on, `/metrics`
exposes metric fields under vLLM's Prometheus names (`http/metrics.py`), a remote client maps
other servers' metrics onto these field names (`remote/prometheus.py`; only those the server
reports), and the lab panel reads them by these names (`extension/src/model.ts`; a test checks).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "EngineMetrics",
    "EngineStatus",
    "ProcessStatus",
    "TOTALS",
    "as_dict",
    "combine_metrics",
    "metric_fields",
    "percentile",
]

# Running totals since the engine started; metrics() carries each as total_<name>.
TOTALS = (
    "prompt_tokens",
    "prefix_hit_tokens",
    "output_tokens",
    "spec_proposed",
    "spec_accepted",
    "spec_verifies",
    "finished",
    "preemptions",
    "response_cache_hits",
    "jump_forward_proposed",  # tokens structured requests' grammars forced (jump-forward)
    "jump_forward_tokens",  # of those, kept by their verify steps: model steps saved
    "grammar_compiles",  # grammars compiled (a schema seen before is served from the cache)
    "overlapped_steps",  # steps launched before the last one's tokens were read (async_scheduling)
)


class EngineMetrics(msgspec.Struct, kw_only=True):
    output_tok_s: float  # output tokens per second over the last window_s seconds
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float  # used / total, 0..1
    prefix_hit_rate: float  # prompt tokens served from the prefix cache, since start
    spec_acceptance_rate: float  # accepted / proposed draft tokens, since start
    spec_mean_accepted: float  # accepted draft tokens per verify step, since start
    window_s: float  # the window of output_tok_s and step_parts_share
    recent_requests: int  # the last finished requests (at most 1000) the latency percentiles are over
    ttft_p50_ms: float  # over the recently finished requests
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    # MoE models, over the same window: tokens per expert of each MoE layer, each layer's imbalance
    # (busiest expert's load / the mean; None for a layer no token reached) and the worst layer's
    # (None on dense models or when idle). Views draw these; none re-derives them.
    expert_load: list[list[int]] = msgspec.field(default_factory=list)
    moe_layer_imbalance: list[float | None] = msgspec.field(default_factory=list)
    moe_imbalance: float | None = None
    # What serving costs the machine (`workbench.engine.hostload`; None where not measured, e.g. a remote
    # server): the engine process's CPU in cores and memory, and the whole host's
    process_cpu_cores: float | None = None
    host_cpu_percent: float | None = None
    host_cpus: int | None = None
    process_rss_mb: float | None = None
    host_mem_percent: float | None = None
    # Where the steps of the window spent their time: each of `timeline.STEP_PARTS`' share, and
    # the part that took most (what limits the engine now; None when idle)
    step_parts_share: dict[str, float] = msgspec.field(default_factory=dict)
    step_limit: str | None = None
    # On CUDA, the window's share of device time spent on steps, not waiting for the host between
    # them (async_scheduling closes those gaps); None on a CPU (the host is the device)
    device_busy_share: float | None = None
    total_prompt_tokens: int = 0
    total_prefix_hit_tokens: int = 0
    total_output_tokens: int = 0
    total_spec_proposed: int = 0
    total_spec_accepted: int = 0
    total_spec_verifies: int = 0
    total_finished: int = 0
    total_preemptions: int = 0
    total_response_cache_hits: int = 0
    total_jump_forward_proposed: int = 0
    total_jump_forward_tokens: int = 0
    total_grammar_compiles: int = 0
    total_overlapped_steps: int = 0
    response_cache_entries: int = 0


class HostMemoryReport(msgspec.Struct, kw_only=True):
    """What an engine on a CPU may still take of the host's memory (`models.host_memory`), in MiB."""

    limit_mb: int | None  # the host_memory_mb setting
    available_mb: int | None  # the machine's (or its cgroup's) available memory
    reserve_mb: int  # kept free of the engine's memory for the process and the machine
    room_mb: int | None  # what the engine may still take: the smaller bound
    bound: str  # which bound that is, in words
    copies_skipped: dict[str, int]  # copy kind ("tiles", "onednn", "fp32") -> layers serving without it


class EngineStatus(msgspec.Struct, kw_only=True):
    pid: int
    model: str
    device: str
    dtype: str
    uptime_s: float
    weights_checksum: str
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    attention_backend: str  # the backend in use ("torch", "triton", "cpu"), not the setting
    attention_backend_reason: str  # why it serves, and its cost where not obvious (Triton on a CPU)
    # the Triton backend's path for prompts with no cached context ("triton" or "sdpa"), and why
    # (auto: both measured at this model's heads); None on other backends
    prefill_attention: str | None = None
    prefill_attention_reason: str | None = None
    cpu_kernels: bool  # whether the C kernels serve (the setting may ask for them where they cannot)
    kernel_variant: str  # "avx512_bf16", "avx2", "neon", "portable", "torch", "cuda", ...
    kernel_variant_reason: str | None
    compute_path: str  # how large steps multiply: "bf16" / "fp32" (oneDNN in that dtype), "tiles" (our bf16 tiles)
    compute_path_reason: str | None
    max_token_chars: int | None  # longest text one token stands for (None: no bound is provable)
    num_layers: int
    vocab_size: int
    # CUDA graphs (the cuda_graphs setting): the batch sizes captured, steps replayed / run
    # eagerly, and why the last step ran eagerly (None: it replayed)
    cuda_graph_buckets: list[int] = msgspec.field(default_factory=list)
    cuda_graph_steps: dict[str, int] = msgspec.field(default_factory=dict)
    cuda_graph_reason: str | None = None
    # each captured bucket's split-KV count (cuda_graphs.graph_splits), bucket as a string; {} before capture
    cuda_graph_splits: dict[str, int] = msgspec.field(default_factory=dict)
    # MiB held on the device: "weights", each copy of them the kernels made ("tiles", "onednn",
    # "quantized", "dequantized", "fp32"), "kv_cache", "draft" (`model_runner.memory_mb`)
    memory_mb: dict[str, float] = msgspec.field(default_factory=dict)
    # on a CPU, what bounds that memory (`models.host_memory`); None on CUDA
    host_memory: HostMemoryReport | None = None


class ProcessStatus(EngineStatus, kw_only=True):
    """An engine process adds who it is and who is attached; its uptime is the process's."""

    name: str
    protocol: int
    transport: str
    num_clients: int
    num_requests: int
    connection_file: str | None
    # the process's start on this host's monotonic clock (the timeline's): the views' x = 0
    started_monotonic: float | None = None


def as_dict(report: msgspec.Struct) -> dict[str, Any]:
    """The report's fields, a nested report (host_memory) as a dict too."""
    return {k: as_dict(v) if isinstance(v, msgspec.Struct) else v for k, v in msgspec.structs.asdict(report).items()}


def metric_fields() -> tuple[str, ...]:
    return EngineMetrics.__struct_fields__


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks (numpy's
    default method). 0.0 for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    v = sorted(values)
    if not v:
        return 0.0
    k = (len(v) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


# metrics() fields summed over engines (counts and rates); the others are each engine's worst
ADDITIVE = (
    "output_tok_s",
    "num_waiting",
    "num_running",
    "kv_blocks_used",
    "kv_blocks_total",
    "process_cpu_cores",
    "process_rss_mb",
)

LOWER_IS_WORSE = ("device_busy_share",)


def combine_metrics(per: dict[str, dict]) -> dict[str, Any]:
    """Several engines' metrics as one (a cluster's replicas, a router's members): counts and
    rates summed, latencies and the like each engine's worst, KV usage over all blocks."""
    out: dict[str, Any] = {}
    for m in per.values():
        for k, v in m.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if k in ADDITIVE or k.startswith("total_"):
                out[k] = out.get(k, 0) + v
            elif k in LOWER_IS_WORSE:
                out[k] = min(out.get(k, v), v)
            else:
                out[k] = max(out.get(k, v), v)
    total = out.get("kv_blocks_total")
    if total:
        out["kv_usage"] = out.get("kv_blocks_used", 0) / total
    return out
