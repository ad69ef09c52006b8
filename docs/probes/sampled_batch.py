"""64 sampled requests (temperature 0.8, 128 tokens each) in-process: wall time and the decode
step's p50, three rounds.

    python docs/probes/sampled_batch.py LABEL
"""

import statistics
import sys
import time

from workbench import LLM, SamplingParams

llm = LLM()
p = SamplingParams(max_tokens=128, temperature=0.8, ignore_eos=True, seed=1)
prompts = [f"Story number {i}: once upon a time" for i in range(64)]
llm.generate(prompts[:8], SamplingParams(max_tokens=8))
for _ in range(3):
    t = time.perf_counter()
    llm.generate(prompts, p)
    dt = time.perf_counter() - t
    steps = [s for s in llm.engine.timeline.steps if s.phase == "decode"][-100:]
    print(
        sys.argv[1], f"total {dt:.2f}s decode step p50 {statistics.median(s.end - s.start for s in steps) * 1e3:.2f} ms"
    )
