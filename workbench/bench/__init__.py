"""`workbench bench`: our engine against Hugging Face transformers on one seeded workload,
with the machine's roofline measured on the spot.

    from workbench.bench import run_bench, format_report
    report = run_bench(systems=["workbench", "hf_static"], num_requests=16)
    print(format_report(report))

Modules: `runner` (`run_bench`: the systems side by side), `driver` (the workload driver every
measurement goes through), `workload` (seeded workloads), `roofline` (the host's limits),
`peers` (transformers), `llama_cpp` (llama.cpp's server), `endpoint` (any OpenAI-compatible
server), `scenarios` (prefix, quant, spec, stall), `stats`, `report`.
"""

from .report import format_report
from .runner import SYSTEMS, run_bench
from .stats import RESULT_KEYS, RequestRecord, percentile, summarize
from .workload import BenchRequest, Workload, make_workload

__all__ = [
    "SYSTEMS",
    "RESULT_KEYS",
    "BenchRequest",
    "RequestRecord",
    "Workload",
    "format_report",
    "make_workload",
    "percentile",
    "run_bench",
    "summarize",
]
