"""Import + load time of an in-process engine, then the TTFT of three 64-token prompts in turn: a
first prompt that pays for work the engine left undone at load shows as the first figure.

    python docs/probes/first_prompt.py [MODEL]   (run it from two builds in turn to compare)
"""

import sys
import time

t0 = time.perf_counter()
from workbench import LLM, SamplingParams  # noqa: E402

llm = LLM(model=sys.argv[1] if len(sys.argv) > 1 else None)
load = time.perf_counter() - t0
sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
ttft = [llm.generate(prompt_token_ids=[[11 + i] * 64], params=sp)[0].metrics.ttft * 1e3 for i in range(3)]
print(f"import+load {load:.2f} s; 64-token TTFT " + " / ".join(f"{t:.0f}" for t in ttft) + " ms")
print("memory_mb", llm.engine.status()["memory_mb"])
