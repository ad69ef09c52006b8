"""100,000 simulated requests (the bench's default lengths, Poisson at 100 req/s) on one H200 replica
(max_num_seqs 256): wall time of the simulation itself.

    python docs/probes/sim_speed.py
"""

import time

import workbench

sim = workbench.Simulator(profile="h200")
t = time.perf_counter()
reqs = sim.workload({"num_requests": 100_000, "arrival": "poisson", "rate": 100.0, "seed": 0})
print("workload %.1f s" % (time.perf_counter() - t))
t = time.perf_counter()
res = sim.run(
    reqs, {"max_num_seqs": 256, "max_num_batched_tokens": 8192}, replicas=1, timeline_capacity=1000, record=False
)
s = res.summary()
shown = ("output_tok_s", "ttft_p50_ms", "itl_p50_ms", "engine_steps", "duration_s", "kv_usage_peak")
print("100k, 1 replica: %.1f s wall" % (time.perf_counter() - t), {k: round(v, 2) for k, v in s.items() if k in shown})
