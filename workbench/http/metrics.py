"""`/metrics` in Prometheus text format, with vLLM's metric names under the `workbench:` prefix.

Where a metric means what vLLM's does, it has vLLM's name with `vllm:` replaced by
`workbench:` (so a vLLM dashboard or a `RemoteEngineClient` reads both the same way):

- gauges, read from the engine at scrape time: ``num_requests_running``,
  ``num_requests_waiting``, ``kv_cache_usage_perc`` (0..1), ``cache_config_info`` (labels);
  plus vLLM v0's convenience gauges ``prefix_cache_hit_rate``,
  ``spec_decode_draft_acceptance_rate`` and ``avg_generation_throughput_toks_per_s``;
- counters, from the engine's totals (every request of the engine, whoever sent it):
  ``prompt_tokens_total``, ``generation_tokens_total``, ``prefix_cache_queries_total`` /
  ``prefix_cache_hits_total`` (tokens), ``spec_decode_num_drafts_total``,
  ``spec_decode_num_draft_tokens_total``, ``spec_decode_num_accepted_tokens_total``,
  ``num_preemptions_total``; and ``request_success_total{finished_reason}`` for requests
  served over HTTP, and behind a router ``routed_requests_total{member,policy}`` (ours);
- histograms, observed for every request served over HTTP, from the engine's own timestamps:
  ``time_to_first_token_seconds``, ``inter_token_latency_seconds``,
  ``e2e_request_latency_seconds``, ``request_queue_time_seconds``, ``request_prompt_tokens``,
  ``request_generation_tokens``.

Every sample carries a ``model_name`` label, as vLLM's do.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..outputs import RequestOutput

PREFIX = "workbench:"
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# vLLM's buckets.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)

# engine totals -> counter names (without _total, which the exposition adds)
_COUNTERS = (
    ("prompt_tokens", "total_prompt_tokens", "Prefill tokens processed (all requests of the engine)."),
    ("generation_tokens", "total_output_tokens", "Generated tokens (all requests of the engine)."),
    ("prefix_cache_queries", "total_prompt_tokens", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "total_prefix_hit_tokens", "Prompt tokens found in the prefix cache."),
    ("spec_decode_num_drafts", "total_spec_verifies", "Speculative verification steps."),
    ("spec_decode_num_draft_tokens", "total_spec_proposed", "Draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "total_spec_accepted", "Draft tokens accepted."),
    ("num_preemptions", "total_preemptions", "Preemptions (requests swapped out for KV space)."),
)
_GAUGES = (
    ("num_requests_running", "num_running", "Requests in the running batch."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_usage", "KV cache usage (1 = full)."),
    ("prefix_cache_hit_rate", "prefix_hit_rate", "Prompt tokens served from the prefix cache, since start."),
    ("spec_decode_draft_acceptance_rate", "spec_acceptance_rate", "Accepted / proposed draft tokens, since start."),
    ("avg_generation_throughput_toks_per_s", "output_tok_s", "Output tokens per second over the last seconds."),
    ("process_cpu_cores", "process_cpu_cores", "CPU the engine process used, in cores (since the last sample)."),
    ("host_cpu_usage_perc", "host_cpu_percent", "CPU use of the whole host, percent of all cores."),
    ("process_resident_memory_mb", "process_rss_mb", "Resident memory of the engine process, MiB."),
    ("host_memory_usage_perc", "host_mem_percent", "Memory use of the whole host, percent."),
)


class _EngineCollector:
    """Gauges and counters from the engine's `metrics()` dict, fetched by the scrape handler."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.metrics: dict[str, Any] | None = None
        self.config: dict[str, str] | None = None

    def collect(self):
        m = self.metrics
        if m is None:
            return
        # A cluster's metrics carry each replica's: one sample per replica, labelled by it (sum() in
        # PromQL gives the cluster's); one engine's have the model's label only.
        per = m.get("per_replica")
        rows = [([self.model_name, name], r) for name, r in per.items()] if per else [([self.model_name], m)]
        labels = ["model_name", "replica"] if per else ["model_name"]
        for families, cls in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            for name, key, doc in families:
                samples = [(values, r[key]) for values, r in rows if isinstance(r.get(key), (int, float))]
                if samples:
                    family = cls(PREFIX + name, doc, labels=labels)
                    for values, v in samples:
                        family.add_metric(values, float(v))
                    yield family
        if per and m.get("router"):
            routed = CounterMetricFamily(
                "workbench:routed_requests", "Requests the cluster's router sent to each replica.", labels=labels
            )
            for name, stats in m["router"].items():
                routed.add_metric([self.model_name, name], float(stats.get("served", 0)))
            yield routed
        if self.config:
            keys = sorted(self.config)
            g = GaugeMetricFamily(
                PREFIX + "cache_config_info", "Information of the KV cache configuration.", labels=["model_name", *keys]
            )
            g.add_metric([self.model_name, *(self.config[k] for k in keys)], 1.0)
            yield g


class FrontMetrics:
    """The HTTP front's Prometheus registry (its own, not the process-global one)."""

    def __init__(self, model_name: str):
        prometheus_client.disable_created_metrics()  # no *_created series (as vLLM)
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token (engine clock).", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.gen_tokens = hist("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS)
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests served over HTTP.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.routed = Counter(
            PREFIX + "routed_requests",
            "Requests a router answered, by the member that answered and the policy that chose it.",
            ["model_name", "member", "policy"],
            registry=self.registry,
        )
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)

    def observe(self, out: RequestOutput) -> None:
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(max(0.0, m.ttft))
        for gap in m.itl:
            self.itl.observe(max(0.0, gap))
        if m.finished is not None:
            self.e2e.observe(max(0.0, m.finished - m.arrival))
        if m.queued is not None:
            self.queue.observe(max(0.0, m.queued))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.gen_tokens.observe(len(out.token_ids))
        self.success.labels(self.model_name, out.finish_reason or "unknown").inc()
        if out.route is not None:
            self.routed.labels(self.model_name, out.route, out.route_policy or "").inc()

    def render(self, engine_metrics: dict | None, settings: dict | None = None, status: dict | None = None) -> bytes:
        self.engine.metrics = engine_metrics
        if settings is not None and status is not None:
            self.engine.config = {
                "block_size": str(status.get("block_size", "")),
                "num_gpu_blocks": str(status.get("num_kv_blocks", "")),
                "cache_dtype": str(settings.get("kv_cache_dtype", "")),
                "enable_prefix_caching": str(bool(settings.get("prefix_caching"))),
            }
        return prometheus_client.generate_latest(self.registry)
