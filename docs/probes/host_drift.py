"""How much this host's speed moves while nothing in the engine changes.

    python docs/probes/host_drift.py [iterations]     # 12 by default, ~22 s each here

Each iteration, in one process: the read bandwidth (median of 5 samples of 256 MiB), an fp32
1024^3 matmul's GFLOP/s, a 128-token single stream's ITL p50 and the bench's W64 workload (64
requests at once) on the same in-process LLM. A trend would be the engine's (it ages); scatter
without one is the host's.
"""

import json
import statistics
import sys
import time

import torch

from workbench import LLM
from workbench.bench.driver import run_workload
from workbench.bench.roofline import measure_bandwidth
from workbench.bench.runner import warm_up_engine
from workbench.bench.stats import summarize
from workbench.bench.workload import make_workload

llm = LLM()
vocab = llm.engine.model_config.vocab_size
warm_up_engine(llm, vocab)
w64 = make_workload(tokenizer=llm.tokenizer, seed=0, num_requests=64)
one = make_workload(vocab_size=vocab, num_requests=1, seed=13, prompt_len=(32, 64), output_len=(128, 128))
a = torch.randn(1024, 1024)
t0 = time.time()
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 12):
    bandwidth = statistics.median(measure_bandwidth(1 << 28, repeats=5))
    started = time.perf_counter()
    for _ in range(20):
        a @ a
    gflops = 20 * 2 * 1024**3 / (time.perf_counter() - started) / 1e9
    single = summarize(*run_workload(llm, one.requests))
    llm.reset_prefix_cache()
    burst = summarize(*run_workload(llm, w64.requests))
    print(
        json.dumps(
            {
                "t_s": round(time.time() - t0),
                "bandwidth_gb_s": round(bandwidth, 1),
                "gflops": round(gflops, 1),
                "single_itl_p50_ms": round(single["itl_p50_ms"], 2),
                "w64_tok_s": round(burst["output_tok_s"], 1),
                "w64_ttft_p50_ms": round(burst["ttft_p50_ms"]),
            }
        ),
        flush=True,
    )
