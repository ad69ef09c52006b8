"""Round trip of a one-token request through an engine process (p50/p90 of 400, after 20 warm-ups).

python docs/probes/request_latency.py LABEL
"""

import sys
import time

from workbench import SamplingParams
from workbench.ipc.launch import start_engine

eng = start_engine(None, name=f"latency-{sys.argv[1] if len(sys.argv) > 1 else 'probe'}")
params = SamplingParams(max_tokens=1, temperature=0)
prompt = "The quick brown fox jumps over the lazy dog"
for _ in range(20):
    eng.generate(prompt, params)
times = []
for _ in range(400):
    t = time.perf_counter()
    eng.generate(prompt, params)
    times.append(time.perf_counter() - t)
times.sort()
print(f"p50 {times[200] * 1e3:.2f} ms, p90 {times[360] * 1e3:.2f} ms")
eng.shutdown()
